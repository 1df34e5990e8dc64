//! SLO placement (`--placement slo`): for a request and the decode worker routing picked,
//! predict each placement's TTFT and what it does to the decode worker's streams' TPOT, from
//! the cost models the workers fit to their own passes (`tandem_cost`, on every load
//! report), and pick one ([`choose`]): the static rule's while it is predicted to meet both
//! targets, else the one that meets them; when none does, the one that costs the streams
//! it joins least (the request is lost to goodput wherever it goes; predictions under load
//! are off by half or more, and the static rule is the placement known to work). The
//! placements:
//!
//! - **disaggregated on prefill worker P**: TTFT is P's queued prompt tokens and then this
//!   prompt (less what P's cache holds) in full passes; the streams' passes gain one row.
//! - **aggregated on the decode worker**: its queued prompt tokens and this prompt run in
//!   chunks beside its streams, each chunk sized as the worker sizes it: the prompt's passes
//!   are the worker's own pacing replayed from its tightest stream's standing
//!   (`tandem_cost::paced_prompt_ms`), and the streams' passes stay within the target while
//!   it runs.
//! - **split between prefill worker P and the decode worker**: P computes the prompt's first
//!   part and sends its KV; the decode worker computes the rest as it would aggregated. The
//!   request's TTFT is never better than both whole placements', but the prefill worker,
//!   which every long prompt queues for, is busy for less of it: when the best whole
//!   placement is P and the TTFT target leaves room, [`best_split`] hands the decode worker's
//!   slack the longest tail the target allows.
//!
//! Predictions are kept honest by what the requests then measure (`calibration`).

use tandem_cost::{STARVED_PASSES, StepShape, TPOT_HEADROOM};

use super::cost_view::{CHUNK_GRANULE, CostView};
use super::policy::ModeDecision;
use super::slo::RequestSlo;

/// Where a request runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    Aggregated,
    Disaggregated {
        prefill: usize,
    },
    /// `prefill` computes the prompt's first `at` tokens, the decode worker the rest.
    Split {
        prefill: usize,
        at: u64,
    },
}

impl Placement {
    /// The placement a static decision makes (`None` for a refusal).
    pub fn of_decision(decision: ModeDecision) -> Option<Self> {
        match decision {
            ModeDecision::Aggregated { .. } => Some(Placement::Aggregated),
            ModeDecision::Disaggregated { prefill } => Some(Placement::Disaggregated { prefill }),
            ModeDecision::Refuse => None,
        }
    }

    pub fn kind(self) -> PlacementKind {
        match self {
            Placement::Aggregated => PlacementKind::Aggregated,
            Placement::Disaggregated { .. } => PlacementKind::Disaggregated,
            Placement::Split { .. } => PlacementKind::Split,
        }
    }
}

/// A placement without its worker, for calibration and metric labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlacementKind {
    Aggregated,
    Disaggregated,
    Split,
}

impl PlacementKind {
    pub fn as_str(self) -> &'static str {
        match self {
            PlacementKind::Aggregated => "aggregated",
            PlacementKind::Disaggregated => "disaggregated",
            PlacementKind::Split => "split",
        }
    }

    pub(super) fn index(self) -> usize {
        self as usize
    }

    pub const ALL: [PlacementKind; 3] = [
        PlacementKind::Aggregated,
        PlacementKind::Disaggregated,
        PlacementKind::Split,
    ];
}

/// A placement's predicted TTFT for the request and TPOT for the streams it joins.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    pub ttft_ms: f64,
    pub tpot_ms: f64,
}

impl Prediction {
    /// How close to its targets it runs: the larger of the two ratios (at most 1 meets both).
    pub fn pressure(&self, slo: &RequestSlo) -> f64 {
        (self.ttft_ms / slo.ttft_ms).max(self.tpot_ms / slo.tpot_ms)
    }
}

/// The prompt on `prefill` (which holds `prefill_cached` of its tokens), the stream on
/// `decode`.
pub fn predict_disaggregated(
    prefill: &CostView,
    decode: &CostView,
    prompt: u64,
    prefill_cached: u64,
    tpot_ms: f64,
) -> Prediction {
    let cached = prefill_cached.min(prompt.saturating_sub(1));
    let ttft = prefill.prompt_ms(
        StepShape::default(),
        cached,
        prompt - cached,
        prefill.max_batch_tokens,
    );
    Prediction {
        ttft_ms: ttft,
        tpot_ms: decode.stream_tpot(decode.pass_with_one_more(prompt), tpot_ms),
    }
}

