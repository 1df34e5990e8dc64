//! What SLO placement learns from the requests it placed: per placement kind and prompt
//! length class ([`length_class`]), a running linear fit of measured TTFT on predicted,
//! `measured ≈ offset + slope × predicted`, that corrects later predictions. The offset
//! carries what the cost model leaves out at any size (the HTTP and gRPC hops, a pass
//! boundary to wait for, the KV commit); the slope what grows with the work (a worker that
//! gets less of the CPU than its passes' fit assumed, queues that formed between two load
//! reports).
//!
//! Why per length class: what the model misses differs by kind of prompt. A short prompt's
//! TTFT is mostly the pass under way and the prompts arriving with it, a long one's its own
//! compute; one line over both fits the long prompts' seconds and moves a short prompt's
//! tens of milliseconds by their error (on the mixed load of `scripts/bench-goodput`, short
//! prompts' corrected TTFTs went to a quarter of their model's). A class that has not yet
//! seen [`MIN_SEEN`] requests borrows the line of every class of its kind together: that a
//! worker runs slower than its fit says is news for every length.
//!
//! TPOT is not corrected: on a decode worker that paces its streams the prediction is the
//! aim the worker holds them to, and a line fitted over it learned from one wave of streams
//! and taught the next, which ran in another regime (with or without prompt chunks to pace):
//! the corrected TPOT was off by a median 0.13-0.33 where the prediction alone was off by
//! 0.00-0.08 (`scripts/prediction-errors` on `scripts/bench-goodput`'s calls, 2026-11-30).

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

/// Prompt length classes: lengths under 4, under 16, …, under 4^(N-1), and the rest.
pub const LENGTH_CLASSES: usize = 8;

/// The class of a prompt of `tokens` tokens: powers of four (16-63 tokens is class 2, 1024-4095
/// class 5), so that each class's lengths differ by at most four times.
pub fn length_class(tokens: u64) -> usize {
    ((tokens.max(1).ilog2() / 2) as usize).min(LENGTH_CLASSES - 1)
}

/// The lower bound of a length class, in prompt tokens.
pub fn class_floor(class: usize) -> u64 {
    if class == 0 { 0 } else { 1u64 << (2 * class) }
}

/// A learned line, `(offset_ms, slope)`.
pub type Line = (f64, f64);

/// The running TTFT fits, per placement kind: every class together, and each class.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Calibration {
    pooled: [LineFit; 3],
    by_class: [[LineFit; LENGTH_CLASSES]; 3],
}

impl Calibration {
    /// `raw` as this calibration corrects it for a prompt of `prompt_tokens` placed as
    /// `kind`: its TTFT by its class's line, or the pooled one while the class has seen too
    /// few requests; its TPOT as it is.
    pub fn correct(&self, kind: PlacementKind, prompt_tokens: u64, raw: Prediction) -> Prediction {
        let class = &self.by_class[kind.index()][length_class(prompt_tokens)];
        let fit = if class.seen >= MIN_SEEN {
            class
        } else {
            &self.pooled[kind.index()]
        };
        Prediction {
            ttft_ms: fit.correct(raw.ttft_ms),
            tpot_ms: raw.tpot_ms,
        }
    }

    /// Learns from a request of `prompt_tokens` placed as `kind`, with the raw prediction
    /// `raw`, that measured `ttft_ms`.
    pub fn learn(
        &mut self,
        kind: PlacementKind,
        prompt_tokens: u64,
        raw: Prediction,
        ttft_ms: f64,
    ) {
        self.pooled[kind.index()].learn(raw.ttft_ms, ttft_ms);
        self.by_class[kind.index()][length_class(prompt_tokens)].learn(raw.ttft_ms, ttft_ms);
    }

