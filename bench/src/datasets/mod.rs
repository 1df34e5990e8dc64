//! Request workloads: vLLM's `random`, `prefix_repetition`, `sharegpt`, `sonnet` and `custom`
//! datasets (`vllm/benchmarks/datasets.py`, 0.13.0), plus the `book` dataset the seeds used.
//!
//! Every generator is deterministic for a given `--seed`. Byte-exact copies of Python's and
//! numpy's random streams are not a goal (bench-spec §3.1); the distributions are the same.
//! `sonnet` and `custom` apply the tokenizer's chat template when it has one (an HF folder
//! with `tokenizer_config.json`); without one they use the raw prompt.
//!
//! This file picks the generator for a [`DatasetConfig`]; what the generators share (the
//! request type, the error, the sampling options and helpers) is the leaf `shared`, so no
//! generator depends on the dispatcher that depends on it.

mod prefix_repetition;
mod random;
mod shared;
mod text;

use std::path::PathBuf;

pub use prefix_repetition::{PrefixRepetitionConfig, sample_prefix_repetition};
pub use random::{RandomConfig, sample_random};
pub(crate) use random::{allowed_ids, random_token_ids};
use shared::read_text;
pub use shared::{DatasetError, SampleRequest, SamplingOptions};
pub use text::{BookConfig, BookOverflow, BookSplit, sample_book, split_book};

use crate::tokenizer::BenchTokenizer;

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
