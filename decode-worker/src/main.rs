//! `tandem-decode`: parses flags, loads the model, and runs the decode worker.

use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use tandem_cli::DecodeArgs as Args;
use tandem_decode::{DecodeConfig, DecodeWorker, serve};
use tandem_engine::EngineConfig;
use tandem_transfer::TcpLimits;
use tandem_worker::Opened;

fn main() -> anyhow::Result<()> {
    tandem_worker::run_worker(Args::parse, |a| (&a.server, &a.engine), 7201, run)
}

async fn run(args: Args, engine_config: EngineConfig, opened: Opened) -> anyhow::Result<()> {
    let Opened {
        mut shutdown,
        auth,
        grpc,
    } = opened;
    let kv = if args.no_kv_tcp {
        None
    } else {
        Some(
            tandem_worker::bind(&args.server, args.kv_tcp_port)
                .await
                .context("binding the KV port")?,
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
            tandem_worker::shm_dir(&args.server)
        },
        default_lease_ttl: Duration::from_millis(args.lease_ttl_ms),
        drain_timeout: Duration::from_secs(args.drain_timeout_s),
        max_lease_ttl: Duration::from_millis(args.max_lease_ttl_ms),
        max_lease_lifetime: Duration::from_secs(args.max_lease_lifetime_s),
        caller_lease_share: args.caller_lease_share,
        reserve_wait: Duration::from_millis(args.reserve_wait_ms),
        lend_slack: args.lend_slack,
        calibration_tokens: args.engine.calibration_tokens,
        kv_tcp: TcpLimits {
            max_connections: args.kv_tcp_max_connections.max(1),
            hello_timeout: Duration::from_millis(args.kv_tcp_hello_timeout_ms),
            read_timeout: Duration::from_millis(args.kv_tcp_read_timeout_ms),
        },
        auth,
        ..DecodeConfig::default()
    };
    let Some((model, tokenizer)) = tandem_worker::load_model_until(&args.model, &mut shutdown)
        .await
        .context("loading the model")?
    else {
        return Ok(());
    };
    let worker = DecodeWorker::new(model, tokenizer, engine_config, config, kv_port)
        .context("starting the engine")?;
    if !worker.calibrated_until(&mut shutdown).await {
        return Ok(());
    }
    tracing::info!(grpc = %local, kv_tcp_port = kv_port, "decode worker ready");
    serve(worker, grpc, kv, shutdown).await?;
    tracing::info!("decode worker stopped");
    Ok(())
}
