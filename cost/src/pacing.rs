//! Pacing a decode worker's prompt chunks to its streams' TPOT targets, stream by stream
//! (Sarathi-Serve's stall-free batching, with each stream's own average as the limit).
//!
//! A stream's TPOT is its own average over its tokens, not any single pass: a stream that
//! ran under its target has banked the difference, and a pass may also run into debt that the
//! passes after it repay by running the streams alone. So each stream keeps its standing
//! ([`Standing`]): the tokens it produced since its first and the time they took, and the
//! tokens it may still produce. A pass may take as long as lets every stream, with the passes
//! after it running the streams alone, still be within its target after its next
//! [`DEBT_HORIZON`] tokens (fewer when its `max_tokens` ends it sooner), and never more than
//! [`LONGEST_PASS_TARGETS`] targets; the tightest stream sets it. Banked lead is spent where it was earned: streams that have
//! just started or are about to end bound a pass to little more than their period, streams
//! that ran under their target let a long prompt through at full speed.
//!
//! Prompt chunks aim at [`crate::TPOT_HEADROOM`] of each target. Chunks are taken whole
//! ([`MIN_PACED_CHUNK`] tokens at least, or the prompts waiting if fewer): small chunks
//! spend the streams' slack on per-pass costs (on a 2-core Zen 4, SmolLM2-135M, 16 streams,
//! `engine/examples/chunk_cost.rs`: a 2048-token prompt cost 1.49 ms a token beyond the
//! streams' passes in 16-token chunks, 1.10-1.22 in chunks of 64 to 512), so a worker in
//! debt runs the streams alone until a whole chunk fits. Prompts that finish in the pass (a new stream's, typically a few
//! tokens, with a TTFT target of about a second) may also use the margin between the aim and
//! the targets themselves, which a stream that has run a while holds plenty of: they start
//! at once instead of waiting for the tightest stream to repay a long prompt's chunks. When
//! the streams alone fill their aim, a waiting prompt still gets a granule every
//! [`STARVED_PASSES`] passes. A pass without streams is held to [`LONGEST_PASS_TARGETS`] of
//! the tightest target of the requests on the worker ([`lone_pass_allowance`]): a new
//! stream's prompt arriving meanwhile waits for it.

use crate::{Coefficients, LONGEST_PASS_TARGETS, STARVED_PASSES, StepShape, TPOT_HEADROOM};

/// The tokens over which a stream repays a long pass: a pass may leave a stream behind its
/// aim by what its next this-many tokens, run at the streams' own pace, make up.
pub const DEBT_HORIZON: u64 = 16;

/// The fewest prompt tokens a paced pass takes (fewer only when fewer are waiting): smaller
/// chunks spend the streams' slack on per-pass costs.
pub const MIN_PACED_CHUNK: u64 = 64;

/// One decoding stream's standing against its TPOT target.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Standing {
    /// Its TPOT target, ms per token.
    pub target_ms: f64,
    /// Tokens it produced since its first.
    pub tokens: u64,
    /// The time they took, ms.
    pub elapsed_ms: f64,
    /// Tokens it may still produce (its `max_tokens` left).
    pub remaining: u64,
}

impl Standing {
    /// How far ahead of `per_token_ms` a token it is (negative: behind).
    pub fn lead_ms(&self, per_token_ms: f64) -> f64 {
        per_token_ms * self.tokens as f64 - self.elapsed_ms
    }

    /// The longest the next pass may take for this stream to be within `per_token_ms` after
    /// its horizon's tokens (see the module docs), the passes after it running the streams
    /// alone in `streams_ms`; never more than [`LONGEST_PASS_TARGETS`] targets.
    fn room_ms(&self, per_token_ms: f64, streams_ms: f64) -> f64 {
        let tokens = self.remaining.clamp(1, DEBT_HORIZON) as f64;
        let room = self.lead_ms(per_token_ms) + per_token_ms * tokens - (tokens - 1.0) * streams_ms;
        room.min(LONGEST_PASS_TARGETS * self.target_ms)
    }

    /// The room for prompt chunks: at the aim, [`TPOT_HEADROOM`] of the target.
    pub fn paced_room_ms(&self, streams_ms: f64) -> f64 {
        self.room_ms(self.target_ms * TPOT_HEADROOM, streams_ms)
    }

