//! SLO placement (`--placement slo`): for a request and the decode worker routing picked,
//! predict each placement's TTFT and what it does to the decode worker's streams' TPOT, from
//! the cost models the workers fit to their own passes (`tandem_cost`, on every load
//! report), and pick the one that meets both targets with the most room (else the one that
//! misses least). The placements:
//!
//! - **disaggregated on prefill worker P**: TTFT is P's queued prompt tokens and then this
//!   prompt (less what P's cache holds) in full passes; the streams' passes gain one row.
//! - **aggregated on the decode worker**: its queued prompt tokens and this prompt run in
//!   chunks beside its streams, each chunk sized as the worker sizes it (the most prompt
//!   tokens that keep a pass within the TPOT target, `Coefficients::chunk_allowance`);
//!   the streams' passes stay within the target while it runs.
//! - **split between prefill worker P and the decode worker**: P computes the prompt's first
//!   part and sends its KV; the decode worker computes the rest as it would aggregated. The
//!   request's TTFT is never better than both whole placements', but the prefill worker,
//!   which every long prompt queues for, is busy for less of it: when the best whole
//!   placement is P and the TTFT target leaves room, [`best_split`] hands the decode worker's
//!   slack the longest tail the target allows.
//!
//! Predictions are kept honest by what the requests then measure (`calibration`).

use tandem_cost::{Coefficients, MIN_PROMPT_TOKENS_SEEN, StepShape, TPOT_HEADROOM};
use tandem_proto::v1::LoadReport;

use super::slo::RequestSlo;

/// The granule of a prompt chunk (whole KV blocks).
const CHUNK_GRANULE: u64 = tandem_kv::BLOCK_SIZE as u64;

/// What routing knows of one worker's costs and work: its last load report's cost model,
/// and what was sent to it since.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostView {
    pub coefficients: Coefficients,
    /// Streams decoding now (reported, plus sent since less ended since), and their contexts.
    pub decode_rows: u64,
    pub decode_context: u64,
    /// Prompts queued here that become streams here once computed (a decode worker's
    /// aggregated prompts and split tails): they stretch the streams' passes later, not the
    /// passes a new prompt shares with today's streams.
    pub prompt_rows: u64,
    /// Prompt tokens ahead of a new prompt (reported plus dispatched since), and the prompts
    /// they belong to.
    pub queued_prompt_tokens: u64,
    pub queued_prompts: u64,
    /// Tokens one pass may run.
    pub max_batch_tokens: u64,
    /// Whether its fit has seen enough prompt tokens to price a prompt (or it borrowed a
    /// price from one that has).
    pub prompts_known: bool,
}

/// What a router sent to a worker and saw end there since its last load report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SinceReport {
    /// Streams that started decoding there (requests whose prompt was computed elsewhere)
    /// less streams that ended: a wave of streams ending together must not count twice
    /// beside the wave replacing it.
    pub streams: i64,
    /// Prompts sent there to compute, and their tokens.
    pub prompts: u64,
    pub prompt_tokens: u64,
}

