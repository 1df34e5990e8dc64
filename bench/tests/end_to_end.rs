//! Whole runs against the fake server: in-process through `tandem_bench::run`, and through the
//! real `tandem-bench` binary. Checks block shapes (seed 002's headings and labels), sweeps
//! (blocks, summary, plot, result files), the TGI `book` path, concurrency limits, arrival
//! pacing, and failure handling.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::Arc;
use std::time::Duration;

use tandem_bench::fake_server::{
    FakeServer, ReceivedRequest, ScriptedEvent, ScriptedResponse, synthetic,
};
use tandem_bench::metrics::MetricKind;

mod common;
use common::{InProcess, timing, write_tokenizer};

const SEED_002: &str = include_str!("seeds/002_64bb5876f73a2969.txt");

/// Runs the binary with `args`, bounded in time.
fn run_binary(args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tandem-bench"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn tandem-bench");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("tandem-bench did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A server on its own runtime thread, so the blocking binary tests can talk to it.
struct BackgroundServer {
    server: Option<FakeServer>,
    runtime: tokio::runtime::Runtime,
}

impl BackgroundServer {
    fn start(responder: tandem_bench::fake_server::Responder) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let server = runtime.block_on(FakeServer::start(responder)).unwrap();
        Self {
            server: Some(server),
            runtime,
        }
    }

    fn server(&self) -> &FakeServer {
        self.server.as_ref().unwrap()
    }
}

impl Drop for BackgroundServer {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            self.runtime.block_on(server.shutdown());
        }
    }
}

/// The model and the request shape of the in-process runs that only count requests.
const SMALL_REQUESTS: [&str; 6] = [
    "--model",
    "m",
    "--random-input-len",
    "8",
    "--random-output-len",
    "2",
];

/// Label columns (first 41 bytes) of every line: the block's shape without its values.
fn shape(text: &str) -> Vec<String> {
    text.lines().map(|l| l.chars().take(41).collect()).collect()
}

#[test]
fn preset_pd_prints_seed_002_shape_under_headings() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = write_tokenizer(dir.path());
    let background = BackgroundServer::start(synthetic(timing(5, 2)));
    let base = background.server().base_url();
    let output = run_binary(&[
        "--base-url",
        &base,
        "--model",
        "fake-model",
        "--tokenizer",
        tokenizer.to_str().unwrap(),
        "--preset",
        "pd",
        "--num-prompts",
        "6",
        "--random-input-len",
        "40",
        "--random-output-len",
        "8",
        "--disable-tqdm",
    ]);
    let stdout = String::from_utf8(output.stdout).unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "stderr: {stderr}");
    assert_eq!(shape(&stdout), shape(SEED_002), "stdout:\n{stdout}");
    // Trailing spaces are kept: every row is exactly 51 columns or longer.
    assert!(stdout.contains("Successful requests:                     6         \n"));
    assert!(stdout.contains("Failed requests:                         0         \n"));
    // Prefill: 39-token prompts (40 minus BOS), one output token, so TPOT/ITL are zero.
    assert!(stdout.contains("Total input tokens:                      234       \n"));
    assert!(stdout.contains("Total generated tokens:                  6         \n"));
    assert!(stdout.contains("Mean TPOT (ms):                          0.00      \n"));
    // Decode: one-token prompts, 8 output tokens each.
    assert!(stdout.contains("Total input tokens:                      6         \n"));
    assert!(stdout.contains("Total generated tokens:                  48        \n"));
    for line in [
        "Starting initial single prompt test run...",
        "Initial test run completed.",
        "Starting main benchmark run...",
        "Traffic request rate: inf",
        "Burstiness factor: 1.0 (Poisson process)",
        "Maximum request concurrency: None",
    ] {
        assert!(
            stderr.contains(line),
            "missing {line:?} in stderr: {stderr}"
        );
    }
    let requests = background.server().requests();
    // Each phase: one test request plus six.
    assert_eq!(requests.len(), 14);
    let prefill = &requests[..7];
    let decode = &requests[7..];
    assert!(prefill.iter().all(|r| r.body["max_tokens"] == 1));
    assert!(
        decode
            .iter()
            .all(|r| r.body["max_tokens"] == 8 && r.body["ignore_eos"] == true)
    );
    assert!(
        decode
            .iter()
            .all(|r| r.body["prompt"].as_str().unwrap().split(' ').count() == 1)
    );
}

