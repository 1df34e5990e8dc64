//! The flags of `tandem-router` (each also a `TANDEM_*` variable, and the same keys in the
//! TOML file `--config` names). The router validates them into its configuration.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use serde::{Deserialize, Serialize};

use crate::{InternalAuthArgs, LogArgs};

/// What to do with a request meant for disaggregation when no healthy, compatible prefill
/// worker exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FallbackPolicy {
    /// Run it aggregated on the decode worker; the response and metrics say so.
    Aggregated,
    /// Answer 503 with `Retry-After`.
    Error,
}

/// How the router picks a decode and a prefill worker for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RoutingPolicy {
    /// By the prompt's prefix that each worker's cache holds, weighed against its load.
    KvAware,
    /// By load alone: most free KV blocks (decode), fewest queued prompt tokens (prefill).
    Load,
    /// In turn, whatever their load or cache.
    RoundRobin,
}

/// How the router places a request: disaggregated or aggregated, and where.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PlacementPolicy {
    /// By the prompt's length: shorter than `--agg-threshold` aggregated, else disaggregated.
    Static,
    /// By the latency targets: the placement predicted to meet the request's TTFT and the
    /// streams' TPOT targets (`--slo-*`), from the workers' measured costs.
    Slo,
}

/// The KV transport the router asks prefill workers to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportArg {
    Shm,
    Tcp,
    Grpc,
    /// GPU workers on one node: device-to-device copies into the decode worker's pool.
    #[serde(rename = "cuda-ipc")]
    CudaIpc,
    /// GPU workers that cannot open each other's memory: NCCL sends into the decode pool.
    Nccl,
}

