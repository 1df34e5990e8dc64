//! A stand-alone fake OpenAI/TGI streaming server for `scripts/bench-client`: answers every
//! request with `max_tokens` synthetic token events at a fixed pace (or instantly), serves
//! `GET /stats` (peak open streams, token events sent), and stops by itself after
//! `--max-seconds` or on Ctrl-C/SIGTERM. Listens on 127.0.0.1 only.
//!
//! Usage: `fake_server [--port 0] [--ttft-ms 0] [--itl-ms 0] [--events-per-write 1]
//!         [--write-tokenizer PATH] [--tandem-usage] [--max-seconds 600]`; the first stdout line is
//! `listening on http://127.0.0.1:PORT`.

use std::io::Write;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use tandem_bench::fake_server::{FakeServer, SyntheticTiming, synthetic, synthetic_tandem};

#[derive(Debug, Parser)]
struct FakeServerArgs {
    /// Port on 127.0.0.1 (0 picks a free one).
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// Delay before the first token of each stream, in ms.
    #[arg(long, default_value_t = 0)]
    ttft_ms: u64,
    /// Delay between later tokens, in ms (0 = as fast as the socket takes them).
    #[arg(long, default_value_t = 0)]
    itl_ms: u64,
    /// Token events per network write.
    #[arg(long, default_value_t = 1)]
    events_per_write: usize,
    /// Also write the matching word-level tokenizer.json here.
    #[arg(long)]
    write_tokenizer: Option<std::path::PathBuf>,
    /// Report tandem's usage accounting (cached tokens from a simulated prefix cache, KV
    /// bytes and blocks), as tandem's router does.
    #[arg(long)]
    tandem_usage: bool,
    /// Stop by itself after this many seconds.
    #[arg(long, default_value_t = 600)]
    max_seconds: u64,
}

fn main() -> anyhow::Result<()> {
    let args = FakeServerArgs::parse();
    if let Some(path) = &args.write_tokenizer {
        std::fs::write(
            path,
            tandem_bench::tokenizer::word_level_tokenizer_json(1000),
        )
        .with_context(|| format!("cannot write {}", path.display()))?;
    }
    tandem_bench::raise_fd_limit();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", args.port))
            .await
            .context("cannot bind 127.0.0.1")?;
        let timing = SyntheticTiming {
            ttft: Duration::from_millis(args.ttft_ms),
            itl: Duration::from_millis(args.itl_ms),
            events_per_write: args.events_per_write,
        };
        let responder = if args.tandem_usage {
            synthetic_tandem(timing)
        } else {
            synthetic(timing)
        };
        let server = FakeServer::start_on(listener, responder)?;
        let mut stdout = std::io::stdout();
        writeln!(stdout, "listening on {}", server.base_url())?;
        stdout.flush()?;
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(args.max_seconds)) => {}
            _ = tokio::signal::ctrl_c() => {}
            _ = terminate.recv() => {}
        }
        eprintln!(
            "fake server stats: {}",
            serde_json::to_string(&server.stats())?
        );
        server.shutdown().await;
        Ok(())
    })
}
