//! File-backed datasets: `sharegpt` (JSON conversations), `sonnet` (poem lines), `custom`
//! (JSONL prompts) and `book` (any UTF-8 text cut into prompts; not in upstream vLLM, see
//! bench-spec §4).

use std::path::{Path, PathBuf};

use rand::seq::{IndexedRandom, SliceRandom};

use super::shared::{DatasetError, SampleRequest, SamplingOptions, oversample, read_text, rng};
use crate::tokenizer::BenchTokenizer;

fn malformed(path: &Path, message: impl Into<String>) -> DatasetError {
    DatasetError::Malformed {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// vLLM's `is_valid_sequence` with its defaults (4, 1024, 2048).
fn is_valid_sequence(prompt_len: usize, output_len: usize, skip_min_output_check: bool) -> bool {
    let prompt_too_short = prompt_len < 4;
    let output_too_short = !skip_min_output_check && output_len < 4;
    let prompt_too_long = prompt_len > 1024;
    let combined_too_long = prompt_len + output_len > 2048;
    !(prompt_too_short || output_too_short || prompt_too_long || combined_too_long)
}

/// ShareGPT: first turn as prompt, second turn's length as output length.
pub(super) fn sample_sharegpt(
    path: &Path,
    output_len: Option<usize>,
    tokenizer: &BenchTokenizer,
    num_requests: usize,
    options: SamplingOptions,
) -> Result<Vec<SampleRequest>, DatasetError> {
    let data: serde_json::Value =
        serde_json::from_str(&read_text(path)?).map_err(|e| malformed(path, e.to_string()))?;
    let entries = data
        .as_array()
        .ok_or_else(|| malformed(path, "expected a JSON list of conversations"))?;
    let mut pairs: Vec<(&str, &str)> = entries
        .iter()
        .filter_map(|entry| {
            let turns = entry.get("conversations")?.as_array()?;
            if turns.len() < 2 {
                return None;
            }
            Some((
                turns[0].get("value")?.as_str()?,
                turns[1].get("value")?.as_str()?,
            ))
        })
        .collect();
    if options.shuffle {
        pairs.shuffle(&mut rng(options.seed));
    }
    let mut requests = Vec::new();
    for (prompt, completion) in pairs {
        if requests.len() >= num_requests {
            break;
        }
        let prompt_len = tokenizer.count(prompt, true)?;
        let new_output_len = match output_len {
            Some(n) => n,
            None => tokenizer.count(completion, true)?,
        };
        if !is_valid_sequence(prompt_len, new_output_len, output_len.is_some()) {
            continue;
        }
        requests.push(SampleRequest {
            prompt: prompt.to_string(),
            prompt_len,
            expected_output_len: new_output_len,
        });
    }
    oversample(&mut requests, num_requests, options);
    Ok(requests)
}

/// `--sonnet-input-len`, `--sonnet-output-len`, `--sonnet-prefix-len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct SonnetLengths {
    pub input_len: usize,
    pub output_len: usize,
    pub prefix_len: usize,
}

/// The chat-templated prompt, or the prompt itself when the tokenizer has no template.
fn templated(tokenizer: &BenchTokenizer, prompt: &str) -> Result<String, DatasetError> {
    Ok(tokenizer
        .apply_chat_template(prompt)?
        .unwrap_or_else(|| prompt.to_string()))
}

/// Sonnet: a fixed instruction, a fixed block of prefix lines, then lines drawn at random.
/// Lengths are measured on the chat-templated prompt.
pub(super) fn sample_sonnet(
    path: &Path,
    lengths: SonnetLengths,
    send_formatted: bool,
    tokenizer: &BenchTokenizer,
    num_requests: usize,
    seed: u64,
) -> Result<Vec<SampleRequest>, DatasetError> {
    let SonnetLengths {
        input_len,
        output_len,
        prefix_len,
    } = lengths;
    let text = read_text(path)?;
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    if lines.is_empty() {
        return Err(malformed(path, "no lines"));
    }
    let mut total = 0usize;
    for line in &lines {
        total += tokenizer.count(line, true)?;
    }
    let avg_len = total as f64 / lines.len() as f64;
    let base_prompt = "Pick as many lines as you can from these poem lines:\n";
    let base_offset = tokenizer.count(&templated(tokenizer, base_prompt)?, true)?;
    if input_len <= base_offset {
        return Err(DatasetError::Invalid(format!(
            "'input_len' must be higher than the base prompt length ({base_offset})."
        )));
    }
    let num_input_lines = ((input_len - base_offset) as f64 / avg_len).round() as usize;
    let num_prefix_lines = ((prefix_len as f64 - base_offset as f64) / avg_len)
        .round()
        .max(0.0) as usize;
    let prefix: String = lines.iter().take(num_prefix_lines).copied().collect();
    let mut rng = rng(seed);
    let mut requests = Vec::with_capacity(num_requests);
    // Upstream loops until enough prompts fit; bound it so a bad input cannot hang the run.
    let max_attempts = num_requests.saturating_mul(100).max(1000);
    for _ in 0..max_attempts {
        if requests.len() >= num_requests {
            break;
        }
        let mut prompt = format!("{base_prompt}{prefix}");
        for _ in 0..num_input_lines.saturating_sub(num_prefix_lines) {
            if let Some(line) = lines.choose(&mut rng) {
                prompt.push_str(line);
            }
        }
        let formatted = templated(tokenizer, &prompt)?;
        let prompt_len = tokenizer.count(&formatted, true)?;
        if prompt_len <= input_len {
            requests.push(SampleRequest {
                prompt: if send_formatted { formatted } else { prompt },
                prompt_len,
                expected_output_len: output_len,
            });
        }
    }
    if requests.len() < num_requests {
        return Err(DatasetError::Invalid(format!(
            "sonnet: only {} of {num_requests} prompts fit in {input_len} tokens",
            requests.len()
        )));
    }
    Ok(requests)
}

/// Custom: one `{"prompt": ...}` object per line.
pub(super) fn sample_custom(
    path: &Path,
    output_len: usize,
    chat_template: bool,
    tokenizer: &BenchTokenizer,
    num_requests: usize,
    options: SamplingOptions,
) -> Result<Vec<SampleRequest>, DatasetError> {
    let text = read_text(path)?;
    let mut prompts = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| malformed(path, format!("line {}: {e}", index + 1)))?;
        let prompt = value
            .get("prompt")
            .and_then(|p| p.as_str())
            .ok_or_else(|| malformed(path, "JSONL file must contain a 'prompt' column."))?;
        prompts.push(prompt.to_string());
    }
    if options.shuffle {
        prompts.shuffle(&mut rng(options.seed));
    }
    let mut requests = Vec::new();
    for prompt in prompts.into_iter().take(num_requests) {
        let prompt = if chat_template {
            templated(tokenizer, &prompt)?
        } else {
            prompt
        };
        let prompt_len = tokenizer.count(&prompt, true)?;
        requests.push(SampleRequest {
            prompt,
            prompt_len,
            expected_output_len: output_len,
        });
    }
    oversample(&mut requests, num_requests, options);
    Ok(requests)
}