/// The prompt and the stream on `decode` (which holds `decode_cached` of its tokens): alone
/// it runs in full passes; beside streams it gets their slack under the worker's pacing
/// (`tandem_cost::Pacing`), and the streams run at their target while it does.
pub fn predict_aggregated(
    decode: &CostView,
    prompt: u64,
    decode_cached: u64,
    tpot_ms: f64,
) -> Prediction {
    let part = decode_part(
        decode,
        prompt,
        decode_cached.min(prompt.saturating_sub(1)),
        tpot_ms,
    );
    Prediction {
        ttft_ms: part.queue_ms + part.own_ms,
        tpot_ms: part.tpot_ms,
    }
}

/// The prompt's first `at` tokens on `prefill` (which holds `prefill_cached` of them), the
/// rest and the stream on `decode`, which starts on them once their KV is in and the prompt
/// work queued there before them is done.
pub fn predict_split(
    prefill: &CostView,
    decode: &CostView,
    prompt: u64,
    prefill_cached: u64,
    at: u64,
    tpot_ms: f64,
) -> Prediction {
    let at = at.clamp(1, prompt.saturating_sub(1).max(1));
    let cached = prefill_cached.min(at - 1);
    let first = prefill.prompt_ms(
        StepShape::default(),
        cached,
        at - cached,
        prefill.max_batch_tokens,
    );
    let part = decode_part(decode, prompt, at, tpot_ms);
    Prediction {
        ttft_ms: first.max(part.queue_ms) + part.own_ms,
        tpot_ms: part.tpot_ms,
    }
}

/// A prompt's tokens from `start` on, computed on a decode worker.
struct DecodePart {
    /// The prompt work queued there before them.
    queue_ms: f64,
    own_ms: f64,
    /// The streams' TPOT while they run.
    tpot_ms: f64,
}

fn decode_part(decode: &CostView, prompt: u64, start: u64, tpot_ms: f64) -> DecodePart {
    let tokens = prompt.saturating_sub(start).max(1);
    let after = decode.pass_with_one_more(prompt);
    if decode.decode_rows == 0 {
        let own = decode
            .coefficients
            .prompt_ms(StepShape::default(), start, tokens, decode.max_batch_tokens)
            .0;
        let pass_ms =
            decode
                .coefficients
                .step_ms(&StepShape::chunk(0, decode.max_batch_tokens, false));
        return DecodePart {
            queue_ms: decode.queue_ms(own, tokens, decode.max_batch_tokens, pass_ms),
            own_ms: own,
            tpot_ms: decode.stream_tpot(after, tpot_ms),
        };
    }
    let target = tpot_ms * TPOT_HEADROOM;
    let own = tandem_cost::paced_prompt_ms(
        &decode.coefficients,
        decode.streams(),
        start,
        tokens,
        decode.tightest_stream(tpot_ms),
        decode.max_batch_tokens,
        CHUNK_GRANULE,
    );
    let streams = decode.coefficients.step_ms(&decode.streams());
    let allowance = decode.coefficients.chunk_allowance(
        decode.streams(),
        start,
        target,
        decode.max_batch_tokens,
        CHUNK_GRANULE,
    );
    // Streams that fill their target leave a waiting prompt a granule every
    // STARVED_PASSES passes (`tandem_cost::Pacing`): a prompt of a granule goes before the
    // queued ones at the next such pass.
    let (one_pass, pass_ms) = if allowance == 0 {
        (CHUNK_GRANULE, STARVED_PASSES as f64 * streams.max(target))
    } else {
        (allowance, streams.max(target))
    };
    // A short prompt behind queued prompt work goes first, but not alone: the worker's
    // pacing fills the pass under way and the prompt's own with chunks of the queue, as
    // many tokens as it let in at its last pass (with the lead its streams had banked, which
    // the model's allowance at the aim does not see). Such passes ran 120-650 ms beside 16
    // streams under a 60 ms target, where a pass of the streams' period had predicted
    // short prompts 40 ms that measured 140-600 (`scripts/bench-goodput`'s mixed load).
    let (pass_ms, own) = if allowance > 0
        && decode.prompt_allowance > 0
        && decode.goes_before_queue(tokens, one_pass)
    {
        let chunk = decode.prompt_allowance.min(decode.queued_prompt_tokens);
        let beside = |tokens, samples| {
            let shape = decode.streams().plus(StepShape::chunk(0, tokens, samples));
            decode.coefficients.step_ms(&shape)
        };
        let with_queue = chunk
            .saturating_add(tokens)
            .min(decode.prompt_allowance.max(tokens));
        (
            beside(chunk, false).max(pass_ms),
            beside(with_queue, true).max(own),
        )
    } else {
        (pass_ms, own)
    };
    DecodePart {
        queue_ms: decode.queue_ms(own, tokens, one_pass, pass_ms),
        own_ms: own,
        tpot_ms: after.max(streams.max(target)),
    }
}

