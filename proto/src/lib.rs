//! tandem's wire contract: the gRPC services of the prefill and decode workers and the KV
//! transfer messages (package `tandem.v1`), generated at build time from `proto/`.
//!
//! Versioned by package name; `PROTOCOL_VERSION` is exchanged at handshake so a router never
//! pairs workers that speak different revisions.

/// Bumped on any incompatible change to the messages or the raw TCP framing.
/// 2: leases are 128-bit capabilities; KV destinations name the decode worker, not addresses;
/// the raw TCP hello answers the listener's challenge.
/// 3: the first token travels with its top logprobs (a longer raw TCP commit header); prefill
/// requests carry the stop parameters (min_tokens).
/// 4: requests may ask for `n` choices: their first tokens travel together (another raw TCP
/// commit header), token and finish events name their choice; and for prompt logprobs.
/// 5: prefix caching across the plane: load reports carry block events, a decode worker's
/// lease skips the blocks its cache holds (`first_block`), and may run a short uncached
/// suffix itself (`LocalPrefill`).
/// 6: a prefill worker reads back the part of a lease's cached prefix it lacks
/// (`DecodeService.PullKv`) instead of recomputing it.
pub const PROTOCOL_VERSION: u32 = 6;

/// What one request may ask for: the one definition of these bounds (the `tandem-limits`
/// crate, re-exported here for the crates of the plane).
pub use tandem_limits as limits;

pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("tandem.v1");
}

pub use v1::*;