#[test]
fn num_prompts_sweep_prints_blocks_summary_plot_and_results() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = write_tokenizer(dir.path());
    let results = dir.path().join("results");
    let plot = dir.path().join("sweep.svg");
    let background = BackgroundServer::start(synthetic(timing(2, 1)));
    let base = background.server().base_url();
    let output = run_binary(&[
        "--base-url",
        &base,
        "--model",
        "org/fake-model",
        "--tokenizer",
        tokenizer.to_str().unwrap(),
        "--num-prompts",
        "1,2,...,8",
        "--random-input-len",
        "20",
        "--random-output-len",
        "4",
        "--ready-check-timeout-sec",
        "0",
        "--save-result",
        "--result-dir",
        results.to_str().unwrap(),
        "--metadata",
        "run=sweep",
        "--plot-file",
        plot.to_str().unwrap(),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
    ]);
    let stdout = String::from_utf8(output.stdout).unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "stderr: {stderr}");
    assert!(stderr.contains("Skipping endpoint ready check."));
    assert_eq!(stdout.matches(" Serving Benchmark Result ").count(), 4);
    // One blank line between blocks, as in seeds 001 and 003.
    assert_eq!(
        stdout
            .matches("==================================================\n\n============ Serving")
            .count(),
        3
    );
    for n in [1, 2, 4, 8] {
        assert!(stdout.contains(&format!(
            "Successful requests:                     {n:<10}\n"
        )));
    }
    assert!(stdout.contains("P50 E2EL (ms):"));
    let summary = stdout
        .split(" Sweep Summary ")
        .nth(1)
        .expect("summary table");
    let rows: Vec<Vec<&str>> = summary
        .lines()
        .skip(2)
        .take(4)
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        rows.iter().map(|r| r[0]).collect::<Vec<_>>(),
        ["1", "2", "4", "8"]
    );
    let svg = std::fs::read_to_string(&plot).expect("plot written");
    assert!(svg.contains("Time to first token") && svg.contains("Throughput"));
    let mut files: Vec<PathBuf> = std::fs::read_dir(&results)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert_eq!(files.len(), 4);
    let name = files[0].file_name().unwrap().to_str().unwrap().to_string();
    assert!(
        name.starts_with("openai-infqps-fake-model-") && name.ends_with(".json"),
        "{name}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&files[0]).unwrap()).unwrap();
    let keys: Vec<&str> = json
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let expected_start = [
        "date",
        "endpoint_type",
        "backend",
        "label",
        "model_id",
        "tokenizer_id",
        "num_prompts",
        "run",
        "request_rate",
        "burstiness",
        "max_concurrency",
        "duration",
        "completed",
        "failed",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "max_output_tokens_per_s",
        "max_concurrent_requests",
        "mean_ttft_ms",
        "median_ttft_ms",
        "std_ttft_ms",
        "p50_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
    ];
    assert_eq!(&keys[..expected_start.len()], expected_start);
    assert!(keys.contains(&"p99_e2el_ms"));
    assert_eq!(json["request_rate"], "inf");
    assert_eq!(json["run"], "sweep");
    assert!(json["request_goodput"].is_null());
}