    /// The room for prompts that finish in the pass: at the target itself.
    pub fn limit_room_ms(&self, streams_ms: f64) -> f64 {
        self.room_ms(self.target_ms, streams_ms)
    }
}

/// What the next pass may take beside the streams: at the aim and at the targets (`None`: no
/// stream has a target).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PassBudget {
    pub paced_ms: f64,
    pub limit_ms: f64,
}

/// The next pass's budget for every stream in `standings`, whose passes alone take
/// `streams_ms`: the tightest stream's rooms.
pub fn pass_budget(standings: &[Standing], streams_ms: f64) -> Option<PassBudget> {
    Some(PassBudget {
        paced_ms: least(standings, |s| s.paced_room_ms(streams_ms))?,
        limit_ms: least(standings, |s| s.limit_room_ms(streams_ms))?,
    })
}

/// How long a worker that lends its slack idles after a pass of its streams alone that took
/// `elapsed_ms` (standings taken after it): the rest of the tightest aim's period, but no
/// more than any stream's lead on its aim, so a stream behind is not held back.
pub fn idle_ms(standings: &[Standing], elapsed_ms: f64) -> f64 {
    let (Some(tightest), Some(lead)) = (
        least(standings, |s| s.target_ms * TPOT_HEADROOM),
        least_lead_ms(standings),
    ) else {
        return 0.0;
    };
    let idle = (tightest - elapsed_ms).min(lead);
    if idle.is_finite() { idle.max(0.0) } else { 0.0 }
}

/// The least lead of `standings` on their aims ([`TPOT_HEADROOM`] of each target; `None`:
/// no stream): what the tightest stream may still spend, which a router predicting a paced
/// prompt reads from the load report.
pub fn least_lead_ms(standings: &[Standing]) -> Option<f64> {
    least(standings, |s| s.lead_ms(s.target_ms * TPOT_HEADROOM))
}

/// The least lead of `standings` on their targets themselves (`None`: no stream): how far
/// the chunk that finishes a prompt, which the pacing lets run to the targets, may go.
pub fn least_target_lead_ms(standings: &[Standing]) -> Option<f64> {
    least(standings, |s| s.lead_ms(s.target_ms))
}

/// The prompt tokens a pass without streams may take when the tightest TPOT target of the
/// requests on the worker is `target_ms`: what [`LONGEST_PASS_TARGETS`] of it hold (a new
/// stream's prompt arriving meanwhile waits for the pass), at least a granule.
pub fn lone_pass_allowance(cost: &Coefficients, target_ms: f64, waiting: &Waiting) -> u64 {
    let granule = waiting.granule.max(1);
    cost.chunk_allowance(
        StepShape::default(),
        waiting.start,
        LONGEST_PASS_TARGETS * target_ms,
        waiting.max,
        granule,
    )
    .max(granule)
}

/// The most passes [`paced_prompt_ms`] replays (the router replays on the request path); a
/// prompt still unfinished then (only one the streams starve, at a granule every
/// [`STARVED_PASSES`] passes) is priced at that rate for the rest.
const MAX_REPLAYED_PASSES: u64 = 10_000;

/// How long prompt tokens `start..start + tokens` take on a decode worker whose streams
/// (their passes shaped `beside`) are paced by [`Pacing`], the tightest of them standing as
/// `tightest`: the passes the worker would run, replayed with `cost`'s prices. Each pass
/// takes the chunk [`Pacing::allowance`] grants (at most `max` tokens, whole `granule`s), the
/// tightest stream one token further and the pass's time older, until the prompt is done.
///
/// Why a replay rather than a formula: the pacing spends the streams' lead, lets them run a
/// debt their next [`DEBT_HORIZON`] tokens repay, takes the last chunk to the targets
/// themselves when it finishes the prompt, and starves nothing; a closed form over the
/// streams' slack share saw only the first and put long prompts' TTFT a median 31 % off
/// where the replay is 12 % off (BENCHMARKS.md, goodput under latency targets).
pub fn paced_prompt_ms(
    cost: &Coefficients,
    beside: StepShape,
    start: u64,
    tokens: u64,
    tightest: Standing,
    max: u64,
    granule: u64,
) -> f64 {
    let streams_ms = cost.step_ms(&beside);
    let granule = granule.max(1);
    let end = start.saturating_add(tokens);
    let (mut at, mut total, mut passes) = (start, 0.0, 0u64);
    let mut stream = tightest;
    let mut pacing = Pacing::default();
    while at < end {
        if passes >= MAX_REPLAYED_PASSES {
            let left = (end - at).div_ceil(granule) as f64;
            return total + left * STARVED_PASSES as f64 * streams_ms;
        }
        let pending = [end - at];
        let waiting = Waiting {
            start: at,
            pending: &pending,
            max,
            granule,
        };
        let chunk = match pass_budget(std::slice::from_ref(&stream), streams_ms) {
            Some(budget) => pacing.allowance(cost, beside, budget, &waiting),
            None => max,
        }
        .min(end - at);
        let ms = cost.step_ms(&beside.plus(StepShape::chunk(at, chunk, at + chunk == end)));
        total += ms;
        at += chunk;
        passes += 1;
        stream.tokens += 1;
        stream.elapsed_ms += ms;
    }
    total
}

