//! The decode worker: reserves KV blocks under a lease, receives the prompt's KV from a
//! prefill worker (gRPC, raw TCP or shared memory on the CPU; cuda-ipc or nccl into its
//! device pool on a GPU), admits the request into continuous
//! batching once every block arrived and checked, and streams its tokens. It can also run a
//! whole request itself (aggregated mode).
//!
//! `main.rs` only parses flags; [`serve`] runs the worker on given listeners so tests can
//! start it in-process.

mod config;
mod generate;
mod service;
mod state;

pub use config::{DecodeConfig, DecodeError};
pub use service::{DecodeWorker, serve};
pub use tandem_kv::shm::default_shm_dir;
