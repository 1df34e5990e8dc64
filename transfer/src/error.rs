//! Transfer errors, each mapping to a gRPC status so peers and the router see precise codes.

use tandem_kv::KvError;

#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error("KV layout mismatch: {0}")]
    LayoutMismatch(String),
    /// No open lease has this capability (never existed, ended, or a guess): the same answer
    /// in every case, naming nothing.
    #[error("no open lease holds this capability")]
    UnknownLease,
    #[error("the lease was cancelled")]
    Cancelled,
    /// The caller holds as many reserved blocks as it may: room comes back as its leases end.
    #[error("{0}")]
    QuotaExceeded(String),
    /// More blocks than one caller may ever hold: no wait makes room.
    #[error("{0}")]
    BeyondQuota(String),
    /// The peer could not prove it belongs to the deployment.
    #[error("{0}")]
    Unauthenticated(String),
    #[error("corrupt KV transfer: {0}")]
    Corrupt(String),
    #[error("incomplete KV transfer: {0}")]
    Incomplete(String),
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The peer (or the link to it) went quiet past a deadline: a network failure, not a
    /// malformed transfer, so the request may be placed again.
    #[error("timed out: {0}")]
    TimedOut(String),
    /// The peer does not offer this (e.g. reading back KV that lives on its GPU).
    #[error("not offered: {0}")]
    Unsupported(String),
    #[error("cannot reach the decode worker: {0}")]
    Connect(String),
    #[error("transfer I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("peer refused the transfer: {0}")]
    Remote(String),
    #[error(transparent)]
    Kv(KvError),
}

impl From<TransferError> for tonic::Status {
    fn from(e: TransferError) -> Self {
        let msg = e.to_string();
        match e {
            TransferError::LayoutMismatch(_) | TransferError::Unsupported(_) => {
                tonic::Status::failed_precondition(msg)
            }
            TransferError::UnknownLease => tonic::Status::not_found(msg),
            TransferError::Cancelled => tonic::Status::cancelled(msg),
            TransferError::QuotaExceeded(_) | TransferError::BeyondQuota(_) => {
                tonic::Status::resource_exhausted(msg)
            }
            TransferError::Unauthenticated(_) => tonic::Status::unauthenticated(msg),
            TransferError::Corrupt(_) | TransferError::Incomplete(_) => {
                tonic::Status::data_loss(msg)
            }
            TransferError::Protocol(_) => tonic::Status::invalid_argument(msg),
            TransferError::Connect(_)
            | TransferError::Io(_)
            | TransferError::Remote(_)
            | TransferError::TimedOut(_) => tonic::Status::unavailable(msg),
            TransferError::Kv(e) => match e {
                KvError::OutOfBlocks { .. } => tonic::Status::resource_exhausted(msg),
                KvError::LayoutMismatch(_) => tonic::Status::failed_precondition(msg),
                KvError::InvalidKv(_) => tonic::Status::data_loss(msg),
                e if e.is_invalid_request() => tonic::Status::invalid_argument(msg),
                _ => tonic::Status::internal(msg),
            },
        }
    }
}

impl From<KvError> for TransferError {
    fn from(e: KvError) -> Self {
        match e {
            // A shared file that is not the advertised pool: the peer failed to prove it.
            KvError::ForeignFile(why) => TransferError::Unauthenticated(why),
            KvError::LayoutMismatch(why) => TransferError::LayoutMismatch(why),
            e => TransferError::Kv(e),
        }
    }
}
