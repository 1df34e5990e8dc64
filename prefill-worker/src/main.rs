//! `tandem-prefill`: parses flags, loads the model, and runs the prefill worker.

use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use tandem_cli::PrefillArgs as Args;
use tandem_engine::EngineConfig;
use tandem_prefill::{PrefillConfig, PrefillWorker, serve};
use tandem_worker::telemetry::shutdown_signal;

fn main() -> anyhow::Result<()> {
    // `ps` shows every process's command line to every user: the secret never goes there.
    tandem_auth::refuse_secret_on_command_line(std::env::args_os())?;
    tandem_worker::run_worker(Args::parse(), |a| (&a.server, &a.engine), run)
}

async fn run(args: Args, engine_config: EngineConfig) -> anyhow::Result<()> {
    let mut shutdown = shutdown_signal();
    let auth = tandem_worker::internal_auth(&args.server).context("internal authentication")?;
    let grpc = tandem_worker::bind(&args.server, args.server.port.unwrap_or(7101)).await?;
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
    };
    tracing::info!(model = %args.model.model, "loading model");
    let Some((model, tokenizer)) = tandem_worker::load_model_until(&args.model, &mut shutdown)
        .await
        .context("loading the model")?
    else {
        return Ok(());
    };
    let worker = PrefillWorker::new(model, tokenizer, engine_config, config)
        .context("starting the engine")?;
    tracing::info!(grpc = %local, "prefill worker ready");
    serve(worker, grpc, shutdown).await?;
    tracing::info!("prefill worker stopped");
    Ok(())
}
