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
    self, CostView, ModeDecision, Placement, PlacementKind, Prediction, PromptNames, best_split,
    predict_aggregated, predict_disaggregated, predict_split,
};
use crate::workers::{Worker, WorkerRole};

/// Where SLO placement put a request.
pub(super) struct Placed {
    pub decision: ModeDecision,
    /// Disaggregated: the prompt tokens the prefill worker computes, the decode worker the
    /// rest (0: the prefill worker computes them all).
    pub split_at: u32,
}

/// The placement of `req` on `decode`, whose prefix cache holds `decode_cached_blocks` of
/// its prompt (counted before the prompt was noted there), by its targets, or `None` when
/// the costs are not known yet. `default` is the static rule's placement, kept unless the
/// predictions clearly favour another (`routing::choose`).
pub(super) fn place(
    ctx: &FlowContext,
    req: &FlowRequest,
    decode: &Worker,
    decode_cached_blocks: usize,
    default: Option<Placement>,
    names: &mut PromptNames<'_>,
    timing: &mut Timing,
) -> Option<Placed> {
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
            .filter(|v| v.prompts_known);
        let Some(view) = view else {
            return unknown("a prefill worker cannot price a prompt token yet");
        };
        tracing::debug!(
            prefill = candidate.id,
            queued_tokens = view.queued_prompt_tokens,
            cached_tokens = candidate.cached_tokens,
            cost = ?view.coefficients,
            "prefill worker's view"
        );
        prefills.push((candidate.id, view, candidate.cached_tokens));
    }
    if let Some((_, lender, _)) = prefills.first() {
        decode_view.borrow_prompt_costs(lender);
    }
    if !decode_view.prompts_known {
        return unknown("the decode worker cannot price a prompt token yet");
    }
    let decode_cached = (decode_cached_blocks * tandem_kv::BLOCK_SIZE) as u64;
    let calibration = ctx.calibration.lock().map(|c| *c).unwrap_or_default();
    let mut raw: Vec<(Placement, Prediction)> = vec![(
        Placement::Aggregated,
        predict_aggregated(&decode_view, prompt, decode_cached, req.slo.tpot_ms),
    )];
    for (id, view, cached) in &prefills {
        raw.push((
            Placement::Disaggregated { prefill: *id },
            predict_disaggregated(view, &decode_view, prompt, *cached, req.slo.tpot_ms),
        ));
    }
    let corrected: Vec<(Placement, Prediction)> = raw
        .iter()
        .map(|&(p, prediction)| {
            let corrected = calibration.correct(p.kind(), prompt, prediction);
            (p, corrected)
        })
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
    let (mut placement, mut prediction) = routing::choose(&corrected, default, &req.slo)?;
    let mut meets = prediction.pressure(&req.slo) <= 1.0;
    let mut raw_prediction = raw
        .iter()
        .find(|(p, _)| *p == placement)
        .map_or(prediction, |(_, r)| *r);
    // With room in the TTFT target, part of the prompt goes to the decode worker's slack
    // (prompt logprobs need every row of the prompt in one place).
    if let Placement::Disaggregated { prefill } = placement
        && meets
        && req.sampling.prompt_logprobs.is_none()
        && let Some((_, view, cached)) = prefills.iter().find(|(id, ..)| *id == prefill)
        && let Some((at, split)) = best_split(
            view,
            &decode_view,
            prompt,
            *cached,
            decode_cached,
            &req.slo,
            |p| calibration.correct(PlacementKind::Split, prompt, p),
        )
    {
        tracing::debug!(
            at,
            whole_ttft_ms = prediction.ttft_ms,
            split_ttft_ms = split.ttft_ms,
            "the prompt's tail goes to the decode worker's slack"
        );
        raw_prediction = predict_split(view, &decode_view, prompt, *cached, at, req.slo.tpot_ms);
        placement = Placement::Split { prefill, at };
        prediction = split;
        meets = true;
    }
    tracing::debug!(
        ?placement,
        predicted_ttft_ms = prediction.ttft_ms,
        predicted_tpot_ms = prediction.tpot_ms,
        ttft_target_ms = req.slo.ttft_ms,
        tpot_target_ms = req.slo.tpot_ms,
        meets,
        prompt_tokens = prompt,
        decode_cached,
        decode_view = ?decode_view,
        "placed by the latency targets"
    );
    metrics::counter!(
        m::PLACEMENTS_TOTAL,
        "placement" => placement.kind().as_str(),
        "predicted" => if meets { "meets" } else { "misses" }
    )
    .increment(1);
    timing.predict(Predicted {
        kind: placement.kind(),
        raw: raw_prediction,
        corrected: prediction,
    });
    let (decision, split_at) = match placement {
        Placement::Aggregated => {
            // Its prompt joins the decode worker's queue until the next report says so.
            decode.note_prompt_tokens(prompt.saturating_sub(decode_cached));
            (ModeDecision::Aggregated { fallback: None }, 0)
        }
        Placement::Disaggregated { prefill } => (ModeDecision::Disaggregated { prefill }, 0),
        Placement::Split { prefill, at } => {
            decode.note_prompt_tokens(prompt.saturating_sub(at));
            let at = u32::try_from(at).unwrap_or(0);
            (ModeDecision::Disaggregated { prefill }, at)
        }
    };
    Some(Placed { decision, split_at })
}
