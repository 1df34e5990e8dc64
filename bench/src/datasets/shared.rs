//! What every dataset generator shares: the request they produce ([`SampleRequest`]), the
//! error ([`DatasetError`]), the options of the file-backed datasets ([`SamplingOptions`]), and
//! reading a file, seeding the generator and vLLM's oversampling. A leaf: the generators and
//! the dispatcher (`datasets/mod.rs`) depend on it, it on none of them.

use std::path::PathBuf;

use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::tokenizer::TokenizerError;

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

/// The whole of a dataset file.
pub(crate) fn read_text(path: &std::path::Path) -> Result<String, DatasetError> {
    std::fs::read_to_string(path).map_err(|source| DatasetError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// The generator every dataset draws from, seeded by `--seed`.
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
