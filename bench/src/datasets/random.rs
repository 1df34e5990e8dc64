//! vLLM's `random` dataset, third generation (0.11+, the reference): lengths drawn uniformly
//! around the targets, prompt ids cycling through the vocabulary minus special ids, then a
//! decode/re-encode loop so that `prompt_len` is what the tokenizer really gives.

use rand::Rng;
use rand::rngs::StdRng;

use super::shared::{DatasetError, SampleRequest, rng};
use crate::tokenizer::BenchTokenizer;

/// `--random-input-len`, `--random-output-len`, `--random-range-ratio`, `--random-prefix-len`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RandomConfig {
    pub input_len: usize,
    pub output_len: usize,
    pub range_ratio: f64,
    pub prefix_len: usize,
}

impl Default for RandomConfig {
    fn default() -> Self {
        Self {
            input_len: 1024,
            output_len: 128,
            range_ratio: 0.0,
            prefix_len: 0,
        }
    }
}

/// Draws `num_requests` random-token prompts.
pub fn sample_random(
    config: &RandomConfig,
    tokenizer: &BenchTokenizer,
    num_requests: usize,
    seed: u64,
) -> Result<Vec<SampleRequest>, DatasetError> {
    let ratio = config.range_ratio;
    if !(0.0..1.0).contains(&ratio) {
        return Err(DatasetError::Invalid(
            "range_ratio must be in [0, 1).".into(),
        ));
    }
    let num_special = tokenizer.num_special_tokens();
    let real_input_len = config.input_len.saturating_sub(num_special);
    let input_low = (real_input_len as f64 * (1.0 - ratio)).floor() as usize;
    let input_high = (real_input_len as f64 * (1.0 + ratio)).ceil() as usize;
    let output_low = ((config.output_len as f64 * (1.0 - ratio)).floor() as usize).max(1);
    let output_high = ((config.output_len as f64 * (1.0 + ratio)).ceil() as usize).max(1);
    if config.prefix_len + input_low < 1 {
        return Err(DatasetError::Invalid(format!(
            "--random-input-len is too small: with tokenizer special tokens {num_special} and \
             --random-range-ratio {ratio}, the minimum possible total input tokens (prefix + \
             sampled) is {}. Increase --random-input-len and/or --random-prefix-len, or \
             decrease --random-range-ratio.",
            config.prefix_len + input_low
        )));
    }
    let vocab_size = tokenizer.vocab_size();
    let allowed = allowed_ids(tokenizer)?;
    tracing::info!(
        "Sampling input_len from [{input_low}, {input_high}] and output_len from [{output_low}, {output_high}]"
    );
    let mut rng = rng(seed);
    let input_lens: Vec<usize> = (0..num_requests)
        .map(|_| rng.random_range(input_low..=input_high))
        .collect();
    let output_lens: Vec<usize> = (0..num_requests)
        .map(|_| rng.random_range(output_low..=output_high))
        .collect();
    let offsets: Vec<usize> = (0..num_requests)
        .map(|_| rng.random_range(0..vocab_size.max(1)))
        .collect();
    let prefix: Vec<u32> = (0..config.prefix_len)
        .map(|_| allowed[rng.random_range(0..allowed.len())])
        .collect();
    let mut requests = Vec::with_capacity(num_requests);
    let mut mismatched = 0i64;
    for i in 0..num_requests {
        let mut ids = prefix.clone();
        ids.extend((0..input_lens[i]).map(|k| allowed[(offsets[i] + i + k) % allowed.len()]));
        let target = config.prefix_len + input_lens[i];
        let (prompt, final_ids, mismatch) = decode_to_target_len(tokenizer, ids, target, &mut rng)?;
        mismatched += mismatch;
        requests.push(SampleRequest {
            prompt,
            prompt_len: final_ids.len(),
            expected_output_len: output_lens[i],
        });
    }
    if mismatched != 0 {
        tracing::warn!(
            mismatched,
            "random prompts did not all re-tokenize to their target length"
        );
    }
    Ok(requests)
}

/// The vocabulary minus the special ids: random prompts never contain a BOS or EOS, which a
/// server would otherwise re-encode as a control token.
pub(crate) fn allowed_ids(tokenizer: &BenchTokenizer) -> Result<Vec<u32>, DatasetError> {
    let allowed: Vec<u32> = (0..tokenizer.vocab_size() as u32)
        .filter(|id| tokenizer.special_ids().binary_search(id).is_err())
        .collect();
    if allowed.is_empty() {
        return Err(DatasetError::Invalid(
            "tokenizer has no non-special tokens".into(),
        ));
    }
    Ok(allowed)
}

