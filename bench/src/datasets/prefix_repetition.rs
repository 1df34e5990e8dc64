//! vLLM's `prefix_repetition` dataset (`PrefixRepetitionRandomDataset`): `num_prefixes`
//! random-token prefixes, each shared by an even share of the requests, every request then
//! adding its own random suffix. It measures prefix caching: all requests of a prefix after
//! the first can reuse its KV.
//!
//! Prefix and suffix ids go through the same decode/re-encode loop as the `random` dataset,
//! so each part really is `prefix_len` / `suffix_len` tokens, and `prompt_len` is the count
//! of the final prompt re-encoded. One deliberate difference from vLLM: vLLM sends
//! `num_prefixes × ⌊N / num_prefixes⌋` requests, dropping the remainder; here the remainder
//! goes one each to the first prefixes, so a run sends exactly `--num-prompts` requests.

use rand::seq::SliceRandom;

use super::random::{allowed_ids, random_token_ids};
use super::shared::{DatasetError, SampleRequest, rng};
use crate::tokenizer::BenchTokenizer;

/// `--prefix-repetition-prefix-len`, `-suffix-len`, `-num-prefixes`, `-output-len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixRepetitionConfig {
    pub prefix_len: usize,
    pub suffix_len: usize,
    pub num_prefixes: usize,
    pub output_len: usize,
}

impl Default for PrefixRepetitionConfig {
    /// vLLM's defaults.
    fn default() -> Self {
        Self {
            prefix_len: 256,
            suffix_len: 256,
            num_prefixes: 10,
            output_len: 128,
        }
    }
}

