//! The decisions themselves: pick a decode worker and a prefill worker (by the prompt's
//! cached prefix and load, by load alone, or in turn: `--routing`), and the mode of a request
//! (disaggregated, aggregated, or refused).
//!
//! kv-aware, the formulas (both logged at debug for every candidate):
//! - decode: the highest `free − w × missing`, where `free` is the worker's free KV blocks,
//!   `missing` the prompt's blocks beyond the longest prefix its cache holds, and `w`
//!   (`--kv-overlap-weight`, default 2) the price of one missing block: the block it will
//!   occupy, and the KV that must be moved into it or computed there. With w = 1 this is the
//!   free blocks the worker has left once the request is in.
//! - prefill: the lowest `queued + missing_tokens`: the prompt tokens the worker must compute
//!   before this prompt's first token (what is queued, plus this prompt less the prefix its
//!   cache holds).
//!
//! A conversation's next turn therefore stays where its history is cached unless that worker
//! is much busier (stickiness falls out of the overlap). Load reports are polled (every
//! `--health-interval-ms`), so between two reports every request would otherwise go to the
//! same "best" worker: the router adds what it has itself dispatched since the last report
//! (`pending_*`; a prompt's tokens only until its prefill is done) to the reported load, and
//! the prompts it sent to the worker's cache.

use crate::config::{FallbackPolicy, RoutingPolicy};

/// A healthy, compatible decode worker as routing sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeCandidate {
    /// The worker's id in the pool (`Worker::id`).
    pub id: usize,
    /// Free KV blocks in its last load report.
    pub free_blocks: u32,
    /// Sequences running in its last load report.
    pub running: u32,
    /// KV blocks of requests the router sent it since that report.
    pub pending_blocks: u32,
    /// Requests the router sent it since that report.
    pub pending_requests: u32,
    /// Blocks of the prompt its prefix cache holds (as far as the router knows).
    pub cached_blocks: u32,
    /// Blocks its prefix cache holds in all (last report): between equals, a new prefix
    /// goes where the cache is emptier, which spreads prefixes over the workers.
    pub cache_fill: u32,
}

impl DecodeCandidate {
    fn effective_free(&self) -> u32 {
        self.free_blocks.saturating_sub(self.pending_blocks)
    }

    fn effective_running(&self) -> u32 {
        self.running.saturating_add(self.pending_requests)
    }
}

/// A healthy prefill worker as routing sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillCandidate {
    /// The worker's id in the pool (`Worker::id`).
    pub id: usize,
    /// Prompt tokens queued or running in its last load report.
    pub queued_prefill_tokens: u64,
    /// Prompt tokens the router sent it since that report.
    pub pending_tokens: u64,
    /// Tokens of the prompt its prefix cache holds (as far as the router knows).
    pub cached_tokens: u64,
    /// Blocks its prefix cache holds in all (see [`DecodeCandidate::cache_fill`]).
    pub cache_fill: u32,
}

impl PrefillCandidate {
    fn effective_queued(&self) -> u64 {
        self.queued_prefill_tokens
            .saturating_add(self.pending_tokens)
    }
}

/// What a pick weighs besides the candidates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PickRule {
    pub policy: RoutingPolicy,
    /// kv-aware: the price of a missing prompt block, in free blocks.
    pub weight: f64,
    /// The prompt's KV blocks and tokens.
    pub prompt_blocks: u32,
    pub prompt_tokens: u64,
    /// Round robin: this pick's turn (a counter the caller advances).
    pub turn: usize,
}

impl PickRule {
    /// The load-only rule (what routing did before prefix caching; tests and fallbacks).
    pub fn load() -> Self {
        Self {
            policy: RoutingPolicy::Load,
            weight: 0.0,
            prompt_blocks: 0,
            prompt_tokens: 0,
            turn: 0,
        }
    }
}

/// The id that comes `turn`-th (cyclically) in id order.
fn in_turn(ids: impl Iterator<Item = usize>, turn: usize) -> Option<usize> {
    let mut ids: Vec<usize> = ids.collect();
    ids.sort_unstable();
    (!ids.is_empty()).then(|| ids[turn % ids.len()])
}

