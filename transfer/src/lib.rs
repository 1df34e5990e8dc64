//! KV transfer between a prefill worker and a decode worker, behind one trait.
//!
//! The prefill side gets a [`KvSender`] per request from [`connect()`] (the factory, in its own
//! module so that the trait's module is a leaf every transport can import): the engine thread hands
//! it each layer's blocks as soon as the layer is computed (`send_layer` copies and returns),
//! and `commit` finishes with the first token once every byte is on the other side. Five
//! transports implement it, the last two only in builds with their feature:
//! - `grpc`: chunked `DecodeService.PushKv` client streams; works anywhere; the baseline.
//! - `tcp`: a raw framed stream to the decode worker's KV port (no protobuf copies); for
//!   workers on different hosts.
//! - `shm`: the decode worker's KV pool is a shared-memory file; the prefill worker maps it
//!   and writes the reserved blocks in place, then commits with checksums over gRPC.
//! - `cuda-ipc` (feature `cuda`): GPU workers on one node; the prefill worker opens the decode
//!   worker's device pool by IPC handle and copies each layer's blocks device to device,
//!   fenced by the same owner tags as `shm`, then commits over gRPC.
//! - `nccl` (feature `nccl`): GPUs that cannot open each other's memory; a two-rank NCCL
//!   communicator per worker pair carries announced layer messages ([`nccl_wire`]) into the
//!   decode worker's device pool.
//!
//! Each transport plugs in through one trait, `transport::KvTransport` (open a request's
//! sender; keep, and forget on failure, what it holds per decode worker), and one line in
//! `registry::Registry::new`. A prefill worker's [`Peers`] owns the registry, its gRPC
//! channels and the decode workers it verified, and names no transport. A device transport
//! a build leaves out stays registered as a stub that names the feature it needs.
//!
//! A prefill worker that lacks part of the cached prefix a lease holds reads it back over
//! `DecodeService.PullKv` ([`pull_cached_prefix`]; the decode side is [`serve_pull`]) rather
//! than compute it again.
//!
//! The decode side keeps a [`LeaseTable`]: every reservation, which of its (layer, block)
//! pieces have arrived, and the commit that hands it to the engine. Every transfer is checked:
//! the layout hash at the start, sizes, a CRC-32 per block-layer (on the host transports),
//! completeness at commit. A bad transfer fails its request; it never produces wrong tokens.
//!
//! Nobody is trusted for being able to reach a port (see `tandem-auth`): a lease is a random
//! 128-bit capability ([`LeaseToken`]) known only to the router and the prefill worker it
//! chose; a prefill worker sends KV only to a decode worker that proved it holds the
//! deployment secret, at the addresses that worker advertised ([`VerifiedDecode`]); the TCP
//! listener reads nothing a stranger sizes ([`TcpLimits`]); shared-memory files are private,
//! never followed through links, and swept when their worker is gone
//! (`tandem_kv::shm::sweep_stale`).

mod bufpool;
mod checksum;
mod connect;
#[cfg(feature = "cuda")]
mod cuda_ipc;
#[cfg(feature = "cuda")]
mod device;
mod error;
mod frame;
pub mod fuzzing;
mod grpc;
mod inplace;
mod lease;
#[cfg(feature = "nccl")]
mod nccl;
pub mod nccl_wire;
mod peers;
mod pull;
mod reach;
pub mod receivers;
mod registry;
mod sender;
mod service;
mod shm;
mod stall;
mod tcp;
mod transport;
mod verify;

pub use checksum::crc32;
pub use connect::connect;
pub use error::TransferError;
pub use grpc::receive_push_kv;
pub use lease::{Commit, DevicePool, Lease, LeaseTable, LeaseToken, Opened, Progress, QuotaClaim};
#[cfg(feature = "nccl")]
pub use nccl::{DeviceLink, NcclReceivers, nccl_supported, spawn_nccl_receiver};
pub use peers::Peers;
pub use pull::{PULL_TIMEOUT, PullStream, PulledPrefix, pull_cached_prefix, serve_pull};
pub use reach::{GRPC_CONNECTION_WINDOW, GRPC_STREAM_WINDOW};
pub use sender::{
    FirstToken, KvSender, SendFuture, SendStats, other_choices_from_proto, top_logprobs_from_proto,
    top_logprobs_to_proto,
};
pub use service::{KvOnlyDecode, kv_rpcs};
pub use tcp::{TcpLimits, serve_tcp};
pub use transport::{kv_location, transport_name};
pub use verify::VerifiedDecode;
