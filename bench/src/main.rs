//! `tandem-bench`: parses vLLM-compatible options, sets up logging on stderr, and runs the
//! benchmark from the library; blocks go to stdout.

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use tandem_bench::cli::BenchArgs;
use tandem_cli::LogFormat;

fn main() -> ExitCode {
    let args = BenchArgs::parse();
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        );
    match args.log.log_format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: BenchArgs) -> anyhow::Result<()> {
    let config = args.into_config().context("invalid options")?;
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