/// How `book` cuts the text into prompts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum BookSplit {
    /// Consecutive, non-overlapping windows of `--book-input-len` tokens.
    #[default]
    Tokens,
    /// One prompt per non-empty line, cut to at most `--book-input-len` tokens.
    Lines,
}

/// What `book` does when `--num-prompts` exceeds the number of prompts in the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum BookOverflow {
    /// Send only the prompts there are, with a warning (reproduces seed 003's 2537 of 4096).
    #[default]
    Cap,
    /// Start again from the first prompt.
    Wrap,
}

/// `--dataset-name book` options.
#[derive(Debug, Clone, PartialEq)]
pub struct BookConfig {
    pub path: PathBuf,
    pub input_len: usize,
    pub output_len: usize,
    pub split: BookSplit,
    pub overflow: BookOverflow,
}

/// Cuts `text` into prompt texts: token windows, or lines cut to at most `input_len` tokens.
pub fn split_book(
    text: &str,
    input_len: usize,
    split: BookSplit,
    tokenizer: &BenchTokenizer,
) -> Result<Vec<String>, DatasetError> {
    if input_len == 0 {
        return Err(DatasetError::Invalid(
            "--book-input-len must be at least 1".into(),
        ));
    }
    match split {
        BookSplit::Tokens => {
            let ids = tokenizer.encode(text, false)?;
            if ids.is_empty() {
                return Ok(Vec::new());
            }
            // Full windows only, so every prompt is N tokens; a text shorter than N is one prompt.
            let windows: Vec<&[u32]> = if ids.len() < input_len {
                vec![&ids[..]]
            } else {
                ids.chunks_exact(input_len).collect()
            };
            windows
                .into_iter()
                .map(|window| tokenizer.decode(window).map_err(DatasetError::from))
                .collect()
        }
        BookSplit::Lines => text
            .lines()
            .map(str::trim)
            .filter(|line| !line.is_empty())
            .map(|line| {
                let ids = tokenizer.encode(line, false)?;
                if ids.len() <= input_len {
                    Ok(line.to_string())
                } else {
                    Ok(tokenizer.decode(&ids[..input_len])?)
                }
            })
            .collect(),
    }
}

