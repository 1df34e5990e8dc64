//! The flags of the two workers (`tandem-prefill`, `tandem-decode`): the groups they share
//! (which model, how large an engine, where to listen) and each one's own. What they drive
//! (loading the model, sizing the engine) is `tandem-worker`'s.

use std::path::PathBuf;

use clap::{Args, Parser};
use serde::{Deserialize, Serialize};

use crate::{InternalAuthArgs, LogArgs};

/// The values `--weights` takes (the engine's `WeightFormat` names).
pub const WEIGHT_FORMATS: [&str; 10] = [
    "native", "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k",
];

/// The values `--kv-dtype` takes (`tandem_kv::KvDtype` names).
pub const KV_DTYPES: [&str; 3] = ["f32", "bf16", "f16"];

/// The values `--compute` takes (how quantized weights compute).
pub const COMPUTE_MODES: [&str; 3] = ["auto", "exact", "fast"];

/// The shapes `--model dummy:<preset>` takes (the engine's `ModelConfig::PRESETS`), for the
/// launcher's manifest check.
pub const MODEL_PRESETS: [&str; 11] = [
    "tiny",
    "tiny-window",
    "smollm2-135m",
    "llama-3.2-1b",
    "llama-3.1-8b",
    "qwen2.5-0.5b",
    "qwen3-0.6b",
    "mistral-7b",
    "phi3-mini",
    "gemma2-2b",
    "gemma3-1b",
];

/// Which model to serve.
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
pub struct ModelArgs {
    /// `smollm2` (default model, fetched once with pip), `tiny` (built-in test model),
    /// `dummy:PRESET[:SEED]`, or a path to an HF folder or a GGUF file.
    #[arg(long, env = "TANDEM_MODEL", default_value = "smollm2")]
    pub model: String,
    /// How to store the weights: `native` (a GGUF's own formats, an HF folder's dtype), `f32`,
    /// `f16`, `bf16`, or a GGML format to quantize to at load (`q8_0`, `q4_0`, `q4_1`, `q4_k`,
    /// `q5_k`, `q6_k`). f16 and bf16 compute in f32; GGML formats as `--compute` says.
    #[arg(long, env = "TANDEM_WEIGHTS", default_value = "native", value_parser = clap::builder::PossibleValuesParser::new(WEIGHT_FORMATS))]
    pub weights: String,
    /// Element type of the KV cache: `f32`, or `bf16`/`f16` for half the memory and half the
    /// bytes on every transport (K and V rounded; the CPU engine only). Prefill and decode
    /// workers must agree: the dtype is part of the layout they compare.
    #[arg(long, env = "TANDEM_KV_DTYPE", default_value = "f32", value_parser = clap::builder::PossibleValuesParser::new(KV_DTYPES))]
    pub kv_dtype: String,
    /// A tokenizer (tokenizer.json, HF folder or GGUF) instead of the model's own.
    #[arg(long, env = "TANDEM_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,
    /// Where the default model is cached (default: the user's cache dir + /tandem).
    #[arg(long, env = "TANDEM_CACHE")]
    pub cache_dir: Option<PathBuf>,
    /// Ceilings on what the model's files may declare, each checked (with the file's own
    /// length) before anything is allocated for it; a file past one is refused, naming it.
    /// `KEY=N` pairs separated by commas, `N` a count that may end in K, M, G or T (powers of
    /// 1024); keys left out keep their defaults, which are
    /// `metadata-items=32M,string-bytes=64M,vocab=4M,merges=16M,template-bytes=1M,tensors=256K,json-bytes=256M`
    /// (GGUF metadata array items in all, bytes of one GGUF string, tokens, BPE merges, bytes
    /// of a chat template, tensors, bytes of a JSON file or safetensors header).
    #[arg(long, env = "TANDEM_MODEL_LIMITS")]
    #[serde(default)]
    pub model_limits: Option<String>,
}

/// The values of `--cpu-priority`.
pub const CPU_PRIORITIES: [&str; 2] = ["normal", "idle"];

