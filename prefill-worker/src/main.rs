//! `tandem-prefill`: parses flags, loads the model, and runs the prefill worker.

use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use tandem_cli::PrefillArgs as Args;
use tandem_engine::EngineConfig;
use tandem_prefill::{PrefillConfig, PrefillWorker, serve};
use tandem_worker::Opened;

fn main() -> anyhow::Result<()> {
    tandem_worker::run_worker(Args::parse, |a| (&a.server, &a.engine), 7101, run)
}

async fn run(args: Args, engine_config: EngineConfig, opened: Opened) -> anyhow::Result<()> {
    let Opened {
        mut shutdown,
        auth,
        grpc,
    } = opened;
    let local = grpc.local_addr()?;
    let config = PrefillConfig {
        worker_id: args
            .server
            .worker_id
            .clone()
            .unwrap_or_else(|| format!("prefill@{local}")),
        drain_timeout: Duration::from_secs(args.drain_timeout_s),
        shm_dir: tandem_worker::shm_dir(&args.server),
        auth,
        pull_prefix: !args.no_prefix_pull,
        calibration_tokens: args.engine.calibration_tokens,
    };
    let Some((model, tokenizer)) = tandem_worker::load_model_until(&args.model, &mut shutdown)
        .await
        .context("loading the model")?
    else {
        return Ok(());
    };
    let worker = PrefillWorker::new(model, tokenizer, engine_config, config)
        .context("starting the engine")?;
    if !worker.calibrated_until(&mut shutdown).await {
        return Ok(());
    }
    tracing::info!(grpc = %local, "prefill worker ready");
    serve(worker, grpc, shutdown).await?;
    tracing::info!("prefill worker stopped");
    Ok(())
}