/// The decode worker for a request, by `rule` (see the module doc). Ties go to the fewest
/// running sequences, then (kv-aware) to the emptier cache, then to the lowest id, the oldest
/// worker (deterministic, so tests can rely on it).
pub fn pick_decode(candidates: &[DecodeCandidate], rule: &PickRule) -> Option<usize> {
    match rule.policy {
        RoutingPolicy::RoundRobin => in_turn(candidates.iter().map(|c| c.id), rule.turn),
        RoutingPolicy::Load => candidates
            .iter()
            .min_by_key(|c| {
                (
                    std::cmp::Reverse(c.effective_free()),
                    c.effective_running(),
                    c.id,
                )
            })
            .map(|c| c.id),
        RoutingPolicy::KvAware => {
            let score = |c: &DecodeCandidate| {
                let missing = rule.prompt_blocks.saturating_sub(c.cached_blocks);
                f64::from(c.effective_free()) - rule.weight * f64::from(missing)
            };
            for c in candidates {
                tracing::debug!(
                    worker = c.id,
                    free = c.effective_free(),
                    cached_blocks = c.cached_blocks,
                    prompt_blocks = rule.prompt_blocks,
                    weight = rule.weight,
                    score = score(c),
                    "decode candidate: score = free - weight * (prompt_blocks - cached_blocks)"
                );
            }
            candidates
                .iter()
                .max_by(|a, b| {
                    score(a)
                        .total_cmp(&score(b))
                        .then(b.effective_running().cmp(&a.effective_running()))
                        .then(b.cache_fill.cmp(&a.cache_fill))
                        .then(b.id.cmp(&a.id))
                })
                .map(|c| c.id)
        }
    }
}

/// The prefill worker for a request by `rule` (see the module doc), skipping `exclude`
/// (workers that already failed this request); ties go (kv-aware) to the emptier cache, then
/// to the lowest id.
pub fn pick_prefill(
    candidates: &[PrefillCandidate],
    exclude: &[usize],
    rule: &PickRule,
) -> Option<usize> {
    let open = candidates.iter().filter(|c| !exclude.contains(&c.id));
    match rule.policy {
        RoutingPolicy::RoundRobin => in_turn(open.map(|c| c.id), rule.turn),
        RoutingPolicy::Load => open
            .min_by_key(|c| (c.effective_queued(), c.id))
            .map(|c| c.id),
        RoutingPolicy::KvAware => {
            let cost = |c: &PrefillCandidate| {
                c.effective_queued()
                    .saturating_add(rule.prompt_tokens.saturating_sub(c.cached_tokens))
            };
            open.inspect(|c| {
                tracing::debug!(
                    worker = c.id,
                    queued = c.effective_queued(),
                    cached_tokens = c.cached_tokens,
                    prompt_tokens = rule.prompt_tokens,
                    cost = cost(c),
                    "prefill candidate: cost = queued + (prompt_tokens - cached_tokens)"
                );
            })
            .min_by_key(|c| (cost(c), c.cache_fill, c.id))
            .map(|c| c.id)
        }
    }
}

/// Why a request that wanted disaggregation ran aggregated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallbackReason {
    /// No healthy prefill worker compatible with the chosen decode worker.
    NoPrefillWorker,
    /// Prefill failed on every worker tried, before any token reached the client.
    PrefillFailed,
    /// The prompt ran, but its KV could not reach the decode worker (the link between the
    /// two failed or stalled past the lease): the decode worker, which the router still
    /// reaches, runs it itself.
    TransferFailed,
}

impl FallbackReason {
    /// The name used in responses and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            FallbackReason::NoPrefillWorker => "no_prefill_worker",
            FallbackReason::PrefillFailed => "prefill_failed",
            FallbackReason::TransferFailed => "transfer_failed",
        }
    }
}

/// How a request will run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModeDecision {
    /// Prefill on this prefill worker, decode on the chosen decode worker.
    Disaggregated { prefill: usize },
    /// The decode worker runs the prompt itself; `fallback` is set when this was not the
    /// first choice.
    Aggregated { fallback: Option<FallbackReason> },
    /// Disaggregation was needed and `--fallback error` forbids the alternative.
    Refuse,
}

/// The mode of a new request: prompts shorter than `agg_threshold` tokens, and every prompt
/// when no prefill worker is configured at all, run aggregated by design (no fallback);
/// otherwise disaggregated on `prefill` when there is one, else as `fallback` says.
pub fn decide_mode(
    prompt_len: usize,
    agg_threshold: u32,
    prefill_configured: bool,
    prefill: Option<usize>,
    fallback: FallbackPolicy,
) -> ModeDecision {
    if prompt_len < agg_threshold as usize || !prefill_configured {
        return ModeDecision::Aggregated { fallback: None };
    }
    match (prefill, fallback) {
        (Some(p), _) => ModeDecision::Disaggregated { prefill: p },
        (None, FallbackPolicy::Aggregated) => ModeDecision::Aggregated {
            fallback: Some(FallbackReason::NoPrefillWorker),
        },
        (None, FallbackPolicy::Error) => ModeDecision::Refuse,
    }
}

