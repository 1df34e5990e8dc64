//! What the two worker binaries (`tandem-prefill`, `tandem-decode`) share: what their flags
//! drive (model loading, engine sizing, credentials), the engine actor that owns an [`tandem_engine::Engine`] on its own
//! thread, conversions between the wire types and the engine's, and telemetry setup.
//!
//! Kept in a library so that neither binary depends on the other.

pub mod actor;
pub mod args;
pub mod convert;
pub mod telemetry;

pub use actor::{EngineHandle, KvShipment, LoadSnapshot, SeqEvent, spawn_engine};
pub use args::{
    EngineArgs, ModelArgs, ServerArgs, engine_config, init_compute, internal_auth, load_model,
    load_model_until, shm_dir,
};
