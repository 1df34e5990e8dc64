//! Latency targets: the deployment's (`--slo-ttft-ms`, `--slo-ttft-per-token-ms`,
//! `--slo-tpot-ms`) and a request's own, from its headers (`x-tandem-slo-ttft-ms`,
//! `x-tandem-slo-tpot-ms`). A TTFT target grows with the prompt (a fixed part plus a part
//! per prompt token, as DistServe states them): a 4k-token prompt cannot start as fast as
//! a 40-token one on any placement.

use axum::http::HeaderMap;

/// The header that sets a request's whole TTFT target, in milliseconds.
pub const TTFT_HEADER: &str = "x-tandem-slo-ttft-ms";
/// The header that sets a request's TPOT target, in milliseconds.
pub const TPOT_HEADER: &str = "x-tandem-slo-tpot-ms";
/// The largest target a header may set (an hour): beyond that it is no target at all.
const MAX_TARGET_MS: f64 = 3_600_000.0;

/// A deployment's latency targets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SloTargets {
    /// TTFT target: this much...
    pub ttft_ms: f64,
    /// ...plus this much per prompt token.
    pub ttft_per_token_ms: f64,
    /// Time per output token after the first.
    pub tpot_ms: f64,
}

impl Default for SloTargets {
    fn default() -> Self {
        Self {
            ttft_ms: 1000.0,
            ttft_per_token_ms: 1.5,
            tpot_ms: 60.0,
        }
    }
}

impl SloTargets {
    /// Checks the values (positive and finite; the per-token part may be 0).
    pub fn validate(&self) -> Result<(), String> {
        let ok = |v: f64, zero_ok: bool| v.is_finite() && (v > 0.0 || (zero_ok && v == 0.0));
        if !ok(self.ttft_ms, false) || self.ttft_ms > MAX_TARGET_MS {
            return Err("--slo-ttft-ms must be a positive number of milliseconds".into());
        }
        if !ok(self.ttft_per_token_ms, true) || self.ttft_per_token_ms > 1000.0 {
            return Err("--slo-ttft-per-token-ms must be in [0, 1000]".into());
        }
        if !ok(self.tpot_ms, false) || self.tpot_ms > MAX_TARGET_MS {
            return Err("--slo-tpot-ms must be a positive number of milliseconds".into());
        }
        Ok(())
    }

    /// The targets of one request of `prompt_tokens` tokens, with what it asked for itself.
    pub fn for_request(&self, asked: SloAsked, prompt_tokens: usize) -> RequestSlo {
        RequestSlo {
            ttft_ms: asked
                .ttft_ms
                .unwrap_or(self.ttft_ms + self.ttft_per_token_ms * prompt_tokens as f64),
            tpot_ms: asked.tpot_ms.unwrap_or(self.tpot_ms),
        }
    }
}

/// What a request asked for in its headers (each absent: the deployment's).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SloAsked {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
}

impl SloAsked {
    /// Reads the SLO headers; a value that is not a positive number of milliseconds (at most
    /// an hour) is an error naming the header.
    pub fn from_headers(headers: &HeaderMap) -> Result<Self, String> {
        let read = |name: &str| -> Result<Option<f64>, String> {
            let Some(value) = headers.get(name) else {
                return Ok(None);
            };
            let ms = value
                .to_str()
                .ok()
                .and_then(|v| v.trim().parse::<f64>().ok())
                .filter(|v| v.is_finite() && *v > 0.0 && *v <= MAX_TARGET_MS);
            match ms {
                Some(ms) => Ok(Some(ms)),
                None => Err(format!(
                    "header `{name}` must be a number of milliseconds in (0, {MAX_TARGET_MS}]"
                )),
            }
        };
        Ok(Self {
            ttft_ms: read(TTFT_HEADER)?,
            tpot_ms: read(TPOT_HEADER)?,
        })
    }
}

/// One request's targets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestSlo {
    pub ttft_ms: f64,
    pub tpot_ms: f64,
}

/// How much one request moves a pressure average: about the last 10 count.
const PRESSURE_WEIGHT: f64 = 0.1;
/// A single request's ratio is capped here, so that one stuck request cannot dominate.
const MAX_RATIO: f64 = 10.0;

