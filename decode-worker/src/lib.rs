//! The decode worker: reserves KV blocks under a lease, receives the prompt's KV from a
//! prefill worker (gRPC, raw TCP or shared memory), admits the request into continuous
//! batching once every block arrived and checked, and streams its tokens. It can also run a
//! whole request itself (aggregated mode).
//!
//! `main.rs` only parses flags; [`serve`] runs the worker on given listeners so tests can
//! start it in-process.

mod generate;
mod service;

pub use service::{DecodeConfig, DecodeError, DecodeWorker, serve};
pub use tandem_kv::shm::default_shm_dir;
