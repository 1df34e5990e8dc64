//! What a request leaves in the metrics: TTFT and the gaps between tokens as they arrive,
//! and, once it is over, how it ran and how it ended (tokens, requests, end-to-end latency).

use std::time::Instant;

use super::events::{FinishOut, RunMode};
use super::request::{FlowContext, FlowRequest};
use crate::metrics as m;
use crate::routing::{PlacementKind, Prediction};

/// Token timing for TTFT and ITL, and for SLO placement's prediction of them.
pub(super) struct Timing {
    arrival: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    tokens: u64,
    mode: Option<RunMode>,
    predicted: Option<Predicted>,
}

/// What SLO placement predicted for a request: the placement kind, the model's raw
/// prediction (what calibration learns from) and the corrected one (what it was placed by).
#[derive(Debug, Clone, Copy)]
pub(super) struct Predicted {
    pub kind: PlacementKind,
    pub raw: Prediction,
    pub corrected: Prediction,
}

impl Timing {
    pub(super) fn new(arrival: Instant) -> Self {
        Timing {
            arrival,
            first_token: None,
            last_token: None,
            tokens: 0,
            mode: None,
            predicted: None,
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
        self.first_token.get_or_insert(now);
        self.last_token = Some(now);
        self.tokens += 1;
        self.mode = Some(mode);
    }

    /// Notes what SLO placement predicted for this request.
    pub(super) fn predict(&mut self, predicted: Predicted) {
        self.predicted = Some(predicted);
    }

    /// The request did not run as predicted (a decode worker declined its split): its
    /// measurements say nothing of the prediction.
    pub(super) fn forget_prediction(&mut self) {
        self.predicted = None;
    }

    /// Once the request is over: what it measured against its targets and, if SLO placement
    /// placed it and it ran where it was placed, against the prediction (logged, exported as
    /// relative errors, and learned by `calibration`). TPOT is measured as vLLM's benchmark
    /// does, over one choice's tokens after the first.
    pub(super) fn settle(&self, req: &FlowRequest, ctx: &FlowContext) {
        let (Some(first), Some(last), Some(mode)) = (self.first_token, self.last_token, self.mode)
        else {
            return;
        };
        let slo = &req.slo;
        let ttft_ms = (first - self.arrival).as_secs_f64() * 1e3;
        let tpot_ms = (req.sampling.n <= 1 && self.tokens >= 2)
            .then(|| (last - first).as_secs_f64() * 1e3 / (self.tokens - 1) as f64);
        if let Ok(mut p) = ctx.pressure.lock() {
            p.observe_ttft(ttft_ms / slo.ttft_ms, mode == RunMode::Disaggregated);
            if let Some(tpot) = tpot_ms {
                p.observe_tpot(tpot / slo.tpot_ms);
            }
            let (prefill, decode) = p.sides();
            metrics::gauge!(m::SLO_PRESSURE, "role" => "prefill").set(prefill);
            metrics::gauge!(m::SLO_PRESSURE, "role" => "decode").set(decode);
        }
        let met = |ok: bool| if ok { "yes" } else { "no" };
        metrics::counter!(m::SLO_REQUESTS_TOTAL, "target" => "ttft", "met" => met(ttft_ms <= slo.ttft_ms))
            .increment(1);
        if let Some(tpot) = tpot_ms {
            metrics::counter!(m::SLO_REQUESTS_TOTAL, "target" => "tpot", "met" => met(tpot <= slo.tpot_ms))
                .increment(1);
        }
        let Some(p) = self.predicted else {
            return;
        };
        let ran_as_placed = matches!(
            (p.kind, mode),
            (PlacementKind::Aggregated, RunMode::Aggregated)
                | (
                    PlacementKind::Disaggregated | PlacementKind::Split,
                    RunMode::Disaggregated
                )
        );
        if !ran_as_placed {
            return;
        }
        let error =
            |predicted: f64, measured: f64| (predicted - measured).abs() / measured.max(1e-3);
        metrics::histogram!(m::PREDICTION_ERROR, "metric" => "ttft", "placement" => p.kind.as_str())
            .record(error(p.corrected.ttft_ms, ttft_ms));
        if let Some(tpot) = tpot_ms {
            metrics::histogram!(m::PREDICTION_ERROR, "metric" => "tpot", "placement" => p.kind.as_str())
                .record(error(p.corrected.tpot_ms, tpot));
        }
        tracing::info!(
            placement = p.kind.as_str(),
            prompt_tokens = req.prompt.len(),
            predicted_ttft_ms = p.corrected.ttft_ms,
            ttft_ms,
            predicted_tpot_ms = p.corrected.tpot_ms,
            tpot_ms,
            model_ttft_ms = p.raw.ttft_ms,
            model_tpot_ms = p.raw.tpot_ms,
            "placement outcome"
        );
        if let Ok(mut c) = ctx.calibration.lock() {
            c.learn(p.kind, req.prompt.len() as u64, p.raw, ttft_ms);
        }
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
