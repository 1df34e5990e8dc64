//! How long a KV transfer under way may make no progress before it is over: the one rule the
//! sender's connect, writes and wait for the acknowledgement share (a leaf module, so the
//! transports and the factory that opens them both take it).

use std::time::Duration;

/// A stall's limit when the lease period is not known (a router that does not say it).
pub const DEFAULT_STALL: Duration = Duration::from_secs(60);

/// The lease period the decode worker granted (by then it has given the lease up), or
/// [`DEFAULT_STALL`] for 0 (unknown).
pub fn stall_limit(lease_ttl_ms: u32) -> Duration {
    match lease_ttl_ms {
        0 => DEFAULT_STALL,
        ms => Duration::from_millis(u64::from(ms)),
    }
}
