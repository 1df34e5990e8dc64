//! Why authentication failed or could not be set up.

/// Why authentication failed or could not be set up. The messages name no secret.
#[derive(Debug, Clone, thiserror::Error)]
pub enum AuthError {
    #[error("{0}")]
    Config(String),
    #[error("no call token")]
    Missing,
    #[error("malformed call token")]
    Malformed,
    #[error("the proof does not match the deployment secret")]
    BadProof,
    #[error(
        "the call token is {} s away from this worker's clock (the limit is {limit_s} s): \
         check that the hosts' clocks are synchronised", skew_ms / 1000
    )]
    Expired { skew_ms: u64, limit_s: u64 },
    #[error("the call token was already used")]
    Replayed,
    #[error("too many calls inside the token window")]
    TooManyCalls,
}
