//! The engine's error type: what a caller can get wrong (typed, so a server can map each
//! variant to a status code) and what can fail underneath (loading, downloading).

use std::path::PathBuf;

/// Everything the engine API can refuse or fail at.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error(
        "prompt of {prompt} tokens plus max_tokens {max_tokens} exceeds the model's context of {context} tokens"
    )]
    ContextExceeded {
        prompt: usize,
        max_tokens: usize,
        context: usize,
    },
    #[error("token id {id} is outside the vocabulary (size {vocab})")]
    UnknownToken { id: u32, vocab: usize },
    #[error("invalid sampling parameter `{param}`: {reason}")]
    InvalidSampling { param: &'static str, reason: String },
    #[error("sequence needs {needed} KV blocks but the pool has only {total} in all")]
    SequenceTooLong { needed: usize, total: usize },
    #[error("not enough free KV blocks: {needed} needed, {free} free")]
    OutOfBlocks { needed: usize, free: usize },
    #[error("unknown sequence {0}")]
    UnknownSequence(u64),
    #[error("KV layout mismatch: {0}")]
    LayoutMismatch(String),
    #[error("invalid KV data: {0}")]
    InvalidKv(String),
    #[error("invalid model config: {0}")]
    Config(String),
    #[error("cannot load model from {path}: {reason}")]
    Load { path: PathBuf, reason: String },
    #[error("{0}")]
    Fetch(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error(transparent)]
    Text(#[from] tandem_text::TextError),
    #[error("tensor error: {0}")]
    Candle(#[from] candle_core::Error),
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl EngineError {
    pub(crate) fn load(path: impl Into<PathBuf>, reason: impl std::fmt::Display) -> Self {
        EngineError::Load {
            path: path.into(),
            reason: reason.to_string(),
        }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        EngineError::Io {
            path: path.into(),
            source,
        }
    }

    /// Whether the caller's input is at fault (a 4xx), as opposed to the server (a 5xx).
    pub fn is_invalid_request(&self) -> bool {
        matches!(
            self,
            EngineError::EmptyPrompt
                | EngineError::ContextExceeded { .. }
                | EngineError::UnknownToken { .. }
                | EngineError::InvalidSampling { .. }
                | EngineError::SequenceTooLong { .. }
        )
    }
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;

/// A failed CUDA call, named by what it was doing.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_err(what: &str, e: impl std::fmt::Display) -> EngineError {
    EngineError::Unsupported(format!("CUDA {what}: {e}"))
}

impl From<tandem_kv::KvError> for EngineError {
    /// KV errors keep their meaning at the engine's surface (and so their status codes).
    fn from(e: tandem_kv::KvError) -> Self {
        use tandem_kv::KvError;
        match e {
            KvError::OutOfBlocks { needed, free } => EngineError::OutOfBlocks { needed, free },
            KvError::TooManyBlocks { needed, total } => {
                EngineError::SequenceTooLong { needed, total }
            }
            KvError::EmptyReservation => EngineError::EmptyPrompt,
            KvError::LayoutMismatch(why) => EngineError::LayoutMismatch(why),
            KvError::InvalidKv(why) | KvError::ForeignFile(why) => EngineError::InvalidKv(why),
            KvError::Config(why) => EngineError::Config(why),
            KvError::Device(why) => EngineError::Unsupported(why),
            KvError::Io { path, source } => EngineError::Io { path, source },
        }
    }
}