/// The least of `of` over `standings`, NaNs left out (`None`: none).
fn least(standings: &[Standing], of: impl Fn(&Standing) -> f64) -> Option<f64> {
    standings
        .iter()
        .map(of)
        .filter(|ms| !ms.is_nan())
        .min_by(f64::total_cmp)
}

/// The prompts waiting on a decode worker, and how it chunks them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Waiting<'a> {
    /// Tokens the first prompt under way has computed (where its next chunk starts).
    pub start: u64,
    /// Tokens each waiting prompt still computes, fewest first.
    pub pending: &'a [u64],
    /// The most prompt tokens a pass takes.
    pub max: u64,
    /// Chunks are whole multiples of this many tokens.
    pub granule: u64,
}

/// The prompt tokens a decode worker lets into each pass beside its streams (see the module
/// docs); it remembers how many passes a waiting prompt went without.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Pacing {
    starved: u64,
}

impl Pacing {
    /// The prompt tokens the next pass running `beside` may add when it may take `budget`
    /// and `waiting` prompts wait: 0 to let this pass run the streams alone.
    pub fn allowance(
        &mut self,
        cost: &Coefficients,
        beside: StepShape,
        budget: PassBudget,
        waiting: &Waiting,
    ) -> u64 {
        let Waiting {
            start,
            pending,
            max,
            granule,
        } = *waiting;
        let granule = granule.max(1);
        let total: u64 = pending.iter().sum();
        let tokens = cost.chunk_allowance(beside, start, budget.paced_ms, max, granule);
        if tokens >= total.clamp(1, MIN_PACED_CHUNK) {
            self.starved = 0;
            return tokens;
        }
        // The shortest prompts that finish within the pass at the targets themselves (each
        // from its start: they are new).
        let (mut finishing, mut shape) = (0u64, beside);
        for &prompt in pending {
            let more = finishing.saturating_add(prompt);
            let with = shape.plus(StepShape::chunk(0, prompt, true));
            if more > max || cost.step_ms(&with) > budget.limit_ms {
                break;
            }
            (finishing, shape) = (more, with);
        }
        if finishing > 0 {
            self.starved = 0;
            return finishing;
        }
        self.starved += 1;
        if self.starved >= STARVED_PASSES {
            self.starved = 0;
            return granule;
        }
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COST: Coefficients = Coefficients {
        base_ms: 2.0,
        per_row_ms: 0.5,
        per_token_ms: 0.3,
        per_mpair_ms: 40.0,
    };

    fn waiting(start: u64, pending: &[u64]) -> Waiting<'_> {
        Waiting {
            start,
            pending,
            max: 512,
            granule: 16,
        }
    }

    fn stream(target_ms: f64, tokens: u64, elapsed_ms: f64, remaining: u64) -> Standing {
        Standing {
            target_ms,
            tokens,
            elapsed_ms,
            remaining,
        }
    }

