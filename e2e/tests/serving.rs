//! The whole system through the router: the correctness gate (disaggregated output equals
//! aggregated output token for token and logprob for logprob, for every transport, at
//! concurrency 1 and 16 on the tiny models, 16 on SmolLM2), cancellation, a decode worker dying mid-stream, and bad input
//! on a real deployment.

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{Value, json};
use tandem_e2e::{Completion, Deployment, DeploymentSpec, Proc, blocks_in_use, greedy_completion};

/// Mixed prompt lengths (1 to `max_len` tokens) as token-id arrays, so lengths are exact.
fn prompts(n: usize, max_len: u32, vocab: u32) -> Vec<Vec<u32>> {
    (0..n as u32)
        .map(|i| {
            let len = 1 + (i * 37 + i * i * 11) % max_len;
            (0..len)
                .map(|j| 3 + (i * 131 + j * 17) % (vocab - 3))
                .collect()
        })
        .collect()
}

/// Runs every prompt through `base` with `concurrency` requests in flight.
async fn run_all(
    base: &str,
    prompts: &[Vec<u32>],
    max_tokens: u32,
    concurrency: usize,
) -> Vec<Completion> {
    let client = reqwest::Client::new();
    futures::stream::iter(prompts.iter().map(|p| async {
        greedy_completion(&client, base, p, max_tokens)
            .await
            .unwrap()
    }))
    .buffered(concurrency)
    .collect()
    .await
}

