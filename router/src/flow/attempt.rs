//! Attempts before the response head: pick a decode worker, decide the mode, run it, and on
//! failure retry or fall back as the module doc of `flow` says. Nothing has reached the
//! client yet, so a retry shows only in the head (its `fallback`) and in the metrics.

use std::sync::Arc;

use super::aggregated::run_aggregated;
use super::decode::{AttemptError, Live};
use super::disaggregated::{DisaggError, run_disaggregated};
use super::outcome::Timing;
use super::place::place;
use super::request::{FlowContext, FlowRequest};
use crate::config::{FallbackPolicy, PlacementPolicy};
use crate::error::ApiError;
use crate::metrics as m;
use crate::routing::{self, FallbackReason, ModeDecision, Placement, PromptNames};
use crate::workers::{Worker, WorkerRole};

/// Picks workers and gets the first token: a decode worker found down before it is replaced
/// once by another. So is one the KV could not reach; when no other is left, that one runs
/// the prompt itself (`--fallback aggregated`): the router still reaches it, only the link
/// from the prefill worker failed.
pub(super) async fn establish(
    ctx: &FlowContext,
    req: &FlowRequest,
    timing: &mut Timing,
) -> Result<Live, ApiError> {
    let mut tried_decode: Vec<usize> = Vec::new();
    // Workers that left the pool between the candidate list and the lookup: skipped, not
    // counted as a retry.
    let mut skipped: Vec<usize> = Vec::new();
    let mut names = PromptNames::new(&req.prompt);
    // The decode worker a transfer failed toward, with the error, for the last resort.
    let mut unreached: Option<(Arc<Worker>, ApiError)> = None;
    loop {
        let exclude = [tried_decode.as_slice(), skipped.as_slice()].concat();
        let candidates = ctx.pool.decode_candidates(&exclude, &mut names);
        let rule = ctx.rule(req, &ctx.decode_turn);
        let Some(id) = routing::pick_decode(&candidates, &rule) else {
            if let Some((decode, e)) = unreached {
                return aggregated_after_transfer(ctx, req, &decode, e, timing).await;
            }
            return Err(match tried_decode.is_empty() {
                true => ApiError::NoDecodeWorker,
                false => ApiError::WorkerUnavailable,
            });
        };
        let Some(decode) = ctx.pool.worker(WorkerRole::Decode, id) else {
            skipped.push(id);
            continue;
        };
        match establish_on(ctx, req, &decode, &mut names, timing).await {
            Ok(live) => return Ok(live),
            Err(AttemptError::DecodeDown(_)) if tried_decode.is_empty() => {
                tracing::warn!(decode = %decode.url, "decode worker down before the first token; trying another");
                tried_decode.push(id);
            }
            Err(AttemptError::TransferFailed(e)) if tried_decode.is_empty() => {
                tried_decode.push(id);
                unreached = Some((decode, e));
            }
            Err(AttemptError::TransferFailed(e)) => {
                return aggregated_after_transfer(ctx, req, &decode, e, timing).await;
            }
            Err(e) => return Err(e.into_api()),
        }
    }
}

/// The last resort after a failed transfer: `decode` runs the prompt itself, if
/// `--fallback aggregated` allows (a decode worker that is down after all fails that at once).
async fn aggregated_after_transfer(
    ctx: &FlowContext,
    req: &FlowRequest,
    decode: &Arc<Worker>,
    e: ApiError,
    timing: &mut Timing,
) -> Result<Live, ApiError> {
    if ctx.fallback == FallbackPolicy::Error {
        return Err(e);
    }
    let fallback = Some(FallbackReason::TransferFailed);
    note_fallback(fallback);
    run_aggregated(ctx, req, decode, fallback, timing)
        .await
        .map_err(AttemptError::into_api)
}

