//! What routing knows of one worker's costs and work ([`CostView`]): its last load
//! report's cost model and queue, corrected by what this router sent it and saw end there
//! since ([`SinceReport`]), and the times SLO placement (`placement`) reads off it: a pass of
//! its streams, a prompt's compute and the queue ahead of it.

use tandem_cost::{Coefficients, MIN_PROMPT_TOKENS_SEEN, StepShape, TPOT_HEADROOM};
use tandem_proto::v1::LoadReport;

/// The granule of a prompt chunk (whole KV blocks).
pub(super) const CHUNK_GRANULE: u64 = tandem_kv::BLOCK_SIZE as u64;

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
    /// How long the pass under way has run, as of now (0: between passes when reported).
    /// The queued prompt work counts that pass's prompts whole until it ends.
    pub pass_elapsed_ms: f64,
    /// Tokens one pass may run.
    pub max_batch_tokens: u64,
    /// Whether its fit has seen enough prompt tokens to price a prompt (or it borrowed a
    /// price from one that has).
    pub prompts_known: bool,
    /// It paces its streams to their target and idles the rest (`StepCost::lends_slack`).
    pub lends_slack: bool,
    /// The prompt tokens its pacing let into its last pass beside streams (0: not capped).
    pub prompt_allowance: u64,
    /// The least lead its streams hold on their pacing aims (`StepCost.streams_lead_ms`),
    /// and on their targets (`StepCost.streams_target_lead_ms`).
    pub streams_lead_ms: f64,
    pub streams_target_lead_ms: f64,
}

