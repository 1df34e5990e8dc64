//! What SLO placement learns from the requests it placed: per placement kind and metric
//! (TTFT, TPOT), a running linear fit of measured on predicted, `measured ≈ offset + slope ×
//! predicted`, that corrects later predictions. The offset carries what the cost model
//! leaves out at any size (the HTTP and gRPC hops, a pass boundary to wait for, the KV
//! commit); the slope what grows with the work (a worker that gets less of the CPU than its
//! passes' fit assumed, queues that formed between two load reports).

use super::placement::{PlacementKind, Prediction};

/// How much one request moves the running averages: about the last 20 count.
const WEIGHT: f64 = 0.05;
/// Requests seen before the fit corrects anything.
const MIN_SEEN: u32 = 3;
/// The slope is held within this range, and the offset within this many milliseconds: a
/// wild measurement must not make the model useless.
const SLOPE_RANGE: (f64, f64) = (0.25, 4.0);
const OFFSET_RANGE_MS: (f64, f64) = (-1000.0, 10_000.0);

/// One running fit of measured (y) on predicted (x): exponentially weighted moments.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct LineFit {
    seen: u32,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

impl LineFit {
    fn learn(&mut self, predicted: f64, measured: f64) {
        if !(predicted.is_finite() && measured.is_finite()) || predicted < 0.0 || measured < 0.0 {
            return;
        }
        let w = if self.seen == 0 { 1.0 } else { WEIGHT };
        self.x += w * (predicted - self.x);
        self.y += w * (measured - self.y);
        self.xx += w * (predicted * predicted - self.xx);
        self.xy += w * (predicted * measured - self.xy);
        self.seen = self.seen.saturating_add(1);
    }

    /// `(offset_ms, slope)`: the least-squares line when the predictions have spread
    /// enough, else the ratio of the means through the origin; identity before MIN_SEEN.
    fn line(&self) -> (f64, f64) {
        if self.seen < MIN_SEEN || self.x <= 0.0 {
            return (0.0, 1.0);
        }
        let var = self.xx - self.x * self.x;
        let (offset, slope) = if var > (0.1 * self.x).powi(2) {
            let slope = ((self.xy - self.x * self.y) / var).clamp(SLOPE_RANGE.0, SLOPE_RANGE.1);
            (self.y - slope * self.x, slope)
        } else {
            (0.0, (self.y / self.x).clamp(SLOPE_RANGE.0, SLOPE_RANGE.1))
        };
        (offset.clamp(OFFSET_RANGE_MS.0, OFFSET_RANGE_MS.1), slope)
    }

    /// `raw` corrected, never below the least slope times it: a line fitted over large
    /// predictions may have a negative offset that would put a small one at nothing.
    fn correct(&self, raw: f64) -> f64 {
        let (offset, slope) = self.line();
        (offset + slope * raw).max(SLOPE_RANGE.0 * raw.max(0.0))
    }
}

/// The running fits, per placement kind and metric.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Calibration {
    fits: [[LineFit; 2]; 3],
}

impl Calibration {
    /// `raw` as this calibration corrects it for `kind`.
    pub fn correct(&self, kind: PlacementKind, raw: Prediction) -> Prediction {
        let [ttft, tpot] = &self.fits[kind.index()];
        Prediction {
            ttft_ms: ttft.correct(raw.ttft_ms),
            tpot_ms: tpot.correct(raw.tpot_ms),
        }
    }

    /// Learns from a request placed as `kind` with the raw prediction `raw` that measured
    /// `ttft_ms` and (with two tokens or more) `tpot_ms`.
    pub fn learn(
        &mut self,
        kind: PlacementKind,
        raw: Prediction,
        ttft_ms: f64,
        tpot_ms: Option<f64>,
    ) {
        let [ttft, tpot] = &mut self.fits[kind.index()];
        ttft.learn(raw.ttft_ms, ttft_ms);
        if let Some(measured) = tpot_ms {
            tpot.learn(raw.tpot_ms, measured);
        }
    }

    /// The lines, for `/info`: `[(offset_ms, slope) for TTFT, for TPOT]` of `kind`.
    pub fn lines(&self, kind: PlacementKind) -> [(f64, f64); 2] {
        let [ttft, tpot] = &self.fits[kind.index()];
        [ttft.line(), tpot.line()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(ttft_ms: f64, tpot_ms: f64) -> Prediction {
        Prediction { ttft_ms, tpot_ms }
    }

    #[test]
    fn a_fixed_overhead_and_a_slow_worker_are_both_learned() {
        let mut c = Calibration::default();
        let kind = PlacementKind::Disaggregated;
        assert_eq!(c.correct(kind, p(100.0, 20.0)), p(100.0, 20.0));
        // Requests of every size measure 60 ms more than twice the prediction.
        for i in 0..400 {
            let raw = p(50.0 + f64::from(i % 20) * 100.0, 20.0);
            c.learn(kind, raw, 60.0 + 2.0 * raw.ttft_ms, Some(25.0));
        }
        let [(offset, slope), (_, tpot_slope)] = c.lines(kind);
        assert!(
            (slope - 2.0).abs() < 0.01 && (offset - 60.0).abs() < 1.0,
            "{offset} {slope}"
        );
        let small = c.correct(kind, p(10.0, 20.0));
        assert!((small.ttft_ms - 80.0).abs() < 2.0, "{small:?}");
        // The TPOT predictions never spread: a ratio through the origin.
        assert!((tpot_slope - 1.25).abs() < 0.01, "{tpot_slope}");
        assert!((small.tpot_ms - 25.0).abs() < 0.1, "{small:?}");
        // The other kind is untouched.
        assert_eq!(
            c.correct(PlacementKind::Aggregated, p(100.0, 20.0)),
            p(100.0, 20.0)
        );
    }

    #[test]
    fn wild_measurements_are_bounded_and_nonsense_ignored() {
        let mut c = Calibration::default();
        let kind = PlacementKind::Aggregated;
        for _ in 0..100 {
            c.learn(kind, p(100.0, 10.0), 1e12, None);
            c.learn(kind, p(100.0, 10.0), f64::NAN, Some(-5.0));
        }
        let [(offset, slope), tpot] = c.lines(kind);
        assert!(slope <= SLOPE_RANGE.1 && offset <= OFFSET_RANGE_MS.1);
        assert_eq!(tpot, (0.0, 1.0), "no TPOT was learned");
        assert!(c.correct(kind, p(0.0, 0.0)).ttft_ms >= 0.0);
    }

    #[test]
    fn a_negative_offset_never_puts_a_small_prediction_at_nothing() {
        let mut c = Calibration::default();
        let kind = PlacementKind::Disaggregated;
        // Large predictions measured 2 s under them, small ones about right: a line with a
        // negative offset.
        for i in 0..100 {
            let raw = if i % 2 == 0 { 10_000.0 } else { 5_000.0 };
            c.learn(kind, p(raw, 50.0), raw - 2_000.0, Some(50.0));
        }
        let [(offset, _), _] = c.lines(kind);
        assert!(offset < 0.0, "{offset}");
        let small = c.correct(kind, p(100.0, 50.0));
        assert!(small.ttft_ms >= SLOPE_RANGE.0 * 100.0, "{small:?}");
    }
}