/// Runs the request on `decode`, disaggregated when possible: a failed prefill is retried
/// once on another prefill worker, then runs aggregated if `--fallback aggregated`.
async fn establish_on(
    ctx: &FlowContext,
    req: &FlowRequest,
    decode: &Arc<Worker>,
    names: &mut PromptNames<'_>,
    timing: &mut Timing,
) -> Result<Live, AttemptError> {
    // What the request adds to the worker's blocks: its prompt less the prefix cached there,
    // measured before this prompt is noted there (from then on it counts as cached).
    let cached_blocks = decode.cached_blocks(names);
    let new_blocks = prompt_blocks(decode, req.prompt.len())
        .saturating_sub(u32::try_from(cached_blocks).unwrap_or(u32::MAX));
    decode.note_dispatch(new_blocks);
    decode.note_prompt(names);
    let first_prefill = routing::pick_prefill(
        &ctx.pool.prefill_candidates_for(decode, names),
        &[],
        &ctx.rule(req, &ctx.prefill_turn),
    );
    let static_decision = routing::decide_mode(
        req.prompt.len(),
        ctx.agg_threshold,
        ctx.pool.prefill_configured(),
        first_prefill,
        ctx.fallback,
    );
    let by_slo = match ctx.placement {
        PlacementPolicy::Slo if ctx.pool.prefill_configured() => {
            let default = Placement::of_decision(static_decision);
            place(ctx, req, decode, cached_blocks, default, names, timing)
        }
        _ => None,
    };
    // A split prompt's first part goes to the first prefill worker tried; a retry computes
    // it all.
    let mut split_at = by_slo.as_ref().map_or(0, |p| p.split_at);
    let mut decision = by_slo.map_or(static_decision, |p| p.decision);
    let mut tried_prefill: Vec<usize> = Vec::new();
    let mut last_prefill_error: Option<ApiError> = None;
    loop {
        let prefill = match decision {
            ModeDecision::Refuse => {
                return Err(AttemptError::Fatal(
                    last_prefill_error.unwrap_or(ApiError::NoPrefillWorker),
                ));
            }
            ModeDecision::Aggregated { fallback } => {
                note_fallback(fallback);
                return run_aggregated(ctx, req, decode, fallback, timing).await;
            }
            ModeDecision::Disaggregated { prefill } => prefill,
        };
        let attempt = match ctx.pool.worker(WorkerRole::Prefill, prefill) {
            Some(prefill_worker) => {
                run_disaggregated(ctx, req, decode, &prefill_worker, names, split_at, timing).await
            }
            // It left the pool since the candidate list: fail over like a failure.
            None => Err(DisaggError::Prefill(ApiError::WorkerUnavailable)),
        };
        match attempt {
            Ok(live) => return Ok(live),
            Err(DisaggError::Decode(e)) => return Err(e),
            Err(DisaggError::Transfer(e)) => return Err(AttemptError::TransferFailed(e)),
            Err(DisaggError::Prefill(ApiError::WorkerRejected)) => {
                // The request itself is invalid: no other worker will take it.
                return Err(AttemptError::Fatal(ApiError::WorkerRejected));
            }
            Err(DisaggError::Prefill(e)) => {
                tried_prefill.push(prefill);
                split_at = 0;
                last_prefill_error = Some(e);
                decision = after_prefill_failure(ctx, req, decode, names, &tried_prefill);
            }
        }
    }
}

/// What follows a failed prefill (the last of `tried`): another prefill worker, aggregated,
/// or a refusal.
fn after_prefill_failure(
    ctx: &FlowContext,
    req: &FlowRequest,
    decode: &Worker,
    names: &mut PromptNames<'_>,
    tried: &[usize],
) -> ModeDecision {
    let other = routing::pick_prefill(
        &ctx.pool.prefill_candidates_for(decode, names),
        tried,
        &ctx.rule(req, &ctx.prefill_turn),
    );
    let decision = routing::decide_after_prefill_failure(tried.len() < 2, other, ctx.fallback);
    if let (ModeDecision::Disaggregated { prefill: next }, Some(&failed)) = (decision, tried.last())
    {
        let url = |id| {
            ctx.pool
                .worker(WorkerRole::Prefill, id)
                .map_or_else(String::new, |w| w.url.clone())
        };
        tracing::warn!(failed = %url(failed), next = %url(next), "prefill failed; retrying on another prefill worker");
        metrics::counter!(m::PREFILL_RETRIES_TOTAL).increment(1);
    }
    decision
}

/// Counts a request that runs aggregated although it wanted disaggregation.
fn note_fallback(fallback: Option<FallbackReason>) {
    if let Some(reason) = fallback {
        // Per request at debug: the counter and the response say it; the worker's own state
        // changes are logged at warn by the pool.
        tracing::debug!(
            reason = reason.as_str(),
            "running aggregated instead of disaggregated"
        );
        metrics::counter!(m::FALLBACKS_TOTAL, "reason" => reason.as_str()).increment(1);
    }
}

/// The prompt's blocks in `decode`'s block size.
fn prompt_blocks(decode: &Worker, prompt_len: usize) -> u32 {
    let block_size = decode
        .info()
        .and_then(|i| i.kv_layout.as_ref().map(|l| l.block_size))
        .unwrap_or(16);
    routing::blocks_for_tokens(prompt_len, block_size)
}
