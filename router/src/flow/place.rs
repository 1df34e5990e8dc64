//! SLO placement of one request on the decode worker routing picked (`--placement slo`):
//! gather the cost views of that worker and of every prefill worker that can send it KV,
//! predict each placement (`routing::placement`), correct the predictions by what earlier
//! requests measured, choose, and note the prediction for the request's outcome.
//!
//! When a view is missing (a worker that has not yet run a pass, or cannot price a prompt),
//! there is nothing to predict with, and the static rule decides: its placements are what
//! teach the workers' fits.

use super::outcome::{Predicted, Timing};
use super::request::{FlowContext, FlowRequest};
use crate::metrics as m;
use crate::routing::{
    self, CostView, ModeDecision, Placement, Prediction, PromptNames, predict_aggregated,
    predict_disaggregated,
};
use crate::workers::{Worker, WorkerRole};

/// The placement of `req` on `decode` by its targets, or `None` when the costs are not
/// known yet.
pub(super) fn place(
    ctx: &FlowContext,
    req: &FlowRequest,
    decode: &Worker,
    names: &mut PromptNames<'_>,
    timing: &mut Timing,
) -> Option<ModeDecision> {
    let unknown = |why: &str| {
        tracing::debug!(why, "placed by the static rule: a cost is not known yet");
        None
    };
    let Some(mut decode_view) = decode.cost_view() else {
        return unknown("the decode worker has not reported a pass");
    };
    let prompt = req.prompt.len() as u64;
    let mut prefills: Vec<(usize, CostView, u64)> = Vec::new();
    for candidate in ctx.pool.prefill_candidates_for(decode, names) {
        let view = ctx
            .pool
            .worker(WorkerRole::Prefill, candidate.id)
            .and_then(|w| w.cost_view())
            .filter(|v| v.coefficients.knows_prompts());
        let Some(view) = view else {
            return unknown("a prefill worker cannot price a prompt token yet");
        };
        prefills.push((candidate.id, view, candidate.cached_tokens));
    }
    if let Some((_, lender, _)) = prefills.first() {
        decode_view.borrow_prompt_costs(lender);
    }
    if !decode_view.coefficients.knows_prompts() {
        return unknown("the decode worker cannot price a prompt token yet");
    }
    let decode_cached = (decode.cached_blocks(names) * tandem_kv::BLOCK_SIZE) as u64;
    let calibration = ctx.calibration.lock().map(|c| *c).unwrap_or_default();
    let mut raw: Vec<(Placement, Prediction)> = vec![(
        Placement::Aggregated,
        predict_aggregated(&decode_view, prompt, decode_cached, req.slo.tpot_ms),
    )];
    for (id, view, cached) in &prefills {
        raw.push((
            Placement::Disaggregated { prefill: *id },
            predict_disaggregated(view, &decode_view, prompt, *cached),
        ));
    }
    let corrected: Vec<(Placement, Prediction)> = raw
        .iter()
        .map(|&(p, prediction)| (p, calibration.correct(p.kind(), prediction)))
        .collect();
    for (placement, p) in &corrected {
        tracing::debug!(
            ?placement,
            ttft_ms = p.ttft_ms,
            tpot_ms = p.tpot_ms,
            pressure = p.pressure(&req.slo),
            "placement option"
        );
    }
    let (placement, prediction) = routing::choose(&corrected, &req.slo)?;
    let meets = prediction.pressure(&req.slo) <= 1.0;
    tracing::debug!(
        ?placement,
        predicted_ttft_ms = prediction.ttft_ms,
        predicted_tpot_ms = prediction.tpot_ms,
        ttft_target_ms = req.slo.ttft_ms,
        tpot_target_ms = req.slo.tpot_ms,
        meets,
        "placed by the latency targets"
    );
    metrics::counter!(
        m::PLACEMENTS_TOTAL,
        "placement" => placement.kind().as_str(),
        "predicted" => if meets { "meets" } else { "misses" }
    )
    .increment(1);
    let raw_prediction = raw
        .iter()
        .find(|(p, _)| *p == placement)
        .map_or(prediction, |(_, r)| *r);
    timing.predict(Predicted {
        kind: placement.kind(),
        raw: raw_prediction,
        corrected: prediction,
    });
    Some(match placement {
        Placement::Aggregated => {
            // Its prompt joins the decode worker's queue until the next report says so.
            decode.note_prompt_tokens(prompt.saturating_sub(decode_cached));
            ModeDecision::Aggregated { fallback: None }
        }
        Placement::Disaggregated { prefill } => ModeDecision::Disaggregated { prefill },
    })
}