    /// The TTFT lines of `kind`, for `/info`: every class's together, and per class that
    /// has learned anything, its lowest prompt length and its line (the pooled one corrects
    /// a class until it has seen [`MIN_SEEN`] requests).
    pub fn lines(&self, kind: PlacementKind) -> (Line, Vec<(u64, Line)>) {
        let classes = self.by_class[kind.index()]
            .iter()
            .enumerate()
            .filter(|(_, fit)| fit.seen > 0)
            .map(|(class, fit)| (class_floor(class), fit.line()))
            .collect();
        (self.pooled[kind.index()].line(), classes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(ttft_ms: f64, tpot_ms: f64) -> Prediction {
        Prediction { ttft_ms, tpot_ms }
    }

    /// A prompt length in one class.
    const PROMPT: u64 = 2048;

    fn class_line(c: &Calibration, kind: PlacementKind, tokens: u64) -> Line {
        c.lines(kind)
            .1
            .into_iter()
            .find(|(floor, _)| *floor == class_floor(length_class(tokens)))
            .map_or((0.0, 1.0), |(_, l)| l)
    }

    #[test]
    fn length_classes_are_powers_of_four() {
        assert_eq!(length_class(0), 0);
        assert_eq!(length_class(3), 0);
        assert_eq!(length_class(16), 2);
        assert_eq!(length_class(63), 2);
        assert_eq!(length_class(64), 3);
        assert_eq!(length_class(2048), 5);
        assert_eq!(length_class(u64::MAX), LENGTH_CLASSES - 1);
        for class in 0..LENGTH_CLASSES {
            assert_eq!(length_class(class_floor(class).max(1)), class);
        }
    }

    #[test]
    fn a_fixed_overhead_and_a_slow_worker_are_both_learned() {
        let mut c = Calibration::default();
        let kind = PlacementKind::Disaggregated;
        assert_eq!(c.correct(kind, PROMPT, p(100.0, 20.0)), p(100.0, 20.0));
        // Requests of every size measure 60 ms more than twice the prediction.
        for i in 0..400 {
            let raw = p(50.0 + f64::from(i % 20) * 100.0, 20.0);
            c.learn(kind, PROMPT, raw, 60.0 + 2.0 * raw.ttft_ms);
        }
        let (offset, slope) = class_line(&c, kind, PROMPT);
        assert!(
            (slope - 2.0).abs() < 0.01 && (offset - 60.0).abs() < 1.0,
            "{offset} {slope}"
        );
        let small = c.correct(kind, PROMPT, p(10.0, 20.0));
        assert!((small.ttft_ms - 80.0).abs() < 2.0, "{small:?}");
        // TPOT is never corrected.
        assert_eq!(small.tpot_ms, 20.0);
        // The other kind is untouched; a class of this kind that has seen nothing borrows
        // the pooled line.
        assert_eq!(
            c.correct(PlacementKind::Aggregated, PROMPT, p(100.0, 20.0)),
            p(100.0, 20.0)
        );
        let borrowed = c.correct(kind, 16, p(10.0, 20.0));
        assert!((borrowed.ttft_ms - 80.0).abs() < 2.0, "{borrowed:?}");
        assert_eq!(c.lines(kind).1.len(), 1);
    }

    #[test]
    fn short_prompts_learn_apart_from_long_ones() {
        let mut c = Calibration::default();
        let kind = PlacementKind::Aggregated;
        // Long prompts measure half their prediction; short ones wait 60 ms more than
        // predicted for the pass under way.
        for i in 0..100 {
            let long = 4000.0 + f64::from(i % 5) * 1000.0;
            c.learn(kind, 2048, p(long, 20.0), long / 2.0);
            let short = 10.0 + f64::from(i % 5) * 10.0;
            c.learn(kind, 16, p(short, 20.0), short + 60.0);
        }
        let long = c.correct(kind, 2048, p(6000.0, 20.0));
        assert!((long.ttft_ms - 3000.0).abs() < 10.0, "{long:?}");
        let short = c.correct(kind, 16, p(30.0, 20.0));
        assert!((short.ttft_ms - 90.0).abs() < 2.0, "{short:?}");
        // The pooled line, which a new class borrows, is neither.
        let (pooled_offset, pooled_slope) = c.lines(kind).0;
        assert!(pooled_offset != 60.0 && pooled_slope != 0.5);
    }

    #[test]
    fn wild_measurements_are_bounded_and_nonsense_ignored() {
        let mut c = Calibration::default();
        let kind = PlacementKind::Aggregated;
        for _ in 0..100 {
            c.learn(kind, PROMPT, p(100.0, 10.0), 1e12);
            c.learn(kind, PROMPT, p(100.0, 10.0), f64::NAN);
        }
        let (offset, slope) = class_line(&c, kind, PROMPT);
        assert!(slope <= SLOPE_RANGE.1 && offset <= OFFSET_RANGE_MS.1);
        assert!(c.correct(kind, PROMPT, p(0.0, 0.0)).ttft_ms >= 0.0);
        assert!(c.correct(kind, 0, p(0.0, 0.0)).ttft_ms >= 0.0);
    }

    #[test]
    fn a_negative_offset_never_puts_a_small_prediction_at_nothing() {
        let mut c = Calibration::default();
        let kind = PlacementKind::Disaggregated;
        // Large predictions measured 2 s under them, small ones about right: a line with a
        // negative offset.
        for i in 0..100 {
            let raw = if i % 2 == 0 { 10_000.0 } else { 5_000.0 };
            c.learn(kind, PROMPT, p(raw, 50.0), raw - 2_000.0);
        }
        let (offset, _) = class_line(&c, kind, PROMPT);
        assert!(offset < 0.0, "{offset}");
        let small = c.correct(kind, PROMPT, p(100.0, 50.0));
        assert!(small.ttft_ms >= SLOPE_RANGE.0 * 100.0, "{small:?}");
    }
}