impl CostView {
    /// The view of a worker whose last report is `load`, with `since` sent to it or ended
    /// there since; `streams_follow_prompts` for a decode worker, whose queued prompts become
    /// streams. `None` before its first pass.
    pub fn from_report(
        load: &LoadReport,
        since: SinceReport,
        streams_follow_prompts: bool,
    ) -> Option<Self> {
        let cost = load.step_cost.as_ref()?;
        let mut coefficients = Coefficients {
            base_ms: cost.base_ms,
            per_row_ms: cost.per_row_ms,
            per_token_ms: cost.per_token_ms,
            per_mpair_ms: cost.per_mpair_ms,
        };
        let finite = [
            cost.base_ms,
            cost.per_row_ms,
            cost.per_token_ms,
            cost.per_mpair_ms,
        ]
        .iter()
        .all(|v| v.is_finite() && *v >= 0.0);
        if !finite || cost.passes == 0 {
            return None;
        }
        // Workers fit their whole compute team's costs; one the elastic planner runs on part
        // of it computes that much slower (as if compute-bound, as the worker scaled them).
        if load.compute_threads > 0 && load.compute_threads < load.max_compute_threads {
            let slower = f64::from(load.max_compute_threads) / f64::from(load.compute_threads);
            coefficients.base_ms *= slower;
            coefficients.per_row_ms *= slower;
            coefficients.per_token_ms *= slower;
            coefficients.per_mpair_ms *= slower;
        }
        // A price of a prompt token resting on a few short chunks is noise: unknown instead
        // (a decode worker then borrows a prefill worker's). One that has seen enough prices
        // prompts by whatever it fitted, per token or per attention pair.
        let prompts_known = cost.prompt_tokens_seen >= MIN_PROMPT_TOKENS_SEEN
            && (cost.per_token_ms > 0.0 || cost.per_mpair_ms > 0.0);
        if !prompts_known {
            coefficients.per_token_ms = 0.0;
        }
        let reported = u64::from(cost.decode_rows);
        let rows = reported.saturating_add_signed(since.streams);
        // A stream that came or went since is not in the reported contexts: count it at the
        // mean of the others.
        let mean_context = cost
            .decode_context_tokens
            .checked_div(reported)
            .unwrap_or(0);
        let context = if rows >= reported {
            cost.decode_context_tokens
                .saturating_add((rows - reported).saturating_mul(mean_context))
        } else {
            cost.decode_context_tokens
                .saturating_sub((reported - rows).saturating_mul(mean_context))
        };
        let queued_prompts = u64::from(load.queued_prompts).saturating_add(since.prompts);
        Some(Self {
            coefficients,
            decode_rows: rows,
            decode_context: context,
            prompt_rows: if streams_follow_prompts {
                queued_prompts
            } else {
                0
            },
            queued_prompt_tokens: load
                .queued_prefill_tokens
                .saturating_add(since.prompt_tokens),
            queued_prompts,
            max_batch_tokens: u64::from(cost.max_batch_tokens).max(CHUNK_GRANULE),
            prompts_known,
        })
    }

    /// A decode worker that has not run a prompt chunk yet cannot price one: it borrows the
    /// prompt costs of a worker that has (the same model; a first guess its own passes
    /// correct once it runs one).
    pub fn borrow_prompt_costs(&mut self, from: &CostView) {
        if !self.prompts_known && from.prompts_known {
            self.coefficients.per_token_ms = from.coefficients.per_token_ms;
            self.coefficients.per_mpair_ms = self
                .coefficients
                .per_mpair_ms
                .max(from.coefficients.per_mpair_ms);
            self.prompts_known = true;
        }
    }

    /// The streams decoding now: what a prompt computed here shares its passes with.
    fn streams(&self) -> StepShape {
        StepShape::decode(self.decode_rows, self.decode_context)
    }

    /// The streams' pass once the queued prompts here and a new stream of `context` tokens
    /// have joined them (each queued prompt's context counted as its share of the queue).
    fn pass_with_one_more(&self, context: u64) -> f64 {
        let (rows, prompts_context) = if self.prompt_rows > 0 {
            (self.prompt_rows, self.queued_prompt_tokens)
        } else {
            (0, 0)
        };
        let shape = StepShape::decode(
            self.decode_rows + rows + 1,
            self.decode_context + prompts_context + context,
        );
        self.coefficients.step_ms(&shape)
    }

    /// Time for this worker to run `queued` prompt tokens ahead and then `tokens` of this
    /// prompt after `cached` ones, in chunks of `chunk` beside `beside`. The queue is priced
    /// per token at this prompt's rate, and not at all beyond the pass under way for a
    /// prompt that goes before it ([`CostView::queue_ms`]).
    fn prompt_ms(&self, beside: StepShape, cached: u64, tokens: u64, chunk: u64) -> f64 {
        let tokens = tokens.max(1);
        let (own, _) = self.coefficients.prompt_ms(beside, cached, tokens, chunk);
        let pass_ms = self
            .coefficients
            .step_ms(&beside.plus(StepShape::chunk(0, chunk, false)));
        own + self.queue_ms(own, tokens, chunk, pass_ms)
    }

