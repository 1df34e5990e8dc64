//! What the KV types refuse: sizes and ids out of range, layouts that do not match, files that
//! are not what they should be.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum KvError {
    #[error("not enough free KV blocks: {needed} needed, {free} free")]
    OutOfBlocks { needed: usize, free: usize },
    #[error("sequence needs {needed} KV blocks but the pool has only {total} in all")]
    TooManyBlocks { needed: usize, total: usize },
    #[error("a reservation for zero tokens")]
    EmptyReservation,
    #[error("KV layout mismatch: {0}")]
    LayoutMismatch(String),
    #[error("invalid KV data: {0}")]
    InvalidKv(String),
    /// A shared-memory file that is not the pool it claims to be (a link, another file, the
    /// wrong size or inode): refused before anything is mapped.
    #[error("{0}")]
    ForeignFile(String),
    /// A CUDA or NCCL call failed (or the library is missing).
    #[error("{0}")]
    Device(String),
    #[error("invalid KV configuration: {0}")]
    Config(String),
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl KvError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        KvError::Io {
            path: path.into(),
            source,
        }
    }

    /// Whether the caller asked for something no pool could give (a 4xx, not a 5xx).
    pub fn is_invalid_request(&self) -> bool {
        matches!(
            self,
            KvError::TooManyBlocks { .. } | KvError::EmptyReservation
        )
    }
}

pub type Result<T, E = KvError> = std::result::Result<T, E>;