/// Engine sizing and threads.
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
pub struct EngineArgs {
    /// MiB of KV cache.
    #[arg(long, env = "TANDEM_KV_BUDGET_MB", default_value_t = 1024)]
    pub kv_budget_mb: usize,
    /// Tokens per forward pass (decode tokens plus prefill chunks).
    #[arg(long, env = "TANDEM_MAX_BATCH_TOKENS", default_value_t = 2048)]
    pub max_batch_tokens: usize,
    /// Sequences running at once.
    #[arg(long, env = "TANDEM_MAX_RUNNING", default_value_t = 256)]
    pub max_running: usize,
    /// Compute every prompt in full: no reuse of the KV of prefixes computed before (prefix
    /// caching is on by default; sliding-window models run without it).
    #[arg(long, env = "TANDEM_NO_PREFIX_CACHING")]
    #[serde(default)]
    pub no_prefix_caching: bool,
    /// Compute threads (default: one per available core).
    #[arg(long, env = "TANDEM_THREADS")]
    pub threads: Option<usize>,
    /// CPU scheduling priority of the worker's threads: `normal`, or `idle` (Linux
    /// SCHED_IDLE: it runs only on cycles no normal thread wants). An idle prefill worker
    /// on the decode worker's cores lends it their slack: the decode worker preempts it for
    /// every step, and it computes prompts in between.
    #[arg(long, env = "TANDEM_CPU_PRIORITY", default_value = "normal", value_parser = clap::builder::PossibleValuesParser::new(CPU_PRIORITIES))]
    pub cpu_priority: String,
    /// Where the engine computes: `cpu`, `cuda` or `cuda:N` (binaries built with the `cuda`
    /// feature, see scripts/build-gpu).
    #[arg(long, env = "TANDEM_DEVICE", default_value = "cpu")]
    pub device: String,
    /// Confine the GPU engine to a green context of this many SMs (set by `tandem up` from a
    /// GPU deployment). Refused with `--device cpu`, never ignored.
    #[arg(long, env = "TANDEM_GREEN_CONTEXT_SMS")]
    pub green_context_sms: Option<u32>,
    /// Instruction set of the CPU kernels: avx512, avx2, neon or scalar (default: the best
    /// this CPU runs). Every set gives the same bits; a set the CPU lacks is refused.
    #[arg(long, env = "TANDEM_ISA")]
    pub isa: Option<String>,
    /// How quantized weights compute: `exact` (their f32 widening, bit for bit), `fast` (8-bit
    /// activations, integer dot products) or `auto` (the faster on this instruction set, see
    /// BENCHMARKS.md). Workers exchanging KV must compute alike: the mode is part of the
    /// model's identity.
    #[arg(long, env = "TANDEM_COMPUTE", default_value = "auto", value_parser = clap::builder::PossibleValuesParser::new(COMPUTE_MODES))]
    pub compute: String,
    /// Prompt tokens of made-up work run at start-up to fit the worker's cost model before
    /// the first request (prompts of three lengths and decode batches, a few seconds on a
    /// small CPU, at most 20 s); a router placing by latency targets prices prompts on a
    /// worker only once its fit has seen 1024 prompt tokens. 0: none, the model learns
    /// from requests alone.
    #[arg(long, env = "TANDEM_CALIBRATION_TOKENS", default_value_t = DEFAULT_CALIBRATION_TOKENS)]
    #[serde(default = "default_calibration_tokens")]
    pub calibration_tokens: usize,
}

/// The default of `--calibration-tokens`: the 1024 a fit needs to price prompts, with room
/// for its decay.
pub const DEFAULT_CALIBRATION_TOKENS: usize = 1280;

fn default_calibration_tokens() -> usize {
    DEFAULT_CALIBRATION_TOKENS
}

/// Where the gRPC server listens, and the credentials it requires.
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
pub struct ServerArgs {
    /// Address the gRPC server listens on (beyond loopback it needs the internal secret).
    #[arg(long, env = "TANDEM_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// gRPC port (default: 7101 for a prefill worker, 7201 for a decode worker).
    #[arg(long, env = "TANDEM_PORT")]
    pub port: Option<u16>,
    /// Host other machines reach this worker at (for the KV TCP port), if not `host`.
    #[arg(long, env = "TANDEM_ADVERTISE_HOST")]
    pub advertise_host: Option<String>,
    #[command(flatten)]
    pub log: LogArgs,
    /// A name for this worker in logs and metrics (default: role@host:port).
    #[arg(long, env = "TANDEM_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Folder of the decode workers' shared-memory KV pools (default /dev/shm). Prefill
    /// workers map pools only from here.
    #[arg(long, env = "TANDEM_SHM_DIR")]
    pub shm_dir: Option<PathBuf>,
    #[command(flatten)]
    pub auth: InternalAuthArgs,
}

