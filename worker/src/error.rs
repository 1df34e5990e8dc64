//! Why a worker could not start or serve: the one error type both worker libraries return
//! (`tandem_prefill::PrefillError` and `tandem_decode::DecodeError` name it).

/// Why the worker could not start or serve.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("engine: {0}")]
    Engine(#[from] tandem_engine::EngineError),
    #[error("KV cache: {0}")]
    Kv(#[from] tandem_kv::KvError),
    #[error("KV transfer setup: {0}")]
    Transfer(#[from] tandem_transfer::TransferError),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("gRPC server: {0}")]
    Server(#[from] tonic::transport::Error),
    #[error("internal authentication: {0}")]
    Auth(#[from] tandem_auth::AuthError),
    #[error("{0}")]
    Config(String),
}
