//! The prefill worker: batches prompts under a token budget (chunking long ones), ships each
//! layer's KV to the reserved decode worker while later layers still compute, commits the
//! transfer there with the first token, and returns that token.
//!
//! `main.rs` only parses flags; [`serve`] runs the worker on a given listener so tests can
//! start it in-process.

mod service;

pub use service::{PrefillConfig, PrefillError, PrefillWorker, serve};