/// tandem's prefill worker: runs prompts and ships their KV to decode workers.
#[derive(Debug, Clone, PartialEq, Parser, Serialize, Deserialize)]
#[command(name = "tandem-prefill", version)]
pub struct PrefillArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub server: ServerArgs,
    /// How long shutdown waits for running prefills (s).
    #[arg(long, env = "TANDEM_DRAIN_TIMEOUT_S", default_value_t = 30)]
    pub drain_timeout_s: u64,
    /// Compute the part of a decode worker's cached prefix that this worker's cache lacks,
    /// instead of reading it back from the decode worker (for links slower than the compute).
    #[arg(long, env = "TANDEM_NO_PREFIX_PULL")]
    pub no_prefix_pull: bool,
}

/// tandem's decode worker: receives KV from prefill workers and streams tokens.
#[derive(Debug, Clone, PartialEq, Parser, Serialize, Deserialize)]
#[command(name = "tandem-decode", version)]
pub struct DecodeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub server: ServerArgs,
    /// Raw TCP port for KV transfer (0 picks a free one; `--no-kv-tcp` disables it).
    #[arg(long, env = "TANDEM_KV_TCP_PORT", default_value_t = 0)]
    pub kv_tcp_port: u16,
    /// Do not listen for raw TCP KV transfers.
    #[arg(long, env = "TANDEM_NO_KV_TCP")]
    pub no_kv_tcp: bool,
    /// KV TCP connections served at once; more are closed as they arrive.
    #[arg(long, env = "TANDEM_KV_TCP_MAX_CONNECTIONS", default_value_t = 256)]
    pub kv_tcp_max_connections: usize,
    /// How long a KV TCP connection may take to prove itself (ms).
    #[arg(long, env = "TANDEM_KV_TCP_HELLO_TIMEOUT_MS", default_value_t = 5_000)]
    pub kv_tcp_hello_timeout_ms: u64,
    /// How long a KV TCP transfer may stay silent (ms).
    #[arg(long, env = "TANDEM_KV_TCP_READ_TIMEOUT_MS", default_value_t = 30_000)]
    pub kv_tcp_read_timeout_ms: u64,
    /// Keep the KV pool in private memory (disables the shm transport).
    #[arg(long, env = "TANDEM_NO_SHM")]
    pub no_shm: bool,
    /// Default lease: how long a reservation waits for KV without progress (ms).
    #[arg(long, env = "TANDEM_LEASE_TTL_MS", default_value_t = 30_000)]
    pub lease_ttl_ms: u64,
    /// The longest wait without progress a caller may ask of a reservation (ms).
    #[arg(long, env = "TANDEM_MAX_LEASE_TTL_MS", default_value_t = 60_000)]
    pub max_lease_ttl_ms: u64,
    /// The longest a reservation may stay open, renewals included (s).
    #[arg(long, env = "TANDEM_MAX_LEASE_LIFETIME_S", default_value_t = 600)]
    pub max_lease_lifetime_s: u64,
    /// Share of the KV pool one caller (address) may hold in reservations awaiting KV.
    #[arg(long, env = "TANDEM_CALLER_LEASE_SHARE", default_value_t = 0.9)]
    pub caller_lease_share: f64,
    /// How long a disaggregated request waits for room to reserve its blocks (the pool, or
    /// its caller's share of it) before it is refused as busy (ms; 0: refuse at once).
    #[arg(long, env = "TANDEM_RESERVE_WAIT_MS", default_value_t = 120_000)]
    pub reserve_wait_ms: u64,
    /// Run decode passes no faster than the streams' TPOT targets ask (0.9 of the tightest)
    /// and leave the rest of each period idle, for a worker at `--cpu-priority idle` on the
    /// same cores (an elastic prefill worker) to compute in.
    #[arg(long, env = "TANDEM_LEND_SLACK")]
    #[serde(default)]
    pub lend_slack: bool,
    /// How long shutdown waits for running requests (s).
    #[arg(long, env = "TANDEM_DRAIN_TIMEOUT_S", default_value_t = 30)]
    pub drain_timeout_s: u64,
}