/// Command-line flags of `tandem-router`. Every field is optional here so that the TOML
/// file can supply it; defaults are applied in [`RouterConfig::from_args`].
#[derive(Debug, Clone, Default, PartialEq, Parser, Serialize, Deserialize)]
#[command(name = "tandem-router", version, about = "tandem's HTTP front door")]
#[serde(deny_unknown_fields)]
pub struct RouterArgs {
    /// TOML file with any of these settings (same names, snake_case; lists as arrays).
    #[arg(long, env = "TANDEM_ROUTER_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1].
    #[arg(long, env = "TANDEM_ROUTER_HOST")]
    pub host: Option<String>,
    /// Port to listen on [default: 8000].
    #[arg(long, env = "TANDEM_ROUTER_PORT")]
    pub port: Option<u16>,
    /// Prefill workers, comma-separated: gRPC URLs (http://127.0.0.1:7101), or
    /// dns://NAME:PORT for every address NAME resolves to, re-resolved periodically.
    #[arg(long, env = "TANDEM_ROUTER_PREFILL", value_delimiter = ',')]
    #[serde(default)]
    pub prefill: Vec<String>,
    /// Decode workers, comma-separated: gRPC URLs (http://127.0.0.1:7201), or
    /// dns://NAME:PORT for every address NAME resolves to, re-resolved periodically.
    #[arg(long, env = "TANDEM_ROUTER_DECODE", value_delimiter = ',')]
    #[serde(default)]
    pub decode: Vec<String>,
    /// KV transport prefill workers are asked to use [default: shm].
    #[arg(long, env = "TANDEM_ROUTER_TRANSPORT", value_enum)]
    pub transport: Option<TransportArg>,
    /// Prompts shorter than this many tokens run aggregated, and so does a longer one whose
    /// decode worker's prefix cache holds all but fewer than this many of its tokens; 0
    /// always disaggregates [default: 0].
    #[arg(long, env = "TANDEM_ROUTER_AGG_THRESHOLD")]
    pub agg_threshold: Option<u32>,
    /// How requests are placed: static (by `--agg-threshold`) or slo (by the latency
    /// targets and the workers' measured costs) [default: static].
    #[arg(long, env = "TANDEM_ROUTER_PLACEMENT", value_enum)]
    pub placement: Option<PlacementPolicy>,
    /// TTFT target, fixed part, in milliseconds; a request's header `x-tandem-slo-ttft-ms`
    /// sets its whole target instead [default: 1000].
    #[arg(long, env = "TANDEM_ROUTER_SLO_TTFT_MS")]
    pub slo_ttft_ms: Option<f64>,
    /// TTFT target, part per prompt token, in milliseconds [default: 1.5].
    #[arg(long, env = "TANDEM_ROUTER_SLO_TTFT_PER_TOKEN_MS")]
    pub slo_ttft_per_token_ms: Option<f64>,
    /// TPOT target in milliseconds; a request's header `x-tandem-slo-tpot-ms` sets its own
    /// [default: 60].
    #[arg(long, env = "TANDEM_ROUTER_SLO_TPOT_MS")]
    pub slo_tpot_ms: Option<f64>,
    /// Move CPU compute threads between the decode and prefill workers, which share one
    /// host's cores, by the TPOT target and the prompts queued (see router/README.md).
    #[arg(long, env = "TANDEM_ROUTER_ELASTIC_THREADS")]
    #[serde(default)]
    pub elastic_threads: bool,
    /// When no prefill worker is healthy: run aggregated, or answer 503 [default: aggregated].
    #[arg(long, env = "TANDEM_ROUTER_FALLBACK", value_enum)]
    pub fallback: Option<FallbackPolicy>,
    /// How workers are picked: kv-aware, load or round-robin [default: kv-aware].
    #[arg(long, env = "TANDEM_ROUTER_ROUTING", value_enum)]
    pub routing: Option<RoutingPolicy>,
    /// kv-aware routing: what one KV block of the prompt that a decode worker lacks costs,
    /// in free blocks of that worker (see router/README.md) [default: 2].
    #[arg(long, env = "TANDEM_ROUTER_KV_OVERLAP_WEIGHT")]
    pub kv_overlap_weight: Option<f64>,
    /// Model name clients must send [default: the decode workers' model name].
    #[arg(long, env = "TANDEM_ROUTER_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// Requests running at once [default: 256].
    #[arg(long, env = "TANDEM_ROUTER_MAX_CONCURRENT_REQUESTS")]
    pub max_concurrent_requests: Option<usize>,
    /// Requests waiting for a running slot; beyond that, 429 [default: 512].
    #[arg(long, env = "TANDEM_ROUTER_MAX_QUEUED_REQUESTS")]
    pub max_queued_requests: Option<usize>,
    /// Longest a request waits for a running slot; beyond that, 429 with Retry-After
    /// [default: 30000; 0: until the request timeout].
    #[arg(long, env = "TANDEM_ROUTER_MAX_QUEUE_WAIT_MS")]
    pub max_queue_wait_ms: Option<u64>,
    /// Largest request body; larger gets 413 [default: 2000000].
    #[arg(long, env = "TANDEM_ROUTER_BODY_LIMIT_BYTES")]
    pub body_limit_bytes: Option<usize>,
    /// How long a decode worker keeps a reservation waiting for KV [default: 30000].
    #[arg(long, env = "TANDEM_ROUTER_LEASE_TTL_MS")]
    pub lease_ttl_ms: Option<u32>,
    /// Period of the workers' load and health poll [default: 1000].
    #[arg(long, env = "TANDEM_ROUTER_HEALTH_INTERVAL_MS")]
    pub health_interval_ms: Option<u64>,
    /// How often dns:// entries are resolved again to find workers that came or went
    /// [default: 5000].
    #[arg(long, env = "TANDEM_ROUTER_DNS_REFRESH_MS")]
    pub dns_refresh_ms: Option<u64>,
    /// Whole-request deadline, queueing included; 0 disables [default: 600].
    #[arg(long, env = "TANDEM_ROUTER_REQUEST_TIMEOUT_S")]
    pub request_timeout_s: Option<u64>,
    /// How long to wait at startup for a decode worker to hand over the tokenizer
    /// [default: 120].
    #[arg(long, env = "TANDEM_ROUTER_STARTUP_TIMEOUT_S")]
    pub startup_timeout_s: Option<u64>,
    /// On Ctrl-C/SIGTERM, how long running requests may finish before they are cut
    /// [default: 30].
    #[arg(long, env = "TANDEM_ROUTER_SHUTDOWN_GRACE_S")]
    pub shutdown_grace_s: Option<u64>,
    /// Bearer token required on /v1/* and the TGI routes (/health and /metrics stay open).
    #[arg(long, env = "TANDEM_API_KEY", hide_env_values = true)]
    #[serde(skip_serializing)]
    pub api_key: Option<String>,
    // Flags and environment only, not the file (the launcher sets it for every process).
    #[command(flatten)]
    #[serde(skip_deserializing)]
    pub log: LogArgs,
    /// Close a client connection that has not sent a whole request head within this long,
    /// idle keep-alive connections included [default: 10000].
    #[arg(long, env = "TANDEM_ROUTER_HEADER_READ_TIMEOUT_MS")]
    pub header_read_timeout_ms: Option<u64>,
    /// Answer 408 to a request whose body has not fully arrived within this long
    /// [default: 30000].
    #[arg(long, env = "TANDEM_ROUTER_BODY_READ_TIMEOUT_MS")]
    pub body_read_timeout_ms: Option<u64>,
    /// Client connections open at once; more are closed as they arrive [default: 1024].
    #[arg(long, env = "TANDEM_ROUTER_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// A stream with nothing to send for this long gets an SSE comment (`: keep-alive`),
    /// also before its first token; 0 disables [default: 15000].
    #[arg(long, env = "TANDEM_ROUTER_SSE_KEEPALIVE_MS")]
    pub sse_keepalive_ms: Option<u64>,
    /// The credentials for the workers' internal services (environment, files, flags only).
    #[command(flatten)]
    #[serde(skip_deserializing)]
    pub internal: InternalAuthArgs,
}
