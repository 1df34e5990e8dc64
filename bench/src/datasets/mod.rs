//! Request workloads: vLLM's `random`, `prefix_repetition`, `sharegpt`, `sonnet` and `custom`
//! datasets (`vllm/benchmarks/datasets.py`, 0.13.0), plus the `book` dataset the seeds used.
//!
//! Every generator is deterministic for a given `--seed`. Byte-exact copies of Python's and
//! numpy's random streams are not a goal (bench-spec §3.1); the distributions are the same.
//! `sonnet` and `custom` apply the tokenizer's chat template when it has one (an HF folder
//! with `tokenizer_config.json`); without one they use the raw prompt.

mod prefix_repetition;
mod random;
mod text;

use std::path::PathBuf;

use rand::SeedableRng;
use rand::rngs::StdRng;

pub use prefix_repetition::{PrefixRepetitionConfig, sample_prefix_repetition};
pub use random::{RandomConfig, sample_random};
pub(crate) use random::{allowed_ids, random_token_ids};
pub use text::{BookConfig, BookOverflow, BookSplit, sample_book, split_book};

use crate::tokenizer::{BenchTokenizer, TokenizerError};

/// One request to send, as vLLM's `SampleRequest`.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleRequest {
    pub prompt: String,
    /// The client-side token count reported as `Total input tokens`.
    pub prompt_len: usize,
    /// `max_tokens` sent to the server.
    pub expected_output_len: usize,
}

/// Why a dataset could not produce requests.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    #[error("cannot read dataset {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("dataset {path} is malformed: {message}")]
    Malformed { path: PathBuf, message: String },
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

/// Which dataset to draw from, with its options.
#[derive(Debug, Clone, PartialEq)]
pub enum DatasetConfig {
    Random(RandomConfig),
    PrefixRepetition(PrefixRepetitionConfig),
    ShareGpt {
        path: PathBuf,
        /// `--sharegpt-output-len`; `None` takes the length of the second turn.
        output_len: Option<usize>,
    },
    Sonnet {
        path: PathBuf,
        input_len: usize,
        output_len: usize,
        prefix_len: usize,
        /// Send the chat-templated prompt (every backend but openai-chat, as vLLM).
        send_formatted: bool,
    },
    Custom {
        path: PathBuf,
        output_len: usize,
        /// Apply the chat template (vLLM's default; off with `--skip-chat-template`).
        chat_template: bool,
    },
    Book(BookConfig),
}

/// Options shared by the file-backed datasets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SamplingOptions {
    pub seed: u64,
    /// `--disable-shuffle`: keep file order for sharegpt and custom, and prefix order for
    /// prefix_repetition.
    pub shuffle: bool,
    /// `--no-oversample`: return fewer requests rather than repeating some.
    pub oversample: bool,
}

/// Draws `num_requests` requests from `dataset`.
pub fn sample(
    dataset: &DatasetConfig,
    tokenizer: &BenchTokenizer,
    num_requests: usize,
    options: SamplingOptions,
) -> Result<Vec<SampleRequest>, DatasetError> {
    match dataset {
        DatasetConfig::Random(config) => {
            sample_random(config, tokenizer, num_requests, options.seed)
        }
        DatasetConfig::PrefixRepetition(config) => sample_prefix_repetition(
            config,
            tokenizer,
            num_requests,
            options.seed,
            options.shuffle,
        ),
        DatasetConfig::ShareGpt { path, output_len } => {
            text::sample_sharegpt(path, *output_len, tokenizer, num_requests, options)
        }
        DatasetConfig::Sonnet {
            path,
            input_len,
            output_len,
            prefix_len,
            send_formatted,
        } => text::sample_sonnet(
            path,
            text::SonnetLengths {
                input_len: *input_len,
                output_len: *output_len,
                prefix_len: *prefix_len,
            },
            *send_formatted,
            tokenizer,
            num_requests,
            options.seed,
        ),
        DatasetConfig::Custom {
            path,
            output_len,
            chat_template,
        } => text::sample_custom(
            path,
            *output_len,
            *chat_template,
            tokenizer,
            num_requests,
            options,
        ),
        DatasetConfig::Book(config) => {
            let text = read_text(&config.path)?;
            sample_book(&text, config, tokenizer, num_requests)
        }
    }
}

pub(crate) fn read_text(path: &std::path::Path) -> Result<String, DatasetError> {
    std::fs::read_to_string(path).map_err(|source| DatasetError::Read {
        path: path.to_path_buf(),
        source,
    })
}

pub(crate) fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// vLLM's `maybe_oversample_requests`: repeat random samples until there are enough.
pub(crate) fn oversample(
    requests: &mut Vec<SampleRequest>,
    num_requests: usize,
    options: SamplingOptions,
) {
    use rand::seq::IndexedRandom;
    if !options.oversample || requests.is_empty() || requests.len() >= num_requests {
        if requests.len() < num_requests {
            tracing::warn!(
                available = requests.len(),
                requested = num_requests,
                "dataset has fewer samples than requested"
            );
        }
        return;
    }
    let mut rng = rng(options.seed);
    let extra: Vec<SampleRequest> = (requests.len()..num_requests)
        .filter_map(|_| requests.choose(&mut rng).cloned())
        .collect();
    tracing::info!(
        added = extra.len(),
        "oversampled requests to reach --num-prompts"
    );
    requests.extend(extra);
}