    #[test]
    fn a_stream_bounds_a_pass_by_its_lead_and_what_its_next_tokens_repay() {
        // Just started, aiming at 0.9 x 60 = 54 ms a token, the streams' passes 20 ms: over
        // 16 tokens it may be 16 x 54 - 15 x 20 = 564 ms, capped at 5 targets (300 ms).
        let fresh = stream(60.0, 0, 0.0, 1000);
        assert_eq!(fresh.paced_room_ms(20.0), 300.0);
        // Behind its aim by 400 ms: 164 ms left; at the target itself, 16 x 60 - 300 - 400.
        let behind = stream(60.0, 0, 400.0, 1000);
        assert!((behind.paced_room_ms(20.0) - 164.0).abs() < 1e-9);
        assert!((behind.limit_room_ms(20.0) - 260.0).abs() < 1e-9);
        // 100 tokens in 5.2 s: 200 ms ahead of its aim, 800 ms of its target.
        let ran = stream(60.0, 100, 5200.0, 1000);
        assert!((ran.lead_ms(54.0) - 200.0).abs() < 1e-9);
        assert!((ran.lead_ms(60.0) - 800.0).abs() < 1e-9);
        // Two tokens from its end: only those two repay.
        let ending = stream(60.0, 0, 0.0, 2);
        assert!((ending.paced_room_ms(20.0) - 88.0).abs() < 1e-9);
        // The tightest stream sets the budget; none with a target, no budget.
        let budget = pass_budget(&[fresh, behind, ending], 20.0).unwrap();
        assert!((budget.paced_ms - 88.0).abs() < 1e-9);
        assert!((budget.limit_ms - ending.limit_room_ms(20.0)).abs() < 1e-9);
        assert_eq!(pass_budget(&[], 20.0), None);
    }

    #[test]
    fn chunks_go_whole_new_prompts_go_at_once_and_none_starves() {
        let beside = StepShape::decode(8, 8 * 1000);
        let streams = COST.step_ms(&beside);
        let mut pacing = Pacing::default();
        // A fresh stream's room fits a large chunk: it goes.
        let budget = pass_budget(&[stream(60.0, 0, 0.0, 1000)], streams).unwrap();
        let long = [2048];
        let granted = pacing.allowance(&COST, beside, budget, &waiting(0, &long));
        assert!(granted >= MIN_PACED_CHUNK, "{granted}");
        let pass = COST.step_ms(&beside.plus(StepShape::chunk(0, granted, false)));
        assert!(pass <= budget.paced_ms + 1e-9);
        // Room for a granule of the long prompt but not a whole chunk: the streams run
        // alone until one fits...
        let tight = PassBudget {
            paced_ms: streams + 10.0,
            limit_ms: streams + 20.0,
        };
        let fits = COST.chunk_allowance(beside, granted, tight.paced_ms, 512, 16);
        assert!(fits > 0 && fits < MIN_PACED_CHUNK, "{fits}");
        assert_eq!(
            pacing.allowance(&COST, beside, tight, &waiting(granted, &long)),
            0
        );
        // ...but new streams' prompts that finish within the targets go at once, as many as
        // fit, shortest first.
        let new_streams = [16, 16, 16, 16, 2048];
        let granted = pacing.allowance(&COST, beside, tight, &waiting(granted, &new_streams));
        assert_eq!(granted, 48);
        let three = (0..3).fold(beside, |s, _| s.plus(StepShape::chunk(0, 16, true)));
        assert!(COST.step_ms(&three) <= tight.limit_ms);
        let four = three.plus(StepShape::chunk(0, 16, true));
        assert!(COST.step_ms(&four) > tight.limit_ms);
        // Streams that fill their aim alone: a granule every STARVED_PASSES passes.
        let full = pass_budget(&[stream(streams / 2.0, 0, 0.0, 1000)], streams).unwrap();
        let grants: Vec<u64> = (0..2 * STARVED_PASSES)
            .map(|_| pacing.allowance(&COST, beside, full, &waiting(0, &long)))
            .collect();
        assert_eq!(grants.iter().filter(|&&g| g == 16).count(), 2, "{grants:?}");
        assert_eq!(
            grants.iter().filter(|&&g| g == 0).count(),
            2 * STARVED_PASSES as usize - 2
        );
    }