#[test]
fn tgi_book_sweep_in_the_old_layout() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = write_tokenizer(dir.path());
    let book = dir.path().join("book.txt");
    let words: Vec<String> = (0..500).map(|i| format!("w{}", i % 200)).collect();
    std::fs::write(&book, words.join(" ")).unwrap();
    let background = BackgroundServer::start(synthetic(timing(2, 1)));
    let base = background.server().base_url();
    let output = run_binary(&[
        "--backend",
        "tgi",
        "--endpoint",
        "/generate_stream",
        "--base-url",
        &base,
        "--model",
        "m",
        "--tokenizer",
        tokenizer.to_str().unwrap(),
        "--dataset-name",
        "book",
        "--dataset-path",
        book.to_str().unwrap(),
        "--book-input-len",
        "50",
        "--book-output-len",
        "5",
        "--num-prompt=2,4,...,16",
        "--layout",
        "old",
        "--ready-check-timeout-sec",
        "0",
        "--disable-tqdm",
        "--no-plot",
    ]);
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(!stdout.contains("Failed requests") && !stdout.contains("Peak"));
    assert!(stdout.contains("Total Token throughput (tok/s):"));
    // 2, 4, 8 prompts, then the book's 10 windows cap the 16.
    for (n, input) in [(2, 102), (4, 204), (8, 408), (10, 510)] {
        assert!(
            stdout.contains(&format!(
                "Successful requests:                     {n:<10}\n"
            )),
            "{stdout}"
        );
        assert!(stdout.contains(&format!(
            "Total input tokens:                      {input:<10}\n"
        )));
    }
    let requests = background.server().requests();
    assert!(requests.iter().all(|r| r.path == "/generate_stream"));
    assert!(
        requests
            .iter()
            .all(|r| r.body["parameters"]["ignore_eos_token"] == false)
    );
    assert_eq!(
        requests[0].body["inputs"]
            .as_str()
            .unwrap()
            .split(' ')
            .count(),
        50
    );
}

