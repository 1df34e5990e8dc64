//! The tqdm-style progress bar on stderr (bench-spec §5), drawn with `indicatif`:
//! `{pct:3.0f}%|{bar}| {n}/{total} [{elapsed}<{remaining}, {rate}]`, advanced once per
//! finished request, closed (kept on screen) before the block is printed.
//!
//! indicatif draws only on a terminal, so a redirected stderr gets no bar at all where tqdm
//! would print a 10-cell one; the rate is indicatif's estimate, not tqdm's EMA.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressState, ProgressStyle};

/// A bar that may be disabled (`--disable-tqdm`); all methods are no-ops then.
#[derive(Debug, Clone)]
pub struct Progress {
    bar: Option<ProgressBar>,
}

/// tqdm's `MM:SS`, or `H:MM:SS` from one hour up.
pub fn tqdm_time(duration: Duration) -> String {
    let secs = duration.as_secs();
    let (hours, minutes, seconds) = (secs / 3600, secs % 3600 / 60, secs % 60);
    if hours > 0 {
        format!("{hours}:{minutes:02}:{seconds:02}")
    } else {
        format!("{minutes:02}:{seconds:02}")
    }
}

/// tqdm's rate: `{:5.2f}it/s`, or `s/it` below one per second, `?it/s` before any sample.
pub fn tqdm_rate(per_sec: f64) -> String {
    if !(per_sec.is_finite() && per_sec > 0.0) {
        "?it/s".to_string()
    } else if per_sec < 1.0 {
        format!("{:5.2}s/it", 1.0 / per_sec)
    } else {
        format!("{per_sec:5.2}it/s")
    }
}

fn style() -> ProgressStyle {
    let template =
        "{tqdm_pct}|{wide_bar}| {pos}/{len} [{tqdm_elapsed}<{tqdm_remaining}, {tqdm_rate}]";
    let percent = |state: &ProgressState, w: &mut dyn std::fmt::Write| {
        let total = state.len().unwrap_or(0).max(1) as f64;
        let _ = write!(w, "{:3.0}%", state.pos() as f64 * 100.0 / total);
    };
    let elapsed = |state: &ProgressState, w: &mut dyn std::fmt::Write| {
        let _ = w.write_str(&tqdm_time(state.elapsed()));
    };
    let rate = |state: &ProgressState, w: &mut dyn std::fmt::Write| {
        let per_sec = observed_rate(state);
        let _ = w.write_str(&tqdm_rate(per_sec));
    };
    let remaining = |state: &ProgressState, w: &mut dyn std::fmt::Write| {
        let per_sec = observed_rate(state);
        let left = state.len().unwrap_or(0).saturating_sub(state.pos()) as f64;
        if per_sec > 0.0 && per_sec.is_finite() {
            let _ = w.write_str(&tqdm_time(Duration::from_secs_f64(left / per_sec)));
        } else {
            let _ = w.write_str("?");
        }
    };
    // A template that fails to parse is a bug here, not user input; fall back to the default.
    ProgressStyle::with_template(template)
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .with_key("tqdm_pct", percent)
        .with_key("tqdm_elapsed", elapsed)
        .with_key("tqdm_remaining", remaining)
        .with_key("tqdm_rate", rate)
        .progress_chars("█▉▊▋▌▍▎▏ ")
}

/// n / elapsed: the rate tqdm falls back to, steadier than a short window.
fn observed_rate(state: &ProgressState) -> f64 {
    let elapsed = state.elapsed().as_secs_f64();
    if state.pos() == 0 || elapsed <= 0.0 {
        0.0
    } else {
        state.pos() as f64 / elapsed
    }
}

impl Progress {
    /// A bar of `total` steps on stderr, or nothing when `enabled` is false.
    pub fn new(total: usize, enabled: bool) -> Self {
        let bar = enabled.then(|| {
            let bar = ProgressBar::with_draw_target(
                Some(total as u64),
                // tqdm redraws at most every 0.1 s.
                ProgressDrawTarget::stderr_with_hz(10),
            );
            bar.set_style(style());
            bar
        });
        Self { bar }
    }

    /// One request finished (successfully or not).
    pub fn advance(&self) {
        if let Some(bar) = &self.bar {
            bar.inc(1);
        }
    }

    /// Closes the bar, keeping its final line.
    pub fn close(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_and_rates_print_like_tqdm() {
        assert_eq!(tqdm_time(Duration::from_secs(11)), "00:11");
        assert_eq!(tqdm_time(Duration::from_secs(3725)), "1:02:05");
        assert_eq!(tqdm_rate(17.08), "17.08it/s");
        assert_eq!(tqdm_rate(2.0), " 2.00it/s");
        assert_eq!(tqdm_rate(0.075), "13.33s/it");
        assert_eq!(tqdm_rate(0.0), "?it/s");
    }

    #[test]
    fn disabled_bar_is_inert() {
        let progress = Progress::new(3, false);
        progress.advance();
        progress.close();
        assert!(progress.bar.is_none());
    }
}