/// Of a TTFT target, the share a split may predict to use: the rest absorbs what the
/// prediction misses.
pub const SPLIT_TTFT_SHARE: f64 = 0.8;
/// The fewest prompt tokens worth handing a decode worker: fewer are not worth a split.
pub const MIN_SPLIT_TAIL: u64 = 4 * CHUNK_GRANULE;

/// The split of a prompt placed on `prefill` that hands `decode` the longest tail (the
/// prefill worker's shortest part, in whole blocks past `decode_cached`) whose prediction,
/// as `correct` corrects it, keeps the TTFT within [`SPLIT_TTFT_SHARE`] of its target and
/// the TPOT within its target; `None` when no split does or the prompt is too short.
pub fn best_split(
    prefill: &CostView,
    decode: &CostView,
    prompt: u64,
    prefill_cached: u64,
    decode_cached: u64,
    slo: &RequestSlo,
    correct: impl Fn(Prediction) -> Prediction,
) -> Option<(u64, Prediction)> {
    let first = decode_cached / CHUNK_GRANULE + 1;
    let last = prompt.saturating_sub(MIN_SPLIT_TAIL) / CHUNK_GRANULE;
    if first > last {
        return None;
    }
    let predict = |blocks: u64| {
        let at = blocks * CHUNK_GRANULE;
        correct(predict_split(
            prefill,
            decode,
            prompt,
            prefill_cached,
            at,
            slo.tpot_ms,
        ))
    };
    let fits =
        |p: &Prediction| p.ttft_ms <= SPLIT_TTFT_SHARE * slo.ttft_ms && p.tpot_ms <= slo.tpot_ms;
    // The TTFT falls as the prefill worker's part grows (its passes are full, the decode
    // worker's share its streams'): the shortest part that fits, by bisection.
    let (mut lo, mut hi) = (first, last);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if fits(&predict(mid)) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    let prediction = predict(lo);
    fits(&prediction).then_some((lo * CHUNK_GRANULE, prediction))
}

/// How much less a placement must be predicted to stretch the streams' TPOT than the
/// default, when every placement misses its targets, for the router to leave the default.
pub const TPOT_SWITCH_SHARE: f64 = 0.9;

