//! What a request leaves in the metrics: TTFT and the gaps between tokens as they arrive,
//! and, once it is over, how it ran and how it ended (tokens, requests, end-to-end latency).

use std::time::Instant;

use super::events::{FinishOut, RunMode};
use crate::metrics as m;

/// Token timing for TTFT and ITL.
pub(super) struct Timing {
    arrival: Instant,
    last_token: Option<Instant>,
}

impl Timing {
    pub(super) fn new(arrival: Instant) -> Self {
        Timing {
            arrival,
            last_token: None,
        }
    }

    /// Records a token that just arrived: the first one's TTFT, the others' gap since the
    /// one before.
    pub(super) fn on_token(&mut self, mode: RunMode) {
        let now = Instant::now();
        match self.last_token {
            None => metrics::histogram!(m::TTFT_SECONDS, "mode" => mode.as_str())
                .record((now - self.arrival).as_secs_f64()),
            Some(prev) => metrics::histogram!(m::ITL_SECONDS, "mode" => mode.as_str())
                .record((now - prev).as_secs_f64()),
        }
        self.last_token = Some(now);
    }
}

/// How a request ended, for the metrics.
pub(super) enum Outcome {
    Ok(RunMode, FinishOut),
    Cancelled(Option<RunMode>),
    Failed(Option<RunMode>, &'static str),
}

pub(super) fn record_outcome(outcome: &Outcome, arrival: Instant) {
    let (mode, label) = match outcome {
        Outcome::Ok(mode, finish) => {
            metrics::counter!(m::TOKENS_TOTAL, "kind" => "prompt")
                .increment(u64::from(finish.prompt_tokens));
            metrics::counter!(m::TOKENS_TOTAL, "kind" => "completion")
                .increment(u64::from(finish.total_completion_tokens));
            (Some(*mode), "ok")
        }
        Outcome::Cancelled(mode) => (*mode, "cancelled"),
        Outcome::Failed(mode, kind) => (*mode, *kind),
    };
    let mode = mode.map_or("none", RunMode::as_str);
    metrics::counter!(m::REQUESTS_TOTAL, "mode" => mode, "outcome" => label).increment(1);
    metrics::histogram!(m::E2E_SECONDS, "mode" => mode, "outcome" => label)
        .record(arrival.elapsed().as_secs_f64());
}