#[test]
fn failing_servers_fail_requests_or_abort_the_initial_test() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = write_tokenizer(dir.path());
    let failing = Arc::new(|_: &ReceivedRequest| ScriptedResponse {
        status: 503,
        events: vec![ScriptedEvent::new(Duration::ZERO, "overloaded", 0)],
    });
    let background = BackgroundServer::start(failing);
    let base = background.server().base_url();
    let tokenizer = tokenizer.to_str().unwrap();
    let common = [
        "--base-url",
        &base,
        "--model",
        "m",
        "--tokenizer",
        tokenizer,
        "--num-prompts",
        "3",
        "--random-input-len",
        "10",
        "--disable-tqdm",
    ];
    let mut args = common.to_vec();
    args.extend(["--ready-check-timeout-sec", "0"]);
    let output = run_binary(&args);
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(output.status.success());
    assert!(stdout.contains("Successful requests:                     0         \n"));
    assert!(stdout.contains("Failed requests:                         3         \n"));
    assert!(stdout.contains("Mean TTFT (ms):                          0.00      \n"));
    let mut args = common.to_vec();
    args.extend(["--ready-check-timeout-sec", "1"]);
    let output = run_binary(&args);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("Initial test run failed - Please make sure benchmark arguments are correctly specified. Error: Service Unavailable"),
        "{stderr}"
    );
    assert!(output.stdout.is_empty());
    let output = run_binary(&["--backend", "openai-chat", "--model", "m"]);
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("must end with 'chat/completions'"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_reflect_the_server_timing_and_the_concurrency_cap() {
    let bench = InProcess::start(synthetic(timing(40, 10))).await;
    // No --model: asked from /v1/models, as vLLM 0.13 does.
    let (summary, stdout) = bench
        .run(&[
            "--num-prompts",
            "8",
            "--max-concurrency",
            "2",
            "--random-input-len",
            "12",
            "--random-output-len",
            "6",
        ])
        .await;
    let block = &summary.blocks[0];
    assert_eq!(stdout, block.block);
    assert!(stdout.contains("Maximum request concurrency:             2         \n"));
    let m = &block.metrics;
    assert_eq!(
        (m.completed, m.failed, m.total_input, m.total_output),
        (8, 0, 88, 48)
    );
    // What a slow machine cannot change: the server waits 40 ms before a stream's first token
    // and 10 ms before each of the other five, and the client sees each no earlier, so a
    // request's TTFT is at least 40 ms and its E2EL at least 90 ms (no upper bound holds).
    let ttft = m.stats(MetricKind::Ttft);
    let tpot = m.stats(MetricKind::Tpot);
    let itl = m.stats(MetricKind::Itl);
    let e2el = m.stats(MetricKind::E2el);
    assert!(ttft.mean >= 40.0, "ttft {}", ttft.mean);
    assert!(e2el.mean >= 90.0, "e2el {}", e2el.mean);
    // vLLM's math, whatever the timing: each of the 6-token outputs has TPOT = (E2EL - TTFT) / 5
    // and five ITLs that sum to E2EL - TTFT, so both means are (mean E2EL - mean TTFT) / 5.
    let per_token = (e2el.mean - ttft.mean) / 5.0;
    assert!((tpot.mean - per_token).abs() < 1e-6, "tpot {tpot:?}");
    assert!((itl.mean - per_token).abs() < 1e-6, "itl {itl:?}");
    // Start times are taken after a slot frees, so queueing is in neither TTFT nor E2EL: with
    // at most two requests running at any moment, all within the run, their E2ELs add up to
    // at most twice its duration (counting the queueing would make it about five times). And
    // the eight requests of at least 90 ms each, two at a time, take at least four waves.
    let duration_ms = block.duration * 1000.0;
    assert!(
        8.0 * e2el.mean <= 2.0 * duration_ms,
        "e2el {} over a {duration_ms} ms run",
        e2el.mean
    );
    assert!(block.duration >= 4.0 * 0.09, "duration {}", block.duration);
    // The cap, as the server saw it (how many overlapped is up to the machine's timing).
    let peak = bench.server.stats().peak_streams;
    assert!((1..=2).contains(&peak), "peak streams {peak}");
    // vLLM's one-second buckets count every request touching a second. Each request touches
    // one of the run's ceil(duration) + 1 seconds at least, so one second counts 8 / that
    // many (all 8 when the run fits in a second, as it does on an idle machine).
    let seconds = block.duration.ceil() + 1.0;
    assert!(
        m.max_concurrent_requests as f64 * seconds >= 8.0,
        "{} over {seconds} s",
        m.max_concurrent_requests
    );
    assert!(
        bench
            .server
            .requests()
            .iter()
            .all(|r| r.body["model"] == "fake-model")
    );
    bench.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_rate_paces_arrivals_and_goodput_is_reported() {
    let bench = InProcess::start(synthetic(timing(1, 1))).await;
    let (summary, stdout) = bench
        .run(
            &[
                SMALL_REQUESTS.as_slice(),
                &[
                    "--num-prompts",
                    "10",
                    "--request-rate",
                    "20",
                    "--burstiness",
                    "inf",
                    "--goodput",
                    "ttft:5000",
                    "e2el:0",
                    "--num-warmups",
                    "2",
                ],
            ]
            .concat(),
        )
        .await;
    let block = &summary.blocks[0];
    // Uniform arrivals every 50 ms, the last at N / rate = 0.5 s: the run cannot end sooner
    // (a slow machine only ends it later; the schedule itself is `runner`'s unit tests').
    assert!(block.duration >= 0.5, "duration {}", block.duration);
    assert!(stdout.contains("Request rate configured (RPS):           20.00     \n"));
    // e2el:0 is impossible to meet: goodput 0.
    assert!(
        stdout.contains("Request goodput (req/s):                 0.00      \n"),
        "{stdout}"
    );
    assert_eq!(block.metrics.request_goodput, Some(0.0));
    // Two warmup copies of sample 0 went first; they are not part of the block.
    let requests = bench.server.requests();
    assert_eq!(requests.len(), 12);
    assert_eq!(requests[0].body["prompt"], requests[1].body["prompt"]);
    assert_eq!(block.metrics.completed, 10);
    bench.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_concurrency_list_sweeps_that_option() {
    let bench = InProcess::start(synthetic(timing(1, 1))).await;
    let (summary, stdout) = bench
        .run(
            &[
                SMALL_REQUESTS.as_slice(),
                &[
                    "--num-prompts",
                    "4",
                    "--max-concurrency",
                    "1,2",
                    "--no-plot",
                ],
            ]
            .concat(),
        )
        .await;
    let limits: Vec<Option<usize>> = summary.blocks.iter().map(|b| b.max_concurrency).collect();
    assert_eq!(limits, [Some(1), Some(2)]);
    assert!(stdout.contains("Maximum request concurrency:             1         \n"));
    assert!(stdout.contains("Maximum request concurrency:             2         \n"));
    let table = stdout.split(" Sweep Summary ").nth(1).expect("summary");
    assert!(table.contains("max_concurrency"));
    assert!(summary.plot_files.is_empty());
    bench.shutdown().await;
}