    #[test]
    fn a_paced_prompt_is_priced_by_the_passes_the_pacing_runs() {
        let beside = StepShape::decode(8, 8 * 1000);
        let streams = COST.step_ms(&beside);
        let (alone, _) = COST.prompt_ms(StepShape::default(), 0, 4096, 512);
        let fresh = stream(60.0, 0, 0.0, 1000);
        let paced = paced_prompt_ms(&COST, beside, 0, 4096, fresh, 512, 16);
        // The same passes, run by hand through the pacing.
        let (mut at, mut by_hand, mut tightest) = (0u64, 0.0, fresh);
        let mut pacing = Pacing::default();
        while at < 4096 {
            let budget = pass_budget(&[tightest], streams).unwrap();
            let pending = [4096 - at];
            let chunk = pacing
                .allowance(&COST, beside, budget, &waiting(at, &pending))
                .min(4096 - at);
            let ms = COST.step_ms(&beside.plus(StepShape::chunk(at, chunk, at + chunk == 4096)));
            (at, by_hand) = (at + chunk, by_hand + ms);
            tightest.tokens += 1;
            tightest.elapsed_ms += ms;
        }
        assert!((paced - by_hand).abs() < 1e-9, "{paced} {by_hand}");
        // Beside streams it takes longer than alone; streams that banked a lead let it
        // through sooner, streams in debt later.
        assert!(paced > alone, "{paced} {alone}");
        let ahead = paced_prompt_ms(
            &COST,
            beside,
            0,
            4096,
            stream(60.0, 0, -2000.0, 1000),
            512,
            16,
        );
        let behind = paced_prompt_ms(
            &COST,
            beside,
            0,
            4096,
            stream(60.0, 0, 600.0, 1000),
            512,
            16,
        );
        assert!(ahead < paced && paced < behind, "{ahead} {paced} {behind}");
        // Streams that fill their aim alone: a granule every STARVED_PASSES passes, until
        // the margin between aim and target the stream gains meanwhile lets the rest finish.
        let full = stream(streams / TPOT_HEADROOM, 0, 0.0, 1000);
        let starved = paced_prompt_ms(&COST, beside, 0, 64, full, 512, 16);
        assert!(
            starved >= (STARVED_PASSES - 1) as f64 * streams + COST.prompt_ms(beside, 0, 64, 16).0,
            "{starved}"
        );
        // Nothing to compute, nothing to wait.
        assert_eq!(paced_prompt_ms(&COST, beside, 5, 0, fresh, 512, 16), 0.0);
    }

    #[test]
    fn a_pass_without_streams_holds_to_five_targets_and_never_to_nothing() {
        let tokens = lone_pass_allowance(&COST, 20.0, &waiting(0, &[2048]));
        let pass = COST.step_ms(&StepShape::chunk(0, tokens, false));
        assert!(
            tokens >= 16 && pass <= LONGEST_PASS_TARGETS * 20.0,
            "{tokens}: {pass}"
        );
        let more = COST.step_ms(&StepShape::chunk(0, tokens + 16, false));
        assert!(more > LONGEST_PASS_TARGETS * 20.0, "{more}");
        assert_eq!(lone_pass_allowance(&COST, 0.1, &waiting(0, &[2048])), 16);
    }

    #[test]
    fn a_lending_worker_idles_the_period_rest_unless_a_stream_is_behind() {
        // Aims of 54 ms; a 24 ms pass leaves 30.
        let on_pace = stream(60.0, 10, 10.0 * 54.0 - 30.0, 100);
        assert!((idle_ms(&[on_pace], 24.0) - 30.0).abs() < 1e-9);
        let far_ahead = stream(60.0, 10, 0.0, 100);
        assert!((idle_ms(&[far_ahead], 24.0) - 30.0).abs() < 1e-9);
        let behind = stream(60.0, 10, 10.0 * 54.0 + 5.0, 100);
        assert_eq!(idle_ms(&[far_ahead, behind], 24.0), 0.0);
        assert_eq!(idle_ms(&[], 24.0), 0.0);
        // What the worker reports: the tightest stream's lead on its aim, a debt negative.
        assert!((least_lead_ms(&[far_ahead, on_pace]).unwrap() - 30.0).abs() < 1e-9);
        assert!((least_lead_ms(&[far_ahead, behind]).unwrap() + 5.0).abs() < 1e-9);
        assert_eq!(least_lead_ms(&[]), None);
        // On the targets themselves each token adds the margin: 10 x 6 ms more.
        assert!((least_target_lead_ms(&[far_ahead, on_pace]).unwrap() - 90.0).abs() < 1e-9);
        assert_eq!(least_target_lead_ms(&[]), None);
    }
}