/// Random ids drawn from `allowed`, adjusted so that their text re-encodes to `len` tokens.
/// Returns the ids after the adjustment and how far off the length stayed (0 when exact).
pub(crate) fn random_token_ids(
    tokenizer: &BenchTokenizer,
    allowed: &[u32],
    len: usize,
    rng: &mut StdRng,
) -> Result<(Vec<u32>, i64), DatasetError> {
    if allowed.is_empty() {
        return Err(DatasetError::Invalid(
            "tokenizer has no non-special tokens".into(),
        ));
    }
    let ids: Vec<u32> = (0..len)
        .map(|_| allowed[rng.random_range(0..allowed.len())])
        .collect();
    let (_, ids, mismatch) = decode_to_target_len(tokenizer, ids, len, rng)?;
    Ok((ids, mismatch))
}

/// vLLM's `gen_prompt_decode_to_target_len`: decode, re-encode, then truncate or extend with
/// random ids, up to 10 times, until the re-encoded prompt has `target` tokens.
fn decode_to_target_len(
    tokenizer: &BenchTokenizer,
    mut ids: Vec<u32>,
    target: usize,
    rng: &mut StdRng,
) -> Result<(String, Vec<u32>, i64), DatasetError> {
    let mut tries_left = 10;
    loop {
        let prompt = tokenizer.decode(&ids)?;
        ids = tokenizer.encode(&prompt, false)?;
        if tries_left == 0 || ids.len() == target {
            let mismatch = ids.len() as i64 - target as i64;
            return Ok((prompt, ids, mismatch));
        }
        if ids.len() < target {
            let vocab = tokenizer.vocab_size().max(1) as u32;
            let missing = target - ids.len();
            ids.extend((0..missing).map(|_| rng.random_range(0..vocab)));
        } else {
            ids.truncate(target);
        }
        tries_left -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::word_level_tokenizer;

    #[test]
    fn fixed_lengths_subtract_the_bos_token_like_seed_002() {
        // Seed 002: --random-input-len 8192 with one BOS gives 8191-token prompts.
        let tok = word_level_tokenizer(500).unwrap();
        let config = RandomConfig {
            input_len: 64,
            output_len: 16,
            ..Default::default()
        };
        let requests = sample_random(&config, &tok, 8, 0).unwrap();
        assert_eq!(requests.len(), 8);
        for r in &requests {
            assert_eq!(r.prompt_len, 63);
            assert_eq!(tok.count(&r.prompt, false).unwrap(), 63);
            assert_eq!(r.expected_output_len, 16);
        }
        // Prompts differ (offsets and index shift the cycle) and are reproducible.
        assert_ne!(requests[0].prompt, requests[1].prompt);
        assert_eq!(requests, sample_random(&config, &tok, 8, 0).unwrap());
        assert_ne!(requests, sample_random(&config, &tok, 8, 1).unwrap());
    }

    #[test]
    fn range_ratio_bounds_lengths_and_prefix_is_shared() {
        let tok = word_level_tokenizer(500).unwrap();
        let config = RandomConfig {
            input_len: 101,
            output_len: 10,
            range_ratio: 0.5,
            prefix_len: 5,
        };
        let requests = sample_random(&config, &tok, 200, 7).unwrap();
        let prefix: Vec<&str> = requests[0].prompt.split(' ').take(5).collect();
        for r in &requests {
            // real input 100 -> [50, 150], plus the 5-token prefix.
            assert!((55..=155).contains(&r.prompt_len), "{}", r.prompt_len);
            assert!((5..=15).contains(&r.expected_output_len));
            assert_eq!(r.prompt.split(' ').take(5).collect::<Vec<_>>(), prefix);
        }
        let lens: std::collections::BTreeSet<_> = requests.iter().map(|r| r.prompt_len).collect();
        assert!(lens.len() > 20, "lengths should spread over the range");
    }

    #[test]
    fn special_tokens_never_appear_and_bad_ratios_are_refused() {
        let tok = word_level_tokenizer(50).unwrap();
        let config = RandomConfig {
            input_len: 40,
            output_len: 1,
            ..Default::default()
        };
        for r in sample_random(&config, &tok, 20, 3).unwrap() {
            assert!(!r.prompt.contains('<'), "{}", r.prompt);
        }
        let bad = RandomConfig {
            range_ratio: 1.0,
            ..config
        };
        assert!(sample_random(&bad, &tok, 1, 0).is_err());
        let too_short = RandomConfig {
            input_len: 1,
            ..config
        };
        assert!(sample_random(&too_short, &tok, 1, 0).is_err());
        // One token beyond the BOS gives one-token prompts (the decode preset).
        let one = RandomConfig {
            input_len: 2,
            ..config
        };
        assert!(
            sample_random(&one, &tok, 5, 0)
                .unwrap()
                .iter()
                .all(|r| r.prompt_len == 1)
        );
    }
}
