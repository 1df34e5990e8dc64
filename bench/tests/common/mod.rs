//! What the run tests share (`end_to_end`, `multi_turn`): the fake server's timing, a
//! word-level tokenizer file, and whole in-process `tandem_bench::run`s against a fake server
//! ([`InProcess`]), bounded in time.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use tandem_bench::cli::BenchArgs;
use tandem_bench::fake_server::{FakeServer, Responder, SyntheticTiming};
use tandem_bench::tokenizer::word_level_tokenizer_json;

/// The synthetic server's delays: `ttft_ms` before the first token, `itl_ms` between tokens.
pub fn timing(ttft_ms: u64, itl_ms: u64) -> SyntheticTiming {
    SyntheticTiming {
        ttft: Duration::from_millis(ttft_ms),
        itl: Duration::from_millis(itl_ms),
        events_per_write: 1,
    }
}

/// A 200-word tokenizer (`w0` … `w199`) written to `dir/tokenizer.json`.
pub fn write_tokenizer(dir: &Path) -> PathBuf {
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, word_level_tokenizer_json(200)).unwrap();
    path
}

/// What an in-process run needs: a fake server, and a tokenizer file in a temporary folder.
pub struct InProcess {
    pub server: FakeServer,
    tokenizer: PathBuf,
    _dir: tempfile::TempDir,
}

impl InProcess {
    /// Starts a fake server answering with `responder`.
    pub async fn start(responder: Responder) -> Self {
        let dir = tempfile::tempdir().unwrap();
        Self {
            server: FakeServer::start(responder).await.unwrap(),
            tokenizer: write_tokenizer(dir.path()),
            _dir: dir,
        }
    }

    /// Runs the benchmark in-process against the server with `extra` flags (no ready check,
    /// no progress bar), and returns its summary and stdout. A run that hangs fails the test.
    pub async fn run(&self, extra: &[&str]) -> (tandem_bench::RunSummary, String) {
        let base = self.server.base_url();
        let mut argv = vec![
            "tandem-bench",
            "--base-url",
            &base,
            "--tokenizer",
            self.tokenizer.to_str().unwrap(),
            "--ready-check-timeout-sec",
            "0",
            "--disable-tqdm",
        ];
        argv.extend_from_slice(extra);
        let config = BenchArgs::parse_from(argv).into_config().unwrap();
        let mut out = Vec::new();
        let mut log = Vec::new();
        let summary = tokio::time::timeout(
            Duration::from_secs(60),
            tandem_bench::run(&config, &mut out, &mut log),
        )
        .await
        .expect("run finished in time")
        .expect("run succeeded");
        (summary, String::from_utf8(out).unwrap())
    }

    pub async fn shutdown(self) {
        self.server.shutdown().await;
    }
}