/// How close each side of the deployment runs to its targets: running averages of measured
/// over target, the prefill side's from disaggregated requests' TTFT, the decode side's from
/// every request's TPOT and aggregated requests' TTFT (their prompts ran there). Above 1 the
/// side misses its targets; an autoscaler scales it out past a threshold (deploy/k8s/hpa.yaml).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SloPressure {
    prefill: Option<f64>,
    decode: Option<f64>,
}

impl SloPressure {
    /// Adds a measured TTFT over its target, on the side that computed the prompt.
    pub fn observe_ttft(&mut self, ratio: f64, on_prefill: bool) {
        let side = if on_prefill {
            &mut self.prefill
        } else {
            &mut self.decode
        };
        Self::observe(side, ratio);
    }

    /// Adds a measured TPOT over its target.
    pub fn observe_tpot(&mut self, ratio: f64) {
        Self::observe(&mut self.decode, ratio);
    }

    fn observe(side: &mut Option<f64>, ratio: f64) {
        if !ratio.is_finite() || ratio < 0.0 {
            return;
        }
        let ratio = ratio.min(MAX_RATIO);
        *side = Some(match *side {
            None => ratio,
            Some(avg) => avg + PRESSURE_WEIGHT * (ratio - avg),
        });
    }

    /// `(prefill, decode)`: 0 for a side no request has measured yet.
    pub fn sides(&self) -> (f64, f64) {
        (self.prefill.unwrap_or(0.0), self.decode.unwrap_or(0.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn a_ttft_target_grows_with_the_prompt_and_headers_override() {
        let slo = SloTargets::default();
        let r = slo.for_request(SloAsked::default(), 2048);
        assert_eq!(r.ttft_ms, 1000.0 + 1.5 * 2048.0);
        assert_eq!(r.tpot_ms, 60.0);
        let asked = SloAsked {
            ttft_ms: Some(250.0),
            tpot_ms: None,
        };
        assert_eq!(slo.for_request(asked, 2048).ttft_ms, 250.0);
        assert!(slo.validate().is_ok());
        for bad in [
            SloTargets {
                ttft_ms: 0.0,
                ..slo
            },
            SloTargets {
                tpot_ms: f64::NAN,
                ..slo
            },
            SloTargets {
                ttft_per_token_ms: -1.0,
                ..slo
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn headers_parse_and_bad_values_name_the_header() {
        let mut h = HeaderMap::new();
        assert_eq!(SloAsked::from_headers(&h), Ok(SloAsked::default()));
        h.insert(TTFT_HEADER, HeaderValue::from_static(" 1500.5 "));
        h.insert(TPOT_HEADER, HeaderValue::from_static("40"));
        assert_eq!(
            SloAsked::from_headers(&h),
            Ok(SloAsked {
                ttft_ms: Some(1500.5),
                tpot_ms: Some(40.0)
            })
        );
        for bad in ["0", "-5", "NaN", "inf", "1e12", "fast"] {
            h.insert(TPOT_HEADER, HeaderValue::from_static(bad));
            let e = SloAsked::from_headers(&h).unwrap_err();
            assert!(e.contains(TPOT_HEADER), "{bad}: {e}");
        }
    }

    #[test]
    fn pressure_follows_each_side_and_bounds_one_request() {
        let mut p = SloPressure::default();
        assert_eq!(p.sides(), (0.0, 0.0));
        p.observe_ttft(2.0, true);
        p.observe_tpot(0.5);
        assert_eq!(p.sides(), (2.0, 0.5));
        for _ in 0..100 {
            p.observe_ttft(0.5, true);
        }
        assert!((p.sides().0 - 0.5).abs() < 1e-3);
        // An aggregated request's TTFT is the decode side's; nonsense is ignored, and one
        // stuck request moves the average by a bounded step.
        p.observe_ttft(f64::NAN, false);
        p.observe_ttft(-1.0, false);
        assert_eq!(p.sides().1, 0.5);
        p.observe_ttft(1e9, false);
        assert!((p.sides().1 - (0.5 + 0.1 * (10.0 - 0.5))).abs() < 1e-9);
    }
}