    /// The wait for the prompt tokens queued ahead of a prompt of `tokens` that computes in
    /// `own_ms`, priced per token at its rate. A worker schedules prompts that end within the
    /// coming pass before the chunks of longer ones, the shortest first (see the engine's
    /// `schedule`), so a prompt of at most `one_pass` tokens and at most half the queued
    /// prompts' mean length goes before them: it waits only for the rest of the pass under
    /// way (`pass_ms`), half of it on average. A prompt as long as those queued waits for
    /// them all.
    fn queue_ms(&self, own_ms: f64, tokens: u64, one_pass: u64, pass_ms: f64) -> f64 {
        let queue = own_ms / tokens.max(1) as f64 * self.queued_prompt_tokens as f64;
        let mean_queued = self.queued_prompt_tokens / self.queued_prompts.max(1);
        if tokens <= one_pass && tokens.saturating_mul(2) <= mean_queued {
            queue.min(pass_ms / 2.0)
        } else {
            queue
        }
    }
}

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
        tpot_ms: decode.pass_with_one_more(prompt),
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
            tpot_ms: after,
        };
    }
    let target = tpot_ms * TPOT_HEADROOM;
    let own = decode.coefficients.paced_prompt_ms(
        decode.streams(),
        start,
        tokens,
        target,
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
    DecodePart {
        queue_ms: decode.queue_ms(own, tokens, allowance, streams.max(target)),
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

/// The placement with the least pressure (see [`Prediction::pressure`]); between equals the
/// first listed. `None` for no options.
pub fn choose(
    options: &[(Placement, Prediction)],
    slo: &RequestSlo,
) -> Option<(Placement, Prediction)> {
    options
        .iter()
        .copied()
        .min_by(|a, b| a.1.pressure(slo).total_cmp(&b.1.pressure(slo)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_proto::v1::StepCost;

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
            max_batch_tokens: 512,
            prompts_known: true,
        }
    }

    fn slo() -> RequestSlo {
        RequestSlo {
            ttft_ms: 1000.0 + 1.5 * 2048.0,
            tpot_ms: 60.0,
        }
    }

    #[test]
    fn reports_become_views_with_what_was_sent_since() {
        let load = LoadReport {
            queued_prefill_tokens: 100,
            step_cost: Some(StepCost {
                base_ms: 2.0,
                per_row_ms: 1.0,
                per_token_ms: 4.0,
                per_mpair_ms: 30.0,
                passes: 50,
                decode_rows: 4,
                decode_context_tokens: 4000,
                max_batch_tokens: 512,
                prompt_allowance: 0,
                prompt_tokens_seen: 4096.0,
            }),
            ..Default::default()
        };
        let queued = LoadReport {
            queued_prompts: 1,
            ..load.clone()
        };
        let since = |streams, prompts, prompt_tokens| SinceReport {
            streams,
            prompts,
            prompt_tokens,
        };
        // Two streams started since, and a prompt of 64 tokens was sent: counted at the
        // mean context, and in the queue.
        let v = CostView::from_report(&queued, since(2, 1, 64), true).unwrap();
        assert_eq!(v.coefficients.per_token_ms, 4.0);
        assert_eq!((v.decode_rows, v.decode_context), (6, 6000));
        assert_eq!((v.queued_prompt_tokens, v.queued_prompts), (164, 2));
        // On a decode worker both queued prompts become streams; on a prefill worker, none.
        assert_eq!(v.prompt_rows, 2);
        let prefill = CostView::from_report(&queued, since(0, 1, 64), false).unwrap();
        assert_eq!(prefill.prompt_rows, 0);
        // Three of the four reported streams ended since, and one more started: two rows,
        // the new one counted at the mean context.
        let v = CostView::from_report(&load, since(1 - 3, 0, 0), true).unwrap();
        assert_eq!((v.decode_rows, v.decode_context), (2, 2000));
        // More ended than were reported (a report crossed their ends): none, not a wrap.
        let v = CostView::from_report(&load, since(-9, 0, 0), true).unwrap();
        assert_eq!((v.decode_rows, v.decode_context), (0, 0));
        // A price of a prompt token that rests on a few tokens is not trusted.
        let mut few = load.clone();
        few.step_cost.as_mut().unwrap().prompt_tokens_seen = 100.0;
        let v = CostView::from_report(&few, SinceReport::default(), true).unwrap();
        assert!(!v.prompts_known && !v.coefficients.knows_prompts());
        // One that has seen enough prompts prices them even with all of it on attention.
        let mut on_attention = load.clone();
        on_attention.step_cost.as_mut().unwrap().per_token_ms = 0.0;
        assert!(
            CostView::from_report(&on_attention, SinceReport::default(), true)
                .unwrap()
                .prompts_known
        );
        // Nothing fitted yet, or nonsense from a peer: no view.
        assert_eq!(
            CostView::from_report(&LoadReport::default(), SinceReport::default(), true),
            None
        );
        let mut bad = load.clone();
        bad.step_cost.as_mut().unwrap().per_mpair_ms = f64::NAN;
        assert_eq!(
            CostView::from_report(&bad, SinceReport::default(), true),
            None
        );
        bad.step_cost.as_mut().unwrap().per_mpair_ms = -1.0;
        assert_eq!(
            CostView::from_report(&bad, SinceReport::default(), true),
            None
        );
    }

    #[test]
    fn an_idle_prefill_worker_wins_a_long_prompt_over_busy_streams() {
        let prefill = view(0, 0);
        let decode = view(8, 0);
        let slo = slo();
        let disagg = predict_disaggregated(&prefill, &decode, 2048, 0);
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
            choose(&options, &slo).map(|c| c.0),
            Some(Placement::Disaggregated { prefill: 3 })
        );
    }

    #[test]
    fn a_queued_prefill_worker_loses_to_an_idle_decode_worker() {
        let prefill = view(0, 8192);
        let decode = view(0, 0);
        let slo = slo();
        let disagg = predict_disaggregated(&prefill, &decode, 2048, 0);
        let agg = predict_aggregated(&decode, 2048, 0, slo.tpot_ms);
        // Alone, the decode worker runs the prompt in full passes, as the prefill worker
        // would, without four prompts ahead of it.
        assert!(agg.ttft_ms * 4.0 < disagg.ttft_ms, "{agg:?} vs {disagg:?}");
        let options = [
            (Placement::Disaggregated { prefill: 0 }, disagg),
            (Placement::Aggregated, agg),
        ];
        assert_eq!(
            choose(&options, &slo).map(|c| c.0),
            Some(Placement::Aggregated)
        );
        assert_eq!(choose(&[], &slo), None);
    }

    #[test]
    fn a_prompt_that_ends_in_one_pass_waits_only_for_the_pass_under_way() {
        let slo = slo();
        // A prefill worker with four 2048-token prompts queued, 512-token passes.
        let busy = view(0, 8192);
        let full_pass = cost().step_ms(&StepShape::chunk(0, 512, false));
        let short = predict_disaggregated(&busy, &view(0, 0), 100, 0);
        let alone = predict_disaggregated(&view(0, 0), &view(0, 0), 100, 0);
        assert!(
            (short.ttft_ms - alone.ttft_ms - full_pass / 2.0).abs() < 1e-9,
            "{short:?} vs {alone:?}"
        );
        // One that needs several passes waits for the whole queue.
        let long = predict_disaggregated(&busy, &view(0, 0), 1024, 0);
        let long_alone = predict_disaggregated(&view(0, 0), &view(0, 0), 1024, 0);
        assert!(long.ttft_ms > long_alone.ttft_ms + 8192.0 * 3.0, "{long:?}");
        // So does one that ends in a pass when the prompts queued are no longer than it (the
        // worker admits the shortest first): eighty 100-token prompts ahead of it.
        let shorts = CostView {
            queued_prompts: 80,
            ..view(0, 8000)
        };
        let behind = predict_disaggregated(&shorts, &view(0, 0), 100, 0);
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
        let disagg = predict_disaggregated(&prefill, &decode, 2048, 0);
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
        let whole = predict_disaggregated(&prefill, &decode, 2048, 0).ttft_ms;
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
        let whole = predict_disaggregated(&prefill, &decode, 2048, 0);
        let mostly_cached = predict_disaggregated(&prefill, &decode, 2048, 2000);
        assert!(mostly_cached.ttft_ms * 10.0 < whole.ttft_ms);
        // A cache claiming the whole prompt still leaves its last token to compute.
        assert!(predict_disaggregated(&prefill, &decode, 2048, 5000).ttft_ms > 0.0);
        let mut blind = view(2, 0);
        blind.coefficients.per_token_ms = 0.0;
        blind.prompts_known = false;
        blind.borrow_prompt_costs(&prefill);
        assert_eq!(blind.coefficients.per_token_ms, 4.0);
        assert!(blind.prompts_known);
    }
}