/// After a prefill failure (nothing sent to the client yet): one retry on another prefill
/// worker if `retry_allowed` and there is one, else aggregated if allowed, else refuse.
pub fn decide_after_prefill_failure(
    retry_allowed: bool,
    other_prefill: Option<usize>,
    fallback: FallbackPolicy,
) -> ModeDecision {
    match (retry_allowed, other_prefill, fallback) {
        (true, Some(p), _) => ModeDecision::Disaggregated { prefill: p },
        (_, _, FallbackPolicy::Aggregated) => ModeDecision::Aggregated {
            fallback: Some(FallbackReason::PrefillFailed),
        },
        (_, _, FallbackPolicy::Error) => ModeDecision::Refuse,
    }
}

/// KV blocks a prompt of `tokens` occupies with blocks of `block_size` tokens.
pub fn blocks_for_tokens(tokens: usize, block_size: u32) -> u32 {
    let block_size = block_size.max(1) as usize;
    u32::try_from(tokens.div_ceil(block_size)).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(id: usize, free: u32, running: u32) -> DecodeCandidate {
        DecodeCandidate {
            id,
            free_blocks: free,
            running,
            pending_blocks: 0,
            pending_requests: 0,
            cached_blocks: 0,
            cache_fill: 0,
        }
    }

    fn p(id: usize, queued: u64) -> PrefillCandidate {
        PrefillCandidate {
            id,
            queued_prefill_tokens: queued,
            pending_tokens: 0,
            cached_tokens: 0,
            cache_fill: 0,
        }
    }

    fn pick_decode(c: &[DecodeCandidate]) -> Option<usize> {
        super::pick_decode(c, &PickRule::load())
    }

    fn pick_prefill(c: &[PrefillCandidate], exclude: &[usize]) -> Option<usize> {
        super::pick_prefill(c, exclude, &PickRule::load())
    }

    fn kv_rule(prompt_blocks: u32, weight: f64) -> PickRule {
        PickRule {
            policy: RoutingPolicy::KvAware,
            weight,
            prompt_blocks,
            prompt_tokens: u64::from(prompt_blocks) * 16,
            turn: 0,
        }
    }

    #[test]
    fn kv_aware_decode_weighs_the_cached_prefix_against_free_blocks() {
        let mut a = d(0, 1_000, 0);
        let mut b = d(1, 900, 0);
        // Nothing cached: the freer worker, as by load.
        assert_eq!(super::pick_decode(&[a, b], &kv_rule(100, 2.0)), Some(0));
        // b holds 80 of the prompt's 100 blocks: 900 - 2×20 = 860 beats 1000 - 2×100 = 800.
        b.cached_blocks = 80;
        assert_eq!(super::pick_decode(&[a, b], &kv_rule(100, 2.0)), Some(1));
        // ... unless it is much busier.
        b.pending_blocks = 100;
        assert_eq!(super::pick_decode(&[a, b], &kv_rule(100, 2.0)), Some(0));
        // Weight 0 is load alone; equal scores go to the fewest running, then the lowest id.
        b.pending_blocks = 0;
        assert_eq!(super::pick_decode(&[a, b], &kv_rule(100, 0.0)), Some(0));
        a.free_blocks = 900;
        a.running = 2;
        b.cached_blocks = 0;
        assert_eq!(super::pick_decode(&[a, b], &kv_rule(100, 2.0)), Some(1));
        b.running = 2;
        assert_eq!(super::pick_decode(&[b, a], &kv_rule(100, 2.0)), Some(0));
    }

    #[test]
    fn kv_aware_prefill_counts_the_tokens_each_worker_must_compute() {
        let mut a = p(0, 100);
        let b = p(1, 0);
        assert_eq!(
            super::pick_prefill(&[a, b], &[], &kv_rule(10, 1.0)),
            Some(1)
        );
        // a holds the whole 160-token prompt but one block: 100 + 16 < 0 + 160.
        a.cached_tokens = 144;
        assert_eq!(
            super::pick_prefill(&[a, b], &[], &kv_rule(10, 1.0)),
            Some(0)
        );
        assert_eq!(
            super::pick_prefill(&[a, b], &[0], &kv_rule(10, 1.0)),
            Some(1)
        );
        // Between equals, a new prompt goes where the cache holds less.
        let (mut a, b) = (p(0, 0), p(1, 0));
        a.cache_fill = 40;
        assert_eq!(
            super::pick_prefill(&[a, b], &[], &kv_rule(10, 1.0)),
            Some(1)
        );
        let (mut a, b) = (d(0, 50, 0), d(1, 50, 0));
        a.cache_fill = 40;
        assert_eq!(super::pick_decode(&[a, b], &kv_rule(10, 2.0)), Some(1));
    }

    #[test]
    fn round_robin_takes_turns_in_id_order() {
        let rule = |turn| PickRule {
            policy: RoutingPolicy::RoundRobin,
            turn,
            ..PickRule::load()
        };
        let cands = [d(5, 0, 9), d(2, 100, 0)];
        let picks: Vec<_> = (0..4)
            .map(|t| super::pick_decode(&cands, &rule(t)))
            .collect();
        assert_eq!(picks, [Some(2), Some(5), Some(2), Some(5)]);
        let pre = [p(3, 0), p(1, 0), p(2, 0)];
        assert_eq!(super::pick_prefill(&pre, &[1], &rule(0)), Some(2));
        assert_eq!(super::pick_prefill(&pre, &[1], &rule(1)), Some(3));
        assert_eq!(super::pick_decode(&[], &rule(3)), None);
    }

    #[test]
    fn decode_most_free_blocks_then_fewest_running_then_index() {
        assert_eq!(pick_decode(&[]), None);
        assert_eq!(pick_decode(&[d(0, 10, 0), d(1, 20, 5)]), Some(1));
        assert_eq!(pick_decode(&[d(0, 20, 3), d(1, 20, 2)]), Some(1));
        assert_eq!(pick_decode(&[d(3, 20, 2), d(1, 20, 2)]), Some(1));
    }

    #[test]
    fn decode_counts_what_was_dispatched_since_the_report() {
        let mut a = d(0, 100, 0);
        let b = d(1, 90, 0);
        assert_eq!(pick_decode(&[a, b]), Some(0));
        a.pending_blocks = 20;
        assert_eq!(pick_decode(&[a, b]), Some(1));
        // Pending beyond the free count saturates at zero rather than wrapping.
        a.pending_blocks = 1_000;
        assert_eq!(a.effective_free(), 0);
        let mut c = d(2, 90, 0);
        c.pending_requests = 1;
        assert_eq!(pick_decode(&[c, b]), Some(1));
    }

    #[test]
    fn prefill_fewest_queued_tokens_with_exclusions() {
        assert_eq!(pick_prefill(&[], &[]), None);
        let cands = [p(0, 500), p(1, 100), p(2, 100)];
        assert_eq!(pick_prefill(&cands, &[]), Some(1));
        assert_eq!(pick_prefill(&cands, &[1]), Some(2));
        assert_eq!(pick_prefill(&cands, &[1, 2]), Some(0));
        assert_eq!(pick_prefill(&cands, &[0, 1, 2]), None);
        let mut busy = p(1, 100);
        busy.pending_tokens = 1_000;
        assert_eq!(pick_prefill(&[p(0, 500), busy], &[]), Some(0));
    }

    #[test]
    fn mode_threshold_and_fallback() {
        use FallbackPolicy::*;
        // Below the threshold: aggregated by design, not a fallback.
        assert_eq!(
            decide_mode(10, 11, true, Some(0), Aggregated),
            ModeDecision::Aggregated { fallback: None }
        );
        // At the threshold: disaggregated.
        assert_eq!(
            decide_mode(11, 11, true, Some(0), Aggregated),
            ModeDecision::Disaggregated { prefill: 0 }
        );
        assert_eq!(
            decide_mode(5, 0, true, Some(2), Error),
            ModeDecision::Disaggregated { prefill: 2 }
        );
        assert_eq!(
            decide_mode(5, 0, true, None, Aggregated),
            ModeDecision::Aggregated {
                fallback: Some(FallbackReason::NoPrefillWorker)
            }
        );
        assert_eq!(decide_mode(5, 0, true, None, Error), ModeDecision::Refuse);
        // No prefill worker configured: an aggregated deployment, whatever the policy.
        assert_eq!(
            decide_mode(5, 0, false, None, Error),
            ModeDecision::Aggregated { fallback: None }
        );
    }

    #[test]
    fn after_prefill_failure() {
        use FallbackPolicy::*;
        assert_eq!(
            decide_after_prefill_failure(true, Some(1), Error),
            ModeDecision::Disaggregated { prefill: 1 }
        );
        let agg = ModeDecision::Aggregated {
            fallback: Some(FallbackReason::PrefillFailed),
        };
        assert_eq!(
            decide_after_prefill_failure(false, Some(1), Aggregated),
            agg
        );
        assert_eq!(decide_after_prefill_failure(true, None, Aggregated), agg);
        assert_eq!(
            decide_after_prefill_failure(true, None, Error),
            ModeDecision::Refuse
        );
    }

    #[test]
    fn block_counts() {
        assert_eq!(blocks_for_tokens(0, 16), 0);
        assert_eq!(blocks_for_tokens(1, 16), 1);
        assert_eq!(blocks_for_tokens(16, 16), 1);
        assert_eq!(blocks_for_tokens(17, 16), 2);
        assert_eq!(blocks_for_tokens(5, 0), 5);
    }
}
