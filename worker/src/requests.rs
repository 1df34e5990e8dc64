//! What the workers' RPC handlers check and derive of a request besides the engine's
//! `validate_request`, before it reaches the engine: the prefill's one-token stop and where
//! its KV goes, the decode worker's prompt split, TPOT target and lease TTL. Here rather than
//! in each binary, so that the `grpc_handlers` fuzz target runs the handlers' own code.

use std::time::Duration;

use tandem_engine::{ModelConfig, SamplingParams, StopParams};
use tandem_proto::v1 as pb;

use crate::convert::stop_from_proto;
use crate::pacing::MAX_TPOT_TARGET;

/// The stop a prefill runs with: one output token (the first). The request's stop ids and EOS
/// matter only to keep them from being that token under `min_tokens`; the decode worker
/// applies the rest.
pub fn prefill_stop(asked: Option<&pb::StopParams>) -> StopParams {
    let stop = stop_from_proto(asked);
    StopParams {
        max_tokens: 1,
        ignore_eos: asked.is_none() || stop.ignore_eos,
        stop_token_ids: stop.stop_token_ids,
        min_tokens: stop.min_tokens.min(1),
        ..StopParams::default()
    }
}

/// Where a prefill's KV starts in the decode worker's lease: `(window_first, first_block)`.
/// The lease starts at `wanted_first` (the decode worker's prefix cache holds the blocks before
/// it) or where a sliding window starts (`window_first`), whichever is later; it holds at least
/// the block of the last prompt token, so a `wanted_first` past it is refused.
pub fn prefill_first_block(
    cfg: &ModelConfig,
    prompt_len: usize,
    wanted_first: u32,
) -> Result<(usize, usize), tonic::Status> {
    let window_first = cfg.first_needed_block(prompt_len);
    let wanted_first = wanted_first as usize;
    if wanted_first >= tandem_kv::blocks_for(prompt_len) {
        return Err(tonic::Status::invalid_argument(format!(
            "the KV destination starts at block {wanted_first}, past the prompt's last block"
        )));
    }
    Ok((window_first, window_first.max(wanted_first)))
}

/// Why the decode worker declines to split a prompt at `split` (see
/// `GenerateRequest.split_prompt_at`; 0 asks for no split): the split must fall on a block
/// boundary inside the prompt, and the model and the request must be able to resume there (no
/// sliding window, no prompt logprobs). `None`: it takes the split.
pub fn split_declined(
    cfg: &ModelConfig,
    prompt_len: usize,
    split: usize,
    sampling: &SamplingParams,
) -> Option<&'static str> {
    if !split.is_multiple_of(tandem_kv::BLOCK_SIZE) {
        Some("not on a block boundary")
    } else if split >= prompt_len {
        Some("not inside the prompt")
    } else if cfg.first_needed_block(prompt_len) > 0 {
        Some("the model attends through a window")
    } else if sampling.prompt_logprobs.is_some() {
        Some("the request asks for prompt logprobs")
    } else {
        None
    }
}

/// The TPOT a caller asks a lending worker to keep (`tpot_target_ms`, 0 for none): bounded,
/// since it sets how long the worker idles after each pass.
pub fn tpot_target(ms: u32) -> Option<Duration> {
    (ms > 0).then(|| Duration::from_millis(u64::from(ms)).min(MAX_TPOT_TARGET))
}

/// How long a reservation waits for its KV: what the caller asked (`lease_ttl_ms`, 0 for the
/// default), at most the configured maximum.
pub fn lease_ttl(asked_ms: u32, default: Duration, max: Duration) -> Duration {
    match asked_ms {
        0 => default,
        ms => Duration::from_millis(u64::from(ms)),
    }
    .min(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_and_split_checks() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let windowed = ModelConfig::preset("tiny-window").unwrap();
        let stop = prefill_stop(None);
        assert_eq!(
            (stop.max_tokens, stop.ignore_eos, stop.min_tokens),
            (1, true, 0)
        );
        let asked = pb::StopParams {
            min_tokens: 5,
            stop_token_ids: vec![9],
            ..Default::default()
        };
        let stop = prefill_stop(Some(&asked));
        assert_eq!((stop.ignore_eos, stop.min_tokens), (false, 1));
        assert_eq!(stop.stop_token_ids, [9]);
        assert_eq!(prefill_first_block(&cfg, 40, 2).unwrap(), (0, 2));
        assert!(prefill_first_block(&cfg, 40, 3).is_err());
        assert_eq!(prefill_first_block(&windowed, 100, 0).unwrap(), (3, 3));
        let greedy = SamplingParams::greedy();
        assert_eq!(split_declined(&cfg, 40, 32, &greedy), None);
        assert!(split_declined(&cfg, 40, 33, &greedy).is_some());
        assert!(split_declined(&cfg, 32, 32, &greedy).is_some());
        assert!(split_declined(&windowed, 100, 32, &greedy).is_some());
        assert_eq!(tpot_target(0), None);
        assert_eq!(tpot_target(u32::MAX), Some(MAX_TPOT_TARGET));
        let (d, m) = (Duration::from_secs(30), Duration::from_secs(60));
        assert_eq!(lease_ttl(0, d, m), d);
        assert_eq!(lease_ttl(u32::MAX, d, m), m);
    }
}