/// The placement to run: `default` (the static rule's, among `options`) while it is
/// predicted to meet both targets; else the one with the least pressure (see
/// [`Prediction::pressure`]) if that one meets them. When none does, the request is lost to
/// goodput wherever it goes, and what matters is what it costs the streams it joins: the
/// default, unless another is predicted to keep their TPOT at most [`TPOT_SWITCH_SHARE`] of
/// the default's (a request that misses anyway must not take the slack that keeps others
/// within their targets). Without a default among the options, the least pressure (between
/// equals, the first listed). `None` for no options.
pub fn choose(
    options: &[(Placement, Prediction)],
    default: Option<Placement>,
    slo: &RequestSlo,
) -> Option<(Placement, Prediction)> {
    let least = options
        .iter()
        .copied()
        .min_by(|a, b| a.1.pressure(slo).total_cmp(&b.1.pressure(slo)))?;
    let Some(default) = default.and_then(|d| options.iter().copied().find(|(p, _)| *p == d)) else {
        return Some(least);
    };
    if default.1.pressure(slo) <= 1.0 {
        return Some(default);
    }
    if least.1.pressure(slo) <= 1.0 {
        return Some(least);
    }
    let gentlest = options
        .iter()
        .copied()
        .min_by(|a, b| a.1.tpot_ms.total_cmp(&b.1.tpot_ms))
        .unwrap_or(default);
    if gentlest.1.tpot_ms <= TPOT_SWITCH_SHARE * default.1.tpot_ms {
        Some(gentlest)
    } else {
        Some(default)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_cost::Coefficients;

    /// A CPU-like worker: 2 ms a pass, 1 ms a row, 4 ms a prompt token, 30 ms per million
    /// attention pairs.
    fn cost() -> Coefficients {
        Coefficients {
            base_ms: 2.0,
            per_row_ms: 1.0,
            per_token_ms: 4.0,
            per_mpair_ms: 30.0,
        }
    }

    fn view(rows: u64, queued: u64) -> CostView {
        CostView {
            coefficients: cost(),
            decode_rows: rows,
            decode_context: rows * 600,
            prompt_rows: 0,
            queued_prompt_tokens: queued,
            queued_prompts: queued.div_ceil(2048),
            pass_elapsed_ms: 0.0,
            max_batch_tokens: 512,
            prompts_known: true,
            lends_slack: false,
            prompt_allowance: 0,
            streams_lead_ms: 0.0,
            streams_target_lead_ms: 0.0,
        }
    }

    fn slo() -> RequestSlo {
        RequestSlo {
            ttft_ms: 1000.0 + 1.5 * 2048.0,
            tpot_ms: 60.0,
        }
    }

    #[test]
    fn an_idle_prefill_worker_wins_a_long_prompt_over_busy_streams() {
        let prefill = view(0, 0);
        let decode = view(8, 0);
        let slo = slo();
        let disagg = predict_disaggregated(&prefill, &decode, 2048, 0, 60.0);
        let agg = predict_aggregated(&decode, 2048, 0, slo.tpot_ms);
        // Beside 8 streams the prompt gets their slack: it starts later than alone.
        assert!(agg.ttft_ms > disagg.ttft_ms, "{agg:?} vs {disagg:?}");
        // The streams run at their target while it does; disaggregated, below it.
        assert!(
            (agg.tpot_ms - slo.tpot_ms * TPOT_HEADROOM).abs() < 1e-9,
            "{agg:?}"
        );
        assert!(disagg.tpot_ms < agg.tpot_ms, "{disagg:?}");
        let options = [
            (Placement::Aggregated, agg),
            (Placement::Disaggregated { prefill: 3 }, disagg),
        ];
        assert_eq!(
            choose(&options, None, &slo).map(|c| c.0),
            Some(Placement::Disaggregated { prefill: 3 })
        );
    }

    #[test]
    fn a_queued_prefill_worker_loses_to_an_idle_decode_worker() {
        let prefill = view(0, 8192);
        let decode = view(0, 0);
        let slo = slo();
        let disagg = predict_disaggregated(&prefill, &decode, 2048, 0, 60.0);
        let agg = predict_aggregated(&decode, 2048, 0, slo.tpot_ms);
        // Alone, the decode worker runs the prompt in full passes, as the prefill worker
        // would, without four prompts ahead of it.
        assert!(agg.ttft_ms * 4.0 < disagg.ttft_ms, "{agg:?} vs {disagg:?}");
        let options = [
            (Placement::Disaggregated { prefill: 0 }, disagg),
            (Placement::Aggregated, agg),
        ];
        assert_eq!(
            choose(&options, None, &slo).map(|c| c.0),
            Some(Placement::Aggregated)
        );
        assert_eq!(choose(&[], None, &slo), None);
    }

    #[test]
    fn a_prompt_that_ends_in_one_pass_waits_only_for_the_pass_under_way() {
        let slo = slo();
        // A prefill worker with four 2048-token prompts queued, 512-token passes.
        let busy = view(0, 8192);
        let full_pass = cost().step_ms(&StepShape::chunk(0, 512, false));
        let short = predict_disaggregated(&busy, &view(0, 0), 100, 0, 60.0);
        let alone = predict_disaggregated(&view(0, 0), &view(0, 0), 100, 0, 60.0);
        assert!(
            (short.ttft_ms - alone.ttft_ms - full_pass / 2.0).abs() < 1e-9,
            "{short:?} vs {alone:?}"
        );
        // One that needs several passes waits for the whole queue.
        let long = predict_disaggregated(&busy, &view(0, 0), 1024, 0, 60.0);
        let long_alone = predict_disaggregated(&view(0, 0), &view(0, 0), 1024, 0, 60.0);
        assert!(long.ttft_ms > long_alone.ttft_ms + 8192.0 * 3.0, "{long:?}");
        // A report that caught a pass 1 s in (and came 0.2 s ago): the long prompt waits
        // for 1.2 s less of the queue, the short one for the rest of that pass.
        let into = CostView {
            pass_elapsed_ms: 1000.0,
            ..busy
        }
        .aged(200.0);
        let long_into = predict_disaggregated(&into, &view(0, 0), 1024, 0, 60.0);
        assert!(
            (long.ttft_ms - long_into.ttft_ms - 1200.0).abs() < 1e-6,
            "{long:?} vs {long_into:?}"
        );
        let short_into = predict_disaggregated(&into, &view(0, 0), 100, 0, 60.0);
        assert!(
            (short_into.ttft_ms - alone.ttft_ms - (full_pass - 1200.0)).abs() < 1e-6,
            "{short_into:?}"
        );
        // Between passes when reported, the report's age says nothing of the pass now.
        assert_eq!(busy.aged(200.0).pass_elapsed_ms, 0.0);
        // So does one that ends in a pass when the prompts queued are no longer than it (the
        // worker admits the shortest first): eighty 100-token prompts ahead of it.
        let shorts = CostView {
            queued_prompts: 80,
            ..view(0, 8000)
        };
        let behind = predict_disaggregated(&shorts, &view(0, 0), 100, 0, 60.0);
        assert!(
            behind.ttft_ms > alone.ttft_ms + 8000.0 * 3.0,
            "{behind:?} vs {alone:?}"
        );
        // Beside streams, a prompt within the paced allowance (a worker at 1 ms a prompt
        // token lends 32 of them a pass) waits at most half a period.
        let cheap = |queued| CostView {
            coefficients: Coefficients {
                per_token_ms: 1.0,
                ..cost()
            },
            ..view(4, queued)
        };
        let short_agg = predict_aggregated(&cheap(4096), 32, 0, slo.tpot_ms);
        let idle_agg = predict_aggregated(&cheap(0), 32, 0, slo.tpot_ms);
        assert!(
            short_agg.ttft_ms <= idle_agg.ttft_ms + slo.tpot_ms * TPOT_HEADROOM / 2.0 + 1e-9,
            "{short_agg:?} vs {idle_agg:?}"
        );
    }

    #[test]
    fn a_split_prompt_costs_time_between_its_whole_placements() {
        let prefill = view(0, 0);
        let decode = view(4, 0);
        let tpot = slo().tpot_ms;
        let disagg = predict_disaggregated(&prefill, &decode, 2048, 0, 60.0);
        let agg = predict_aggregated(&decode, 2048, 0, tpot);
        let mut last = agg.ttft_ms;
        for at in [256, 1024, 1792] {
            let split = predict_split(&prefill, &decode, 2048, 0, at, tpot);
            // A longer first part on the prefill worker's full passes arrives sooner.
            assert!(split.ttft_ms < last, "at {at}: {split:?}");
            assert!(split.ttft_ms > disagg.ttft_ms, "at {at}: {split:?}");
            // The decode worker's part is paced: the streams run at their target.
            assert_eq!(split.tpot_ms, agg.tpot_ms);
            last = split.ttft_ms;
        }
        // Prompt work queued on the decode worker runs while the prefill worker computes.
        let queued = view(4, 4096);
        let quick = predict_split(&prefill, &queued, 2048, 0, 1792, tpot);
        assert!(quick.ttft_ms > last);
    }

    #[test]
    fn the_longest_tail_the_ttft_target_allows_goes_to_the_decode_worker() {
        let prefill = view(0, 0);
        let decode = view(4, 0);
        let loose = RequestSlo {
            ttft_ms: 60_000.0,
            tpot_ms: 60.0,
        };
        let (at, p) = best_split(&prefill, &decode, 2048, 0, 0, &loose, |p| p).unwrap();
        assert_eq!(at, 16, "everything but the first block fits: {p:?}");
        // A tighter target keeps more of the prompt on the prefill worker, and the split
        // found is the shortest part whose prediction fits.
        let whole = predict_disaggregated(&prefill, &decode, 2048, 0, 60.0).ttft_ms;
        let tight = RequestSlo {
            ttft_ms: whole * 1.3,
            tpot_ms: 60.0,
        };
        let (at, p) = best_split(&prefill, &decode, 2048, 0, 0, &tight, |p| p).unwrap();
        assert!(
            at > 16 && at % 16 == 0 && at <= 2048 - MIN_SPLIT_TAIL,
            "{at}"
        );
        assert!(p.ttft_ms <= SPLIT_TTFT_SHARE * tight.ttft_ms, "{p:?}");
        let shorter = predict_split(&prefill, &decode, 2048, 0, at - 16, 60.0);
        assert!(
            shorter.ttft_ms > SPLIT_TTFT_SHARE * tight.ttft_ms,
            "{shorter:?}"
        );
        // No room at all, a prompt too short to split, a decode cache past every split, or a
        // calibration that says the predictions run short: no split.
        let none = RequestSlo {
            ttft_ms: whole,
            tpot_ms: 60.0,
        };
        assert_eq!(
            best_split(&prefill, &decode, 2048, 0, 0, &none, |p| p),
            None
        );
        assert_eq!(best_split(&prefill, &decode, 64, 0, 0, &loose, |p| p), None);
        assert_eq!(
            best_split(&prefill, &decode, 2048, 0, 2000, &loose, |p| p),
            None
        );
        let pessimist = |p: Prediction| Prediction {
            ttft_ms: p.ttft_ms * 100.0,
            ..p
        };
        assert_eq!(
            best_split(&prefill, &decode, 2048, 0, 0, &tight, pessimist),
            None
        );
        // Streams over their target beside any prompt work: no split.
        let tight_tpot = RequestSlo {
            ttft_ms: 60_000.0,
            tpot_ms: 5.0,
        };
        assert_eq!(
            best_split(&prefill, &decode, 2048, 0, 0, &tight_tpot, |p| p),
            None
        );
    }

    #[test]
    fn cached_tokens_are_not_priced_and_decode_workers_borrow_prompt_costs() {
        let prefill = view(0, 0);
        let decode = view(2, 0);
        let whole = predict_disaggregated(&prefill, &decode, 2048, 0, 60.0);
        let mostly_cached = predict_disaggregated(&prefill, &decode, 2048, 2000, 60.0);
        assert!(mostly_cached.ttft_ms * 10.0 < whole.ttft_ms);
        // A cache claiming the whole prompt still leaves its last token to compute.
        assert!(predict_disaggregated(&prefill, &decode, 2048, 5000, 60.0).ttft_ms > 0.0);
        let mut blind = view(2, 0);
        blind.coefficients.per_token_ms = 0.0;
        blind.prompts_known = false;
        blind.borrow_prompt_costs(&prefill);
        assert_eq!(blind.coefficients.per_token_ms, 4.0);
        assert!(blind.prompts_known);
    }

    #[test]
    fn the_static_rules_placement_stays_unless_the_predictions_clearly_favour_another() {
        let slo = RequestSlo {
            ttft_ms: 1000.0,
            tpot_ms: 60.0,
        };
        let p = |ttft_ms, tpot_ms| Prediction { ttft_ms, tpot_ms };
        let disagg = Placement::Disaggregated { prefill: 0 };
        let pick = |agg: Prediction, dis: Prediction, default| {
            choose(
                &[(Placement::Aggregated, agg), (disagg, dis)],
                default,
                &slo,
            )
            .map(|c| c.0)
        };
        let agg = Some(Placement::Aggregated);
        // The default meets its targets: kept, even beside one with more room.
        assert_eq!(pick(p(900.0, 54.0), p(100.0, 30.0), agg), agg);
        // It misses and another meets: that one.
        assert_eq!(pick(p(1500.0, 54.0), p(900.0, 54.0), agg), Some(disagg));
        // Both miss: the default, unless the other is clearly gentler on the streams, however
        // much sooner either would start.
        assert_eq!(pick(p(9000.0, 54.0), p(2000.0, 54.0), agg), agg);
        assert_eq!(pick(p(2000.0, 54.0), p(9000.0, 40.0), agg), Some(disagg));
        // No default (or one not among the options): the least pressure.
        assert_eq!(pick(p(900.0, 30.0), p(100.0, 30.0), None), Some(disagg));
        let other = Some(Placement::Disaggregated { prefill: 7 });
        assert_eq!(pick(p(900.0, 30.0), p(100.0, 30.0), other), Some(disagg));
    }

    #[test]
    fn a_short_prompt_on_a_starved_decode_worker_waits_for_a_granule_not_the_queue() {
        // Streams whose passes alone fill their target (24 rows of 600 tokens: 2 + 24 +
        // 0.43 ms = 26 ms against 0.9 x 20 ms), and two long prompts queued.
        let mut decode = view(24, 4096);
        decode.prompt_rows = 2;
        decode.queued_prompts = 2;
        let tight = 20.0;
        let short = predict_aggregated(&decode, 16, 0, tight);
        let streams = decode.coefficients.step_ms(&decode.streams());
        assert!(streams > tight * TPOT_HEADROOM, "{streams}");
        // At most the starved pacing's wait for a granule, then its own granule.
        assert!(
            short.ttft_ms <= 2.0 * STARVED_PASSES as f64 * streams,
            "{short:?}, a pass {streams} ms"
        );
        // A long one waits for the queue.
        let long = predict_aggregated(&decode, 2048, 0, tight);
        assert!(long.ttft_ms > 20.0 * short.ttft_ms, "{long:?} vs {short:?}");
    }

    #[test]
    fn a_short_prompt_behind_a_long_one_waits_for_the_chunks_the_pacing_lets_in() {
        let slo = slo();
        // 4 streams and a 2048-token prompt in progress on a worker at 1 ms a prompt token;
        // its last pass beside the streams let in 96 prompt tokens (its streams had a lead
        // to spend), where the model at the aim allows 32.
        let cost = Coefficients {
            per_token_ms: 1.0,
            ..cost()
        };
        let mut decode = CostView {
            coefficients: cost,
            ..view(4, 2048)
        };
        let unreported = predict_aggregated(&decode, 16, 0, slo.tpot_ms);
        decode.prompt_allowance = 96;
        let chunk_pass = cost.step_ms(&decode.streams().plus(StepShape::chunk(0, 96, false)));
        let short = predict_aggregated(&decode, 16, 0, slo.tpot_ms);
        // Half the pass under way, then a pass of its own that the queue's chunk fills.
        let expected = chunk_pass / 2.0 + chunk_pass;
        assert!(
            (short.ttft_ms - expected).abs() < 1e-6,
            "{short:?}, {expected}"
        );
        assert!(
            short.ttft_ms > unreported.ttft_ms,
            "{short:?} {unreported:?}"
        );
        // A pass under way that the report caught 100 ms in leaves the rest of it.
        decode.pass_elapsed_ms = 100.0;
        let caught = predict_aggregated(&decode, 16, 0, slo.tpot_ms);
        assert!(
            (caught.ttft_ms - (chunk_pass - 100.0 + chunk_pass)).abs() < 1e-6,
            "{caught:?}"
        );
        // A long prompt queues behind the other as before.
        decode.pass_elapsed_ms = 0.0;
        let long = predict_aggregated(&decode, 2048, 0, slo.tpot_ms);
        assert!(long.ttft_ms > 10.0 * short.ttft_ms, "{long:?}");
    }

    #[test]
    fn streams_of_a_worker_that_lends_its_slack_run_at_their_target() {
        let prefill = view(0, 0);
        let mut decode = view(2, 0);
        let fast = predict_disaggregated(&prefill, &decode, 64, 0, 60.0);
        assert!(fast.tpot_ms < 10.0, "{fast:?}");
        decode.lends_slack = true;
        let paced = predict_disaggregated(&prefill, &decode, 64, 0, 60.0);
        assert!(
            (paced.tpot_ms - 60.0 * TPOT_HEADROOM).abs() < 1e-9,
            "{paced:?}"
        );
        let alone = predict_aggregated(&view(0, 0), 64, 0, 60.0);
        let mut lending = view(0, 0);
        lending.lends_slack = true;
        let paced_alone = predict_aggregated(&lending, 64, 0, 60.0);
        assert!(
            alone.tpot_ms < paced_alone.tpot_ms,
            "{alone:?} {paced_alone:?}"
        );
    }
}
