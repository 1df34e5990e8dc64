//! The one error type of this crate.

use std::path::PathBuf;

/// Everything that can go wrong while loading or using a tokenizer or a chat template.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("not a usable GGUF file: {0}")]
    Gguf(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("unsupported tokenizer: {0}")]
    Unsupported(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// A render ran past the instruction or output budget every render gets: the template
    /// loops or prints without bound (a hostile model file), not a conversation's fault.
    #[error("chat template: {0}")]
    ChatTemplateLimit(String),
    #[error("this model has no chat template; use a completion endpoint or pass a template")]
    NoChatTemplate,
    #[error("structured output: {0}")]
    Guide(String),
    /// A size a model file declares is above one of the [`crate::ModelLimits`] ceilings.
    #[error("{what}: {value} is above the ceiling of {limit} (--model-limits {key}=N raises it)")]
    OverLimit {
        what: String,
        value: u64,
        limit: u64,
        key: &'static str,
    },
    /// A `--model-limits` value that does not parse.
    #[error("--model-limits: {0}")]
    Limits(String),
}

impl TextError {
    pub(crate) fn tokenizer(err: impl std::fmt::Display) -> Self {
        TextError::Tokenizer(err.to_string())
    }
}
