//! tandem's wire contract: the gRPC services of the prefill and decode workers and the KV
//! transfer messages (package `tandem.v1`), generated at build time from `proto/`.
//!
//! Versioned by package name; `PROTOCOL_VERSION` is exchanged at handshake so a router never
//! pairs workers that speak different revisions.

/// Bumped on any incompatible change to the messages or the raw TCP framing.
pub const PROTOCOL_VERSION: u32 = 1;

pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("tandem.v1");
}

pub use v1::*;
