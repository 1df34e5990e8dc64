//! `tandem-decode`: parses flags, loads the model, and runs the decode worker.

use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use tandem_decode::{DecodeConfig, DecodeWorker, serve};
use tandem_engine::EngineConfig;
use tandem_transfer::TcpLimits;
use tandem_worker::telemetry::{init_tracing, shutdown_signal};
use tandem_worker::{EngineArgs, ModelArgs, ServerArgs};
use tokio::net::TcpListener;

/// tandem's decode worker: receives KV from prefill workers and streams tokens.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    server: ServerArgs,
    /// Raw TCP port for KV transfer (0 picks a free one; `--no-kv-tcp` disables it).
    #[arg(long, env = "TANDEM_KV_TCP_PORT", default_value_t = 0)]
    kv_tcp_port: u16,
    /// Do not listen for raw TCP KV transfers.
    #[arg(long, env = "TANDEM_NO_KV_TCP")]
    no_kv_tcp: bool,
    /// KV TCP connections served at once; more are closed as they arrive.
    #[arg(long, env = "TANDEM_KV_TCP_MAX_CONNECTIONS", default_value_t = 256)]
    kv_tcp_max_connections: usize,
    /// How long a KV TCP connection may take to prove itself (ms).
    #[arg(long, env = "TANDEM_KV_TCP_HELLO_TIMEOUT_MS", default_value_t = 5_000)]
    kv_tcp_hello_timeout_ms: u64,
    /// How long a KV TCP transfer may stay silent (ms).
    #[arg(long, env = "TANDEM_KV_TCP_READ_TIMEOUT_MS", default_value_t = 30_000)]
    kv_tcp_read_timeout_ms: u64,
    /// Keep the KV pool in private memory (disables the shm transport).
    #[arg(long, env = "TANDEM_NO_SHM")]
    no_shm: bool,
    /// Default lease: how long a reservation waits for KV without progress (ms).
    #[arg(long, env = "TANDEM_LEASE_TTL_MS", default_value_t = 30_000)]
    lease_ttl_ms: u64,
    /// The longest wait without progress a caller may ask of a reservation (ms).
    #[arg(long, env = "TANDEM_MAX_LEASE_TTL_MS", default_value_t = 60_000)]
    max_lease_ttl_ms: u64,
    /// The longest a reservation may stay open, renewals included (s).
    #[arg(long, env = "TANDEM_MAX_LEASE_LIFETIME_S", default_value_t = 600)]
    max_lease_lifetime_s: u64,
    /// Share of the KV pool one caller (address) may hold in reservations awaiting KV.
    #[arg(long, env = "TANDEM_CALLER_LEASE_SHARE", default_value_t = 0.9)]
    caller_lease_share: f64,
    /// How long shutdown waits for running requests (s).
    #[arg(long, env = "TANDEM_DRAIN_TIMEOUT_S", default_value_t = 30)]
    drain_timeout_s: u64,
}

fn main() -> anyhow::Result<()> {
    // `ps` shows every process's command line to every user: the secret never goes there.
    tandem_auth::refuse_secret_on_command_line(std::env::args_os())?;
    let args = Args::parse();
    init_tracing(args.server.log_json);
    // Bad engine flags fail here, before the runtime starts or a model loads.
    let engine_config = args.engine.engine_config().map_err(anyhow::Error::msg)?;
    args.engine.init_compute().map_err(anyhow::Error::msg)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let result = runtime.block_on(run(args, engine_config));
    // A model load still running on a blocking thread (stopped during startup) must not
    // hold the exit.
    runtime.shutdown_timeout(Duration::from_secs(2));
    result
}

async fn run(args: Args, engine_config: EngineConfig) -> anyhow::Result<()> {
    // Listen for signals before anything can be left behind (the shared KV files).
    let mut shutdown = shutdown_signal();
    let auth = args
        .server
        .internal_auth()
        .context("internal authentication")?;
    let port = args.server.port.unwrap_or(7201);
    let grpc = TcpListener::bind((args.server.host.as_str(), port))
        .await
        .with_context(|| format!("binding {}:{port}", args.server.host))?;
    let kv = if args.no_kv_tcp {
        None
    } else {
        Some(
            TcpListener::bind((args.server.host.as_str(), args.kv_tcp_port))
                .await
                .with_context(|| format!("binding the KV port {}", args.kv_tcp_port))?,
        )
    };
    let kv_port = kv
        .as_ref()
        .map(|l| l.local_addr())
        .transpose()?
        .map_or(0, |a| a.port());
    let local = grpc.local_addr()?;
    let config = DecodeConfig {
        worker_id: args
            .server
            .worker_id
            .clone()
            .unwrap_or_else(|| format!("decode@{local}")),
        advertise_host: args.server.advertise_host.clone().unwrap_or_default(),
        shm_dir: if args.no_shm {
            None
        } else {
            args.server.shm_dir()
        },
        default_lease_ttl: Duration::from_millis(args.lease_ttl_ms),
        drain_timeout: Duration::from_secs(args.drain_timeout_s),
        max_lease_ttl: Duration::from_millis(args.max_lease_ttl_ms),
        max_lease_lifetime: Duration::from_secs(args.max_lease_lifetime_s),
        caller_lease_share: args.caller_lease_share,
        kv_tcp: TcpLimits {
            max_connections: args.kv_tcp_max_connections.max(1),
            hello_timeout: Duration::from_millis(args.kv_tcp_hello_timeout_ms),
            read_timeout: Duration::from_millis(args.kv_tcp_read_timeout_ms),
        },
        auth,
        ..DecodeConfig::default()
    };
    tracing::info!(model = %args.model.model, "loading model");
    let Some((model, tokenizer)) = args
        .model
        .load_until(&mut shutdown)
        .await
        .context("loading the model")?
    else {
        return Ok(());
    };
    let worker = DecodeWorker::new(model, tokenizer, engine_config, config, kv_port)
        .context("starting the engine")?;
    tracing::info!(grpc = %local, kv_tcp_port = kv_port, "decode worker ready");
    serve(worker, grpc, kv, shutdown).await?;
    tracing::info!("decode worker stopped");
    Ok(())
}
