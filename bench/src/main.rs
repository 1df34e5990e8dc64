//! `tandem-bench`: parses vLLM-compatible options, sets up logging on stderr, and runs the
//! benchmark from the library; blocks go to stdout.

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use tandem_bench::cli::BenchArgs;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let config = BenchArgs::parse()
        .into_config()
        .context("invalid options")?;
    tandem_bench::raise_fd_limit();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let mut stdout = std::io::stdout();
    let mut stderr = std::io::stderr();
    runtime
        .block_on(tandem_bench::run(&config, &mut stdout, &mut stderr))
        .context("benchmark failed")?;
    Ok(())
}
