//! tandem's model runtime, shared by the prefill and decode workers: Llama-family models on
//! a paged KV cache, batched and chunked prefill, continuous-batching decode, sampling and
//! stopping. The KV cache's types are `tandem_kv`'s, shared with the transports.
//!
//! It knows nothing of networks or RPC: workers drive an [`Engine`] from their own threads.

pub mod backend;
pub mod config;
pub mod device;
pub mod engine;
pub mod error;
pub mod eval;
pub mod fetch;
pub mod fuzzing;
pub mod guides;
pub mod model;
pub mod sampling;
mod sequence;
pub mod types;

pub use config::{ModelConfig, WeightFormat};
pub use device::Device;

/// Whether this build has the CUDA engine (the `cuda` feature).
pub const CUDA_SUPPORT: bool = cfg!(feature = "cuda");
pub use engine::{CalibrationRun, DecodeStream, Engine, EngineConfig, EngineStats, ReceivedKv};
pub use error::{EngineError, Result};
pub use guides::compile_guide;
pub use model::{LoadOptions, Model, ModelSource, SeqInput, load_model};
pub use sampling::{PromptLogprob, SampledToken, SamplingParams, StopParams};
pub use types::{ChunkInfo, FinishReason, SeqId, StepOutput};