/// The `book` dataset: prompts in text order, `prompt_len` re-tokenized with special tokens.
pub fn sample_book(
    text: &str,
    config: &BookConfig,
    tokenizer: &BenchTokenizer,
    num_requests: usize,
) -> Result<Vec<SampleRequest>, DatasetError> {
    let prompts = split_book(text, config.input_len, config.split, tokenizer)?;
    if prompts.is_empty() {
        return Err(malformed(&config.path, "the text holds no prompt"));
    }
    let count = match config.overflow {
        BookOverflow::Wrap => num_requests,
        BookOverflow::Cap => {
            if num_requests > prompts.len() {
                tracing::warn!(
                    available = prompts.len(),
                    requested = num_requests,
                    "book has fewer prompts than --num-prompts; sending only those (--book-overflow wrap repeats them)"
                );
            }
            num_requests.min(prompts.len())
        }
    };
    prompts
        .iter()
        .cycle()
        .take(count)
        .map(|prompt| {
            Ok(SampleRequest {
                prompt: prompt.clone(),
                prompt_len: tokenizer.count(prompt, true)?,
                expected_output_len: config.output_len,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::word_level_tokenizer;

    fn words(range: std::ops::Range<usize>) -> String {
        range
            .map(|i| format!("w{}", i % 200))
            .collect::<Vec<_>>()
            .join(" ")
    }

    fn book(path: &Path, input_len: usize, split: BookSplit, overflow: BookOverflow) -> BookConfig {
        BookConfig {
            path: path.to_path_buf(),
            input_len,
            output_len: 7,
            split,
            overflow,
        }
    }

    #[test]
    fn book_cuts_consecutive_windows() {
        let tok = word_level_tokenizer(200).unwrap();
        let text = words(0..1050);
        let prompts = split_book(&text, 100, BookSplit::Tokens, &tok).unwrap();
        assert_eq!(prompts.len(), 10);
        for (k, prompt) in prompts.iter().enumerate() {
            assert_eq!(prompt, &words(k * 100..(k + 1) * 100));
        }
        // The windows are the text, in order, without overlap.
        assert_eq!(prompts.join(" "), words(0..1000));
    }

    #[test]
    fn book_requests_count_bos_and_cap_or_wrap() {
        let tok = word_level_tokenizer(200).unwrap();
        let text = words(0..350);
        let path = Path::new("book.txt");
        let capped = sample_book(
            &text,
            &book(path, 100, BookSplit::Tokens, BookOverflow::Cap),
            &tok,
            5,
        )
        .unwrap();
        assert_eq!(capped.len(), 3);
        assert!(
            capped
                .iter()
                .all(|r| r.prompt_len == 101 && r.expected_output_len == 7)
        );
        let wrapped = sample_book(
            &text,
            &book(path, 100, BookSplit::Tokens, BookOverflow::Wrap),
            &tok,
            5,
        )
        .unwrap();
        assert_eq!(wrapped.len(), 5);
        assert_eq!(wrapped[3].prompt, wrapped[0].prompt);
        let short = sample_book(
            "w1 w2",
            &book(path, 100, BookSplit::Tokens, BookOverflow::Cap),
            &tok,
            2,
        )
        .unwrap();
        assert_eq!(short.len(), 1);
        assert_eq!(short[0].prompt_len, 3);
    }

    #[test]
    fn book_lines_are_capped_at_input_len() {
        let tok = word_level_tokenizer(200).unwrap();
        let text = format!(
            "{}\n\n{}\n   \n{}\n",
            words(0..80),
            words(0..5),
            words(10..20)
        );
        let prompts = split_book(&text, 50, BookSplit::Lines, &tok).unwrap();
        assert_eq!(prompts, vec![words(0..50), words(0..5), words(10..20)]);
    }

    #[test]
    fn sharegpt_filters_and_counts_with_bos() {
        let tok = word_level_tokenizer(200).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sharegpt.json");
        let conv = |p: &str, c: &str| serde_json::json!({"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": c}]});
        let data = serde_json::json!([
            conv(&words(0..10), &words(0..20)),
            conv("w1 w2", &words(0..20)),      // prompt too short (3 with BOS)
            conv(&words(0..10), "w1"),         // output too short
            {"conversations": [{"from": "human", "value": "w1"}]}, // one turn
            conv(&words(0..1500), &words(0..20)), // prompt too long
        ]);
        std::fs::write(&path, data.to_string()).unwrap();
        let options = SamplingOptions {
            seed: 0,
            shuffle: true,
            oversample: false,
        };
        let requests = sample_sharegpt(&path, None, &tok, 10, options).unwrap();
        assert_eq!(requests.len(), 1);
        assert_eq!(
            (requests[0].prompt_len, requests[0].expected_output_len),
            (11, 21)
        );
        // A fixed output length skips the output check; oversampling repeats samples.
        let options = SamplingOptions {
            oversample: true,
            ..options
        };
        let requests = sample_sharegpt(&path, Some(3), &tok, 4, options).unwrap();
        assert_eq!(requests.len(), 4);
        assert!(requests.iter().all(|r| r.expected_output_len == 3));
    }

    #[test]
    fn custom_reads_jsonl_prompts() {
        let tok = word_level_tokenizer(200).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("custom.jsonl");
        std::fs::write(
            &path,
            "{\"prompt\": \"w1 w2 w3\"}\n\n{\"prompt\": \"w4\"}\n",
        )
        .unwrap();
        let options = SamplingOptions {
            seed: 0,
            shuffle: false,
            oversample: true,
        };
        let requests = sample_custom(&path, 9, true, &tok, 2, options).unwrap();
        assert_eq!(requests[0].prompt, "w1 w2 w3");
        assert_eq!(requests[0].prompt_len, 4);
        assert_eq!(requests[1].expected_output_len, 9);
        std::fs::write(&path, "{\"text\": \"x\"}\n").unwrap();
        assert!(sample_custom(&path, 9, false, &tok, 2, options).is_err());
    }

    #[test]
    fn sonnet_prompts_fit_the_input_length() {
        let tok = word_level_tokenizer(200).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sonnet.txt");
        let poem: String = (0..40).map(|i| format!("{}\n", words(i..i + 5))).collect();
        std::fs::write(&path, poem).unwrap();
        let lengths = SonnetLengths {
            input_len: 60,
            output_len: 20,
            prefix_len: 30,
        };
        let requests = sample_sonnet(&path, lengths, true, &tok, 5, 0).unwrap();
        assert_eq!(requests.len(), 5);
        for r in &requests {
            assert!(
                r.prompt
                    .starts_with("Pick as many lines as you can from these poem lines:\n")
            );
            assert!(r.prompt_len <= 60);
            assert_eq!(r.expected_output_len, 20);
        }
    }
}
