//! The decisions themselves: pick a decode worker by free KV blocks, a prefill worker by
//! queued prefill work, and the mode of a request (disaggregated, aggregated, or refused).
//!
//! Load reports are polled (every `--health-interval-ms`), so between two reports every
//! request would otherwise go to the same "best" worker. The router therefore adds what it
//! has itself dispatched since the last report (`pending_*`) to the reported load.

use crate::config::FallbackPolicy;

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
}

impl PrefillCandidate {
    fn effective_queued(&self) -> u64 {
        self.queued_prefill_tokens
            .saturating_add(self.pending_tokens)
    }
}

/// The decode worker with the most free KV blocks; ties go to the fewest running sequences,
/// then to the lowest id, the oldest worker (deterministic, so tests can rely on it).
pub fn pick_decode(candidates: &[DecodeCandidate]) -> Option<usize> {
    candidates
        .iter()
        .min_by_key(|c| {
            (
                std::cmp::Reverse(c.effective_free()),
                c.effective_running(),
                c.id,
            )
        })
        .map(|c| c.id)
}

/// The prefill worker with the fewest queued prefill tokens, skipping `exclude` (workers
/// that already failed this request); ties go to the lowest id.
pub fn pick_prefill(candidates: &[PrefillCandidate], exclude: &[usize]) -> Option<usize> {
    candidates
        .iter()
        .filter(|c| !exclude.contains(&c.id))
        .min_by_key(|c| (c.effective_queued(), c.id))
        .map(|c| c.id)
}

/// Why a request that wanted disaggregation ran aggregated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallbackReason {
    /// No healthy prefill worker compatible with the chosen decode worker.
    NoPrefillWorker,
    /// Prefill failed on every worker tried, before any token reached the client.
    PrefillFailed,
}

impl FallbackReason {
    /// The name used in responses and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            FallbackReason::NoPrefillWorker => "no_prefill_worker",
            FallbackReason::PrefillFailed => "prefill_failed",
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
        }
    }

    fn p(id: usize, queued: u64) -> PrefillCandidate {
        PrefillCandidate {
            id,
            queued_prefill_tokens: queued,
            pending_tokens: 0,
        }
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