async fn correctness_gate(
    model: &str,
    n: usize,
    max_len: u32,
    vocab: u32,
    max_tokens: u32,
    concurrencies: &[usize],
) {
    let tiny = model.contains("tiny");
    // A sliding-window model ships only the blocks its first decode step reads.
    let window_kv_bytes = (model == "dummy:tiny-window").then(|| {
        let cfg = tandem_engine::config::ModelConfig::preset("tiny-window").unwrap();
        let block = 2 * cfg.kv_width() * tandem_kv::BLOCK_SIZE * 4 * cfg.num_hidden_layers;
        // A 48-key window spans at most four blocks.
        (4 * block) as u64
    });
    let spec = DeploymentSpec {
        model: model.into(),
        kv_budget_mb: if tiny { 32 } else { 512 },
        ..DeploymentSpec::default()
    };
    let dep = Deployment::start(&spec).await.unwrap();
    let agg = dep.aggregated_router().await.unwrap();
    let agg_base = format!("http://127.0.0.1:{}", agg.port);
    let prompts = prompts(n, max_len, vocab);
    let reference = run_all(&agg_base, &prompts, max_tokens, 1).await;
    for r in &reference {
        assert_eq!(r.mode, "aggregated");
        assert_eq!(r.usage["tandem"]["kv_bytes"], 0);
    }
    for transport in ["shm", "tcp", "grpc"] {
        let router = Deployment::router_for(&dep.prefill, &dep.decode, transport, &[]).unwrap();
        let base = format!("http://127.0.0.1:{}", router.port);
        tandem_e2e::wait_http_ok(&format!("{base}/health"), Duration::from_secs(60))
            .await
            .unwrap();
        for &concurrency in concurrencies {
            let got = run_all(&base, &prompts, max_tokens, concurrency).await;
            for (i, (got, want)) in got.iter().zip(&reference).enumerate() {
                assert_eq!(got.mode, "disaggregated", "{transport} prompt {i}");
                assert_eq!(got.usage["tandem"]["transport"], transport);
                let kv_bytes = got.usage["tandem"]["kv_bytes"].as_u64().unwrap_or(0);
                assert!(kv_bytes > 0);
                if let Some(most) = window_kv_bytes {
                    assert!(kv_bytes <= most, "prompt {i}: {kv_bytes} bytes moved");
                }
                assert_eq!(
                    got.usage["completion_tokens"],
                    want.usage["completion_tokens"]
                );
                assert_eq!(
                    got.text,
                    want.text,
                    "{model}: prompt {i} ({} tokens) over {transport} at concurrency {concurrency}",
                    prompts[i].len()
                );
                // Logprobs and alternatives too, bit for bit (the first token's were
                // computed by the prefill worker and carried with the KV commit).
                assert_eq!(
                    got.logprobs, want.logprobs,
                    "{model}: prompt {i} logprobs over {transport}"
                );
            }
        }
    }
    // CPU workers cannot move KV device to device: a cuda-ipc or nccl router pairs none of
    // them and says so on every response (aggregated, with the reason), instead of degrading
    // silently.
    for transport in ["cuda-ipc", "nccl"] {
        let router = Deployment::router_for(&dep.prefill, &dep.decode, transport, &[]).unwrap();
        let base = format!("http://127.0.0.1:{}", router.port);
        tandem_e2e::wait_http_ok(&format!("{base}/health"), Duration::from_secs(60))
            .await
            .unwrap();
        let got = run_all(&base, &prompts[..2], max_tokens, 1).await;
        for (got, want) in got.iter().zip(&reference) {
            assert_eq!(got.mode, "aggregated", "{transport}");
            assert_eq!(got.usage["tandem"]["fallback_reason"], "no_prefill_worker");
            assert!(got.usage["tandem"]["transport"].is_null());
            assert_eq!(got.text, want.text);
        }
    }
    for d in &dep.decode {
        assert_eq!(
            blocks_in_use(&d.endpoint(), true).await.unwrap(),
            0,
            "decode blocks back to baseline"
        );
    }
    for p in &dep.prefill {
        assert_eq!(
            blocks_in_use(&p.endpoint(), false).await.unwrap(),
            0,
            "prefill blocks back to baseline"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn correctness_gate_tiny() {
    correctness_gate("tiny", 50, 300, 259, 16, &[1, 16]).await;
}

/// Prompts up to 300 tokens through a 48-key window: the decode side reserves and receives
/// only the window's blocks, and still gives the aggregated engine's tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn correctness_gate_sliding_window() {
    correctness_gate("dummy:tiny-window", 20, 300, 259, 24, &[1, 16]).await;
}

/// The real model's numbers through every transport, 16 requests in flight (mixed batches):
/// one request at a time is the tiny model's part of the gate, which runs the same code
/// paths in a fraction of the time (this test was most of CI's end-to-end minutes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn correctness_gate_smollm2() {
    correctness_gate("smollm2", 32, 120, 49152, 8, &[16]).await;
}

async fn wait_baseline(dep: &Deployment, within: Duration) -> Duration {
    let start = Instant::now();
    loop {
        let mut used = 0;
        for d in &dep.decode {
            used += blocks_in_use(&d.endpoint(), true).await.unwrap_or(0);
        }
        for p in &dep.prefill {
            used += blocks_in_use(&p.endpoint(), false).await.unwrap_or(0);
        }
        if used == 0 {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < within,
            "{used} blocks still in use after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnects_free_blocks_on_both_workers() {
    let dep = Deployment::start(&DeploymentSpec::default()).await.unwrap();
    let client = reqwest::Client::new();
    // Mid-stream: read a few chunks of a long generation, then hang up.
    let body = json!({"model": "tandem", "prompt": "hello there, tell me a long story", "max_tokens": 3000, "stream": true, "ignore_eos": true});
    let resp = client
        .post(dep.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    for _ in 0..3 {
        stream.next().await.unwrap().unwrap();
    }
    assert!(
        blocks_in_use(&dep.decode[0].endpoint(), true)
            .await
            .unwrap()
            > 0
    );
    drop(stream);
    let took = wait_baseline(&dep, Duration::from_secs(1)).await;
    eprintln!("mid-stream disconnect: blocks back in {took:?}");

    // During a long prefill: hang up before the first token.
    let long: Vec<u32> = (0..8000u32).map(|i| 3 + i % 250).collect();
    let body = json!({"model": "tandem", "prompt": long, "max_tokens": 4, "stream": true});
    let pending = tokio::spawn({
        let client = client.clone();
        let url = dep.url("/v1/completions");
        async move { client.post(url).json(&body).send().await }
    });
    // Hang up once the request holds blocks (its lease on the decode worker, then the prompt's
    // chunks on the prefill worker), not after a guess at how long that takes.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut used = 0;
        for d in &dep.decode {
            used += blocks_in_use(&d.endpoint(), true).await.unwrap_or(0);
        }
        if used > 0 || pending.is_finished() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the long prompt never reserved blocks"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    pending.abort();
    let took = wait_baseline(&dep, Duration::from_secs(2)).await;
    eprintln!("disconnect during prefill: blocks back in {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_decode_worker_ends_its_streams_with_an_error_and_routes_around_it() {
    let spec = DeploymentSpec {
        decode: 2,
        ..DeploymentSpec::default()
    };
    let mut dep = Deployment::start(&spec).await.unwrap();
    let client = reqwest::Client::new();
    let body = json!({"model": "tandem", "prompt": "stream for a while", "max_tokens": 20000, "stream": true, "ignore_eos": true});
    // Two long streams: the router spreads them over both decode workers.
    let mut streams = Vec::new();
    for _ in 0..2 {
        let resp = client
            .post(dep.url("/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let mut s = resp.bytes_stream();
        s.next().await.unwrap().unwrap();
        streams.push(s);
    }
    let victim_running = |d: &Proc| d.endpoint();
    let victim = victim_running(&dep.decode[0]);
    assert!(
        blocks_in_use(&victim, true).await.unwrap() > 0,
        "both workers should hold a stream"
    );
    dep.decode[0].kill();
    let killed_at = Instant::now();
    // One stream must end with an explicit error event within 2 s; the other keeps going.
    let mut errored = 0;
    for mut s in streams {
        let deadline = killed_at + Duration::from_secs(2);
        let mut text = String::new();
        while Instant::now() < deadline {
            match tokio::time::timeout(deadline - Instant::now(), s.next()).await {
                Ok(Some(Ok(chunk))) => {
                    text.push_str(&String::from_utf8_lossy(&chunk));
                    // The error event may arrive split over chunks: read it whole.
                    if text.contains("\"error\"")
                        && (text.contains("[DONE]") || text.ends_with("\n\n"))
                    {
                        break;
                    }
                }
                Ok(Some(Err(_))) | Ok(None) => break,
                Err(_) => break,
            }
        }
        if text.contains("\"error\"") {
            errored += 1;
            assert!(
                text.contains("[DONE]") || text.trim_end().ends_with('}'),
                "{text}"
            );
        }
    }
    assert_eq!(
        errored, 1,
        "exactly the stream on the dead worker ends with an error event"
    );
    // The next requests succeed on the survivor.
    for _ in 0..5 {
        let resp = client
            .post(dep.url("/v1/completions"))
            .json(&json!({"model": "tandem", "prompt": "after the crash", "max_tokens": 4}))
            .send()
            .await
            .unwrap();
        assert_eq!(
            resp.status(),
            200,
            "{}",
            resp.text().await.unwrap_or_default()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_on_a_real_deployment() {
    let dep = Deployment::start(&DeploymentSpec::default()).await.unwrap();
    let client = reqwest::Client::new();
    let post = |path: &str, body: Vec<u8>, ct: &str| {
        client
            .post(dep.url(path))
            .header("content-type", ct.to_string())
            .body(body)
            .send()
    };
    let j = |v: Value| serde_json::to_vec(&v).unwrap_or_default();
    let cases: Vec<(&str, Vec<u8>, u16)> = vec![
        (
            "/v1/completions",
            j(json!({"model": "tandem", "prompt": ""})),
            400,
        ),
        (
            "/v1/completions",
            j(json!({"model": "tandem", "prompt": "x", "max_tokens": 1_000_000})),
            400,
        ),
        (
            "/v1/completions",
            j(json!({"model": "tandem", "prompt": "x", "temperature": -1})),
            400,
        ),
        (
            "/v1/completions",
            j(json!({"model": "tandem", "prompt": "x", "top_p": 1.5})),
            400,
        ),
        (
            "/v1/completions",
            j(json!({"model": "nope", "prompt": "x"})),
            404,
        ),
        ("/v1/completions", b"{not json".to_vec(), 400),
        (
            "/v1/completions",
            j(json!({"model": "tandem", "prompt": 42})),
            400,
        ),
        ("/v1/completions", vec![0xff, 0xfe, 0x00], 400),
        (
            "/v1/chat/completions",
            j(json!({"model": "tandem", "messages": []})),
            400,
        ),
        (
            "/generate",
            j(json!({"inputs": "", "parameters": {"max_new_tokens": 4}})),
            422,
        ),
        (
            "/generate_stream",
            j(json!({"inputs": "x", "parameters": {"max_new_tokens": 0}})),
            422,
        ),
        ("/v1/completions", vec![b' '; 3 << 20], 413),
    ];
    for (path, body, status) in cases {
        let resp = post(path, body, "application/json").await.unwrap();
        assert_eq!(resp.status().as_u16(), status, "{path}");
        let v: Value = resp.json().await.unwrap_or(Value::Null);
        assert!(v.get("error").is_some(), "{path}: error body {v}");
    }
    // Nothing reached a worker.
    assert_eq!(
        blocks_in_use(&dep.decode[0].endpoint(), true)
            .await
            .unwrap(),
        0
    );
    // A fresh client: the 413 case may leave its pooled connection closed by the server.
    let metrics = reqwest::Client::new()
        .get(dep.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("tandem_"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_survive_a_long_prefill_queue() {
    // A lease much shorter than the queue: without the router's renewals the decode worker
    // would expire the reservations of prompts still waiting at the prefill worker.
    let spec = DeploymentSpec {
        router_args: vec!["--lease-ttl-ms".into(), "400".into()],
        ..DeploymentSpec::default()
    };
    let dep = Deployment::start(&spec).await.unwrap();
    let client = reqwest::Client::new();
    let started = Instant::now();
    let requests = (0..6u32).map(|i| {
        let prompt: Vec<u32> = (0..6000u32).map(|j| 3 + (i * 7 + j) % 250).collect();
        let body =
            json!({"model": "tandem", "prompt": prompt, "max_tokens": 2, "ignore_eos": true});
        client.post(dep.url("/v1/completions")).json(&body).send()
    });
    let responses = futures::future::join_all(requests).await;
    let waited = started.elapsed();
    for r in responses {
        let r = r.unwrap();
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
        assert_eq!(r.headers()["x-tandem-mode"], "disaggregated");
    }
    assert!(
        waited > Duration::from_millis(800),
        "the queue should outlast the lease ({waited:?})"
    );
    wait_baseline(&dep, Duration::from_secs(2)).await;
}

/// Conversations whose turns extend each other, through a deployment with prefix caching and
/// one without, each aggregated and disaggregated: every turn's greedy text and logprobs are
/// the same four times over, and with caching the later turns move only the blocks the
/// decode worker lacks and compute only what the prefill worker lacks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caching_on_and_off_give_the_same_turns_and_caching_moves_less() {
    let cached = Deployment::start(&DeploymentSpec::default()).await.unwrap();
    let uncached = Deployment::start(&DeploymentSpec {
        worker_args: vec!["--no-prefix-caching".into()],
        ..DeploymentSpec::default()
    })
    .await
    .unwrap();
    let agg_cached = cached.aggregated_router().await.unwrap();
    let agg_uncached = uncached.aggregated_router().await.unwrap();
    let bases = [
        cached.url(""),
        format!("http://127.0.0.1:{}", agg_cached.port),
        uncached.url(""),
        format!("http://127.0.0.1:{}", agg_uncached.port),
    ];
    let client = reqwest::Client::new();
    for conversation in 0..2u32 {
        let mut prompt: Vec<u32> = (0..70)
            .map(|j| 3 + (conversation * 57 + j * 13) % 250)
            .collect();
        for turn in 0..4u32 {
            let mut answers = Vec::new();
            for base in &bases {
                answers.push(greedy_completion(&client, base, &prompt, 12).await.unwrap());
            }
            for (i, a) in answers.iter().enumerate().skip(1) {
                let what = format!("conversation {conversation} turn {turn}, deployment {i}");
                assert_eq!(a.text, answers[0].text, "{what}");
                assert_eq!(a.logprobs, answers[0].logprobs, "{what}");
            }
            let (with, without) = (&answers[0], &answers[2]);
            assert_eq!(with.mode, "disaggregated");
            let blocks = prompt.len().div_ceil(16) as u64;
            assert_eq!(without.usage["tandem"]["kv_blocks"], blocks);
            assert_eq!(without.usage["tandem"]["cached_tokens"], 0);
            let moved = with.usage["tandem"]["kv_blocks"].as_u64().unwrap();
            let held = with.usage["tandem"]["decode_cached_tokens"]
                .as_u64()
                .unwrap();
            // The decode worker holds the previous turn's prompt (received, and computed
            // again by the aggregated run): the blocks after it move.
            let expected = match turn {
                0 => 0,
                _ => (prompt.len() as u64 - 30) / 16 * 16,
            };
            assert_eq!(held, expected, "turn {turn}");
            assert_eq!(moved, blocks - held / 16);
            assert_eq!(with.kv_bytes * blocks, without.kv_bytes * moved);
            if turn > 0 {
                // The prefill worker computed the previous turn's prompt.
                let hit = with.usage["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap();
                assert!(hit >= 64, "turn {turn}: {hit} cached tokens");
            }
            // The next turn: this prompt, 8 more tokens of "answer" and a new message.
            prompt.extend((0..30).map(|j| 3 + (turn * 7 + j * 11) % 250));
        }
    }
}
