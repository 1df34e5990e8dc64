//! One configuration model for every tandem binary: the typed argument structures that
//! `tandem-router`, `tandem-prefill` and `tandem-decode` parse (each flag also a `TANDEM_*`
//! variable), that the launcher fills for the processes it starts ([`to_args`]: no flag name
//! is spelled twice), and that `docs/configuration.md` is rendered from ([`reference`]).
//!
//! It depends on nothing but clap and serde, so the launcher can build a worker's command
//! line without linking the engine. What the flags mean at run time (loading a model, sizing
//! an engine, reading the secret) lives with the code that does it, as functions over these
//! structures.

mod argv;
mod auth;
mod log;
pub mod reference;
mod router;
mod worker;

pub use argv::{defaults, parse_without_env, to_args};
pub use auth::InternalAuthArgs;
pub use log::{LogArgs, LogFormat};
pub use router::{FallbackPolicy, PlacementPolicy, RouterArgs, RoutingPolicy, TransportArg};
pub use worker::{
    COMPUTE_MODES, CPU_PRIORITIES, DecodeArgs, EngineArgs, KV_DTYPES, MODEL_PRESETS, ModelArgs,
    PrefillArgs, ServerArgs, WEIGHT_FORMATS,
};