/// Draws `num_requests` prompts over `config.num_prefixes` shared prefixes, shuffled by
/// `seed` unless `shuffle` is off (`--disable-shuffle`).
pub fn sample_prefix_repetition(
    config: &PrefixRepetitionConfig,
    tokenizer: &BenchTokenizer,
    num_requests: usize,
    seed: u64,
    shuffle: bool,
) -> Result<Vec<SampleRequest>, DatasetError> {
    if config.num_prefixes == 0 {
        return Err(DatasetError::Invalid(
            "--prefix-repetition-num-prefixes must be at least 1".into(),
        ));
    }
    if num_requests < config.num_prefixes {
        return Err(DatasetError::Invalid(format!(
            "num_requests ({num_requests}) must be greater than or equal to num_prefixes ({})",
            config.num_prefixes
        )));
    }
    if config.prefix_len + config.suffix_len == 0 {
        return Err(DatasetError::Invalid(
            "--prefix-repetition-prefix-len and --prefix-repetition-suffix-len are both 0: \
             prompts would be empty"
                .into(),
        ));
    }
    if config.output_len == 0 {
        return Err(DatasetError::Invalid(
            "--prefix-repetition-output-len must be at least 1".into(),
        ));
    }
    let allowed = allowed_ids(tokenizer)?;
    let mut rng = rng(seed);
    let per_prefix = num_requests / config.num_prefixes;
    let remainder = num_requests % config.num_prefixes;
    let mut requests = Vec::with_capacity(num_requests);
    let mut mismatched = 0i64;
    for prefix_index in 0..config.num_prefixes {
        let (prefix, mismatch) =
            random_token_ids(tokenizer, &allowed, config.prefix_len, &mut rng)?;
        mismatched += mismatch;
        let share = per_prefix + usize::from(prefix_index < remainder);
        for _ in 0..share {
            let (suffix, mismatch) =
                random_token_ids(tokenizer, &allowed, config.suffix_len, &mut rng)?;
            mismatched += mismatch;
            let mut ids = prefix.clone();
            ids.extend_from_slice(&suffix);
            let prompt = tokenizer.decode(&ids)?;
            // The real count: a tokenizer may merge across the prefix/suffix boundary.
            let prompt_len = tokenizer.count(&prompt, false)?;
            requests.push(SampleRequest {
                prompt,
                prompt_len,
                expected_output_len: config.output_len,
            });
        }
    }
    if mismatched != 0 {
        tracing::warn!(
            mismatched,
            "prefix/suffix parts did not all re-tokenize to their target length"
        );
    }
    if shuffle {
        requests.shuffle(&mut rng);
    }
    Ok(requests)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::tokenizer::word_level_tokenizer;

    fn config(prefix_len: usize, suffix_len: usize, num_prefixes: usize) -> PrefixRepetitionConfig {
        PrefixRepetitionConfig {
            prefix_len,
            suffix_len,
            num_prefixes,
            output_len: 7,
        }
    }

    /// Requests grouped by their first `prefix_len` words (the word-level test tokenizer
    /// decodes to space-separated words, one per token).
    fn groups(requests: &[SampleRequest], prefix_len: usize) -> BTreeMap<String, Vec<String>> {
        let mut groups: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for r in requests {
            let words: Vec<&str> = r.prompt.split(' ').collect();
            groups
                .entry(words[..prefix_len].join(" "))
                .or_default()
                .push(words[prefix_len..].join(" "));
        }
        groups
    }

    #[test]
    fn each_prefix_is_shared_by_its_share_of_requests() {
        let tok = word_level_tokenizer(500).unwrap();
        let requests = sample_prefix_repetition(&config(12, 5, 4), &tok, 20, 0, true).unwrap();
        assert_eq!(requests.len(), 20);
        for r in &requests {
            assert_eq!(r.prompt_len, 17);
            assert_eq!(tok.count(&r.prompt, false).unwrap(), 17);
            assert_eq!(r.expected_output_len, 7);
            assert!(!r.prompt.contains('<'), "no special tokens: {}", r.prompt);
        }
        let groups = groups(&requests, 12);
        assert_eq!(groups.len(), 4, "four distinct prefixes");
        for suffixes in groups.values() {
            assert_eq!(suffixes.len(), 5);
            let distinct: std::collections::BTreeSet<_> = suffixes.iter().collect();
            assert_eq!(distinct.len(), 5, "suffixes are each request's own");
        }
    }

    #[test]
    fn the_remainder_goes_to_the_first_prefixes() {
        let tok = word_level_tokenizer(500).unwrap();
        let requests = sample_prefix_repetition(&config(8, 3, 3), &tok, 11, 1, false).unwrap();
        assert_eq!(requests.len(), 11);
        let sizes: Vec<usize> = {
            // Unshuffled: requests come prefix by prefix.
            let mut sizes = Vec::new();
            let mut last = None;
            for r in &requests {
                let prefix: Vec<&str> = r.prompt.split(' ').take(8).collect();
                if last.as_ref() != Some(&prefix) {
                    sizes.push(0);
                    last = Some(prefix);
                }
                if let Some(n) = sizes.last_mut() {
                    *n += 1;
                }
            }
            sizes
        };
        assert_eq!(sizes, vec![4, 4, 3]);
    }

    #[test]
    fn deterministic_for_a_seed_and_shuffled() {
        let tok = word_level_tokenizer(500).unwrap();
        let c = config(6, 6, 2);
        let a = sample_prefix_repetition(&c, &tok, 10, 3, true).unwrap();
        assert_eq!(a, sample_prefix_repetition(&c, &tok, 10, 3, true).unwrap());
        assert_ne!(a, sample_prefix_repetition(&c, &tok, 10, 4, true).unwrap());
        let ordered = sample_prefix_repetition(&c, &tok, 10, 3, false).unwrap();
        assert_ne!(a, ordered, "the seed shuffles the order");
        let mut sorted_a: Vec<_> = a.iter().map(|r| r.prompt.clone()).collect();
        let mut sorted_o: Vec<_> = ordered.iter().map(|r| r.prompt.clone()).collect();
        sorted_a.sort();
        sorted_o.sort();
        assert_eq!(sorted_a, sorted_o, "same prompts, other order");
    }

    #[test]
    fn prefix_only_or_suffix_only_prompts() {
        let tok = word_level_tokenizer(500).unwrap();
        let same = sample_prefix_repetition(&config(9, 0, 1), &tok, 3, 0, true).unwrap();
        assert!(
            same.iter()
                .all(|r| r.prompt == same[0].prompt && r.prompt_len == 9)
        );
        let own = sample_prefix_repetition(&config(0, 4, 2), &tok, 4, 0, true).unwrap();
        assert!(own.iter().all(|r| r.prompt_len == 4));
    }

    #[test]
    fn bad_settings_are_refused() {
        let tok = word_level_tokenizer(500).unwrap();
        let err = sample_prefix_repetition(&config(4, 4, 10), &tok, 9, 0, true).unwrap_err();
        assert!(err.to_string().contains("num_prefixes (10)"), "{err}");
        assert!(sample_prefix_repetition(&config(4, 4, 0), &tok, 9, 0, true).is_err());
        assert!(sample_prefix_repetition(&config(0, 0, 1), &tok, 9, 0, true).is_err());
        let no_output = PrefixRepetitionConfig {
            output_len: 0,
            ..config(4, 4, 1)
        };
        assert!(sample_prefix_repetition(&no_output, &tok, 9, 0, true).is_err());
    }
}
