//! What the two worker binaries (`tandem-prefill`, `tandem-decode`) share: what their flags
//! drive (model loading, engine sizing, credentials) and how a binary starts (`startup`),
//! the engine actor that owns an [`tandem_engine::Engine`] on its own thread, what both gRPC
//! services do alike (`service`: `GetInfo`, `GetLoad`, the drain, serving with health),
//! conversions between the wire types and the engine's, and telemetry setup.
//!
//! Kept in a library so that neither binary depends on the other.

pub mod actor;
pub mod args;
pub mod convert;
mod error;
pub mod fuzzing;
pub mod pacing;
pub mod requests;
pub mod service;
pub mod startup;
pub mod telemetry;

pub use actor::{
    EngineHandle, EngineThreadOptions, KvShipment, LoadSnapshot, PrefilledPart, SeqEvent,
    spawn_engine,
};
pub use args::{
    EngineArgs, ModelArgs, ServerArgs, engine_config, init_compute, internal_auth, load_model,
    load_model_until, shm_dir,
};
pub use error::WorkerError;
pub use service::{Serving, WorkerCore, serve_until_drained, worker_info};
pub use startup::{Opened, StartError, bind, open, run_worker};