/// A figure from a peer, 0 when it is not a number.
fn finite_or_zero(value: f64) -> f64 {
    if value.is_finite() { value } else { 0.0 }
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
            pass_elapsed_ms: if cost.pass_elapsed_ms.is_finite() {
                cost.pass_elapsed_ms.max(0.0)
            } else {
                0.0
            },
            max_batch_tokens: u64::from(cost.max_batch_tokens).max(CHUNK_GRANULE),
            prompts_known,
            lends_slack: cost.lends_slack,
            prompt_allowance: u64::from(cost.prompt_allowance),
            streams_lead_ms: finite_or_zero(cost.streams_lead_ms),
            // A stream's lead on its target is at least its lead on its aim (a worker that
            // does not report it: no margin).
            streams_target_lead_ms: finite_or_zero(cost.streams_target_lead_ms)
                .max(finite_or_zero(cost.streams_lead_ms)),
        })
    }

    /// The view `age_ms` after its report came: a pass under way then has run that much
    /// longer.
    pub fn aged(mut self, age_ms: f64) -> Self {
        if self.pass_elapsed_ms > 0.0 && age_ms.is_finite() && age_ms > 0.0 {
            self.pass_elapsed_ms += age_ms;
        }
        self
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

    /// The tightest of a worker's streams, as its report gives it, under a TPOT target of
    /// `target_ms` ([`tandem_cost::Standing`]): its leads on aim and target fix the tokens it
    /// produced (each adds the margin between them) and the time they took. Its remaining
    /// tokens are unknown: as many as the pacing looks ahead.
    pub(super) fn tightest_stream(&self, target_ms: f64) -> tandem_cost::Standing {
        let margin = target_ms * (1.0 - TPOT_HEADROOM);
        let tokens = if margin > 0.0 {
            ((self.streams_target_lead_ms - self.streams_lead_ms) / margin)
                .round()
                .clamp(0.0, 1e9)
        } else {
            0.0
        };
        tandem_cost::Standing {
            target_ms,
            tokens: tokens as u64,
            elapsed_ms: target_ms * TPOT_HEADROOM * tokens - self.streams_lead_ms,
            remaining: tandem_cost::DEBT_HORIZON,
        }
    }

    /// The streams decoding now: what a prompt computed here shares its passes with.
    pub(super) fn streams(&self) -> StepShape {
        StepShape::decode(self.decode_rows, self.decode_context)
    }

    /// The streams decoding now and those that the prompts queued here become once
    /// computed (each queued prompt's context counted as its share of the queue): what the
    /// passes run soon, as a wave of prompts placed here starts decoding.
    pub fn streams_to_come(&self) -> StepShape {
        let (rows, prompts_context) = if self.prompt_rows > 0 {
            (self.prompt_rows, self.queued_prompt_tokens)
        } else {
            (0, 0)
        };
        StepShape::decode(
            self.decode_rows + rows,
            self.decode_context + prompts_context,
        )
    }

    /// The streams' pass once the queued prompts here and a new stream of `context` tokens
    /// have joined them ([`CostView::streams_to_come`] and one more).
    pub(super) fn pass_with_one_more(&self, context: u64) -> f64 {
        let shape = self.streams_to_come().plus(StepShape::decode(1, context));
        self.coefficients.step_ms(&shape)
    }

    /// The TPOT of streams whose passes take `pass_ms` here, under a target of `tpot_ms`: a
    /// worker that lends its slack stretches each period to 0.9 of the target.
    pub(super) fn stream_tpot(&self, pass_ms: f64, tpot_ms: f64) -> f64 {
        if self.lends_slack {
            pass_ms.max(tpot_ms * TPOT_HEADROOM)
        } else {
            pass_ms
        }
    }

    /// Time for this worker to run `queued` prompt tokens ahead and then `tokens` of this
    /// prompt after `cached` ones, in chunks of `chunk` beside `beside`. The queue is priced
    /// per token at this prompt's rate, and not at all beyond the pass under way for a
    /// prompt that goes before it ([`CostView::queue_ms`]).
    pub(super) fn prompt_ms(&self, beside: StepShape, cached: u64, tokens: u64, chunk: u64) -> f64 {
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
    /// way (`pass_ms`). A prompt as long as those queued waits for them all, less what the
    /// pass under way has done of them.
    ///
    /// How far that pass is comes from the report, when it ran less than a full pass of its
    /// time; else (between passes when reported, or a pass that has ended since) it is
    /// unknown: half done on average.
    pub(super) fn queue_ms(&self, own_ms: f64, tokens: u64, one_pass: u64, pass_ms: f64) -> f64 {
        let queue = own_ms / tokens.max(1) as f64 * self.queued_prompt_tokens as f64;
        if self.goes_before_queue(tokens, one_pass) {
            queue.min(self.rest_of_pass_ms(pass_ms))
        } else {
            queue - self.pass_done_ms(pass_ms).unwrap_or(0.0).min(queue)
        }
    }

    /// How far the pass under way, a pass of `pass_ms`, has run: known when the report
    /// caught it under way less than that long ago.
    fn pass_done_ms(&self, pass_ms: f64) -> Option<f64> {
        (self.pass_elapsed_ms > 0.0 && self.pass_elapsed_ms < pass_ms)
            .then_some(self.pass_elapsed_ms)
    }

    /// Whether a prompt of `tokens` is scheduled before the queued prompts (see
    /// [`CostView::queue_ms`]): it ends within one pass of `one_pass` tokens and is at most
    /// half their mean length.
    pub(super) fn goes_before_queue(&self, tokens: u64, one_pass: u64) -> bool {
        let mean_queued = self.queued_prompt_tokens / self.queued_prompts.max(1);
        tokens <= one_pass && tokens.saturating_mul(2) <= mean_queued
    }

    /// What is left of the pass under way, a pass of `pass_ms`: known from the report when
    /// it ran less than that, else half of it.
    fn rest_of_pass_ms(&self, pass_ms: f64) -> f64 {
        self.pass_done_ms(pass_ms)
            .map_or(pass_ms / 2.0, |done| pass_ms - done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_proto::v1::StepCost;

    #[test]
    fn queued_prompts_count_as_the_streams_they_become() {
        let load = LoadReport {
            queued_prompts: 3,
            queued_prefill_tokens: 48,
            step_cost: Some(StepCost {
                base_ms: 2.0,
                per_row_ms: 1.0,
                per_mpair_ms: 1000.0,
                passes: 5,
                decode_rows: 2,
                decode_context_tokens: 1000,
                ..Default::default()
            }),
            ..Default::default()
        };
        let decode = CostView::from_report(&load, SinceReport::default(), true).unwrap();
        assert_eq!(decode.streams_to_come(), StepShape::decode(5, 1048));
        // 2 ms + 6 rows · 1 ms + 1100 keys (the new stream's 52 among them) · 1 µs.
        assert!((decode.pass_with_one_more(52) - 9.1).abs() < 1e-9);
        // A prefill worker's queued prompts become streams elsewhere.
        let prefill = CostView::from_report(&load, SinceReport::default(), false).unwrap();
        assert_eq!(prefill.streams_to_come(), StepShape::decode(2, 1000));
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
                pass_elapsed_ms: 0.0,
                lends_slack: false,
                streams_lead_ms: -25.0,
                streams_target_lead_ms: 41.0,
            }),
            ..Default::default()
        };
        // A debt is kept.
        let v = CostView::from_report(&load, SinceReport::default(), true).unwrap();
        assert_eq!(v.streams_lead_ms, -25.0);
        // Its tightest stream under a 60 ms target: 11 tokens (each adds 6 ms of margin
        // between the 54 ms aim and the target) in 619 ms.
        let tightest = v.tightest_stream(60.0);
        assert_eq!((tightest.tokens, tightest.elapsed_ms), (11, 619.0));
        assert!((tightest.lead_ms(54.0) + 25.0).abs() < 1e-9);
        assert!((tightest.lead_ms(60.0) - 41.0).abs() < 1e-9);
        // A worker that reports no lead on the targets: none beyond the aim's.
        let mut older = load.clone();
        older.step_cost.as_mut().unwrap().streams_target_lead_ms = 0.0;
        older.step_cost.as_mut().unwrap().streams_lead_ms = 30.0;
        let v = CostView::from_report(&older, SinceReport::default(), true).unwrap();
        assert_eq!(v.streams_target_lead_ms, 30.0);
        assert_eq!(v.tightest_stream(60.0).tokens, 0);
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
}
