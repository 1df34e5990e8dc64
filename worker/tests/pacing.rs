//! Step pacing through the engine actor: a decode worker that lends its slack runs its
//! streams' passes no faster than their TPOT target asks while another thread wants the CPU,
//! and every pass is fitted into the cost model the load report carries.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tandem_engine::config::{ModelConfig, WeightFormat};
use tandem_engine::model::dummy_model;
use tandem_engine::{Engine, EngineConfig, SamplingParams, StopParams};
use tandem_proto::v1::StepCost;
use tandem_text::TextTokenizer;
use tandem_worker::{EngineThreadOptions, SeqEvent, spawn_engine};
use tokio::sync::mpsc;

/// An engine on the tiny built-in model with `blocks` KV blocks and `config`'s other sizes.
fn tiny_engine(blocks: usize, config: EngineConfig) -> Engine {
    let model = Arc::new(
        dummy_model(
            ModelConfig::preset("tiny").unwrap(),
            WeightFormat::F32,
            0,
            "tiny",
        )
        .unwrap(),
    );
    let config = EngineConfig {
        kv_budget_bytes: blocks * model.kv_layout().block_bytes(),
        ..config
    };
    Engine::new(model, TextTokenizer::byte_level(), config).unwrap()
}

/// Streams of `tokens` tokens each under a TPOT target on an engine that does (not) lend
/// its slack: the mean time between a stream's tokens, and the cost model it reported.
async fn streams(lend_slack: bool, target: Duration, tokens: usize) -> (Duration, StepCost) {
    let engine = tiny_engine(64, EngineConfig::default());
    let options = EngineThreadOptions {
        lend_slack,
        calibration_tokens: 0,
    };
    let handle = spawn_engine(engine, options).unwrap();
    let mut receivers = Vec::new();
    for i in 0..2u32 {
        let (events, rx) = mpsc::unbounded_channel();
        let stop = StopParams {
            max_tokens: tokens,
            ignore_eos: true,
            ..Default::default()
        };
        let prompt = (0..20).map(|j| 3 + (i * 7 + j) % 200).collect();
        handle
            .add(
                prompt,
                SamplingParams::greedy(),
                stop,
                None,
                Some(target),
                events,
            )
            .await
            .unwrap();
        receivers.push(rx);
    }
    let mut first = None;
    let mut last = Instant::now();
    for mut rx in receivers {
        for _ in 0..tokens {
            match tokio::time::timeout(Duration::from_secs(30), rx.recv()).await {
                Ok(Some(SeqEvent::Token(_))) => {
                    last = Instant::now();
                    first.get_or_insert(last);
                }
                other => panic!("expected a token, got {other:?}"),
            }
        }
    }
    let first = first.unwrap_or(last);
    let gap = (last - first) / (tokens as u32 - 1);
    (gap, handle.load().cost.report())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lending_decode_worker_paces_its_streams_to_their_target() {
    let target = Duration::from_millis(40);
    // Someone who wants the CPU: more spinning threads than cores (slack is lent only to a
    // thread that waits).
    let stop = Arc::new(AtomicBool::new(false));
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let spinners: Vec<_> = (0..=cores)
        .map(|_| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        })
        .collect();
    let (gap, cost) = streams(true, target, 12).await;
    stop.store(true, Ordering::Relaxed);
    for s in spinners {
        let _ = s.join();
    }
    // Each pass is followed by the rest of 0.9 × the target idle: never faster.
    assert!(gap >= target.mul_f64(0.8), "{gap:?}");
    // Every pass was fitted and reported, and the fit prices a decode step (the passes of
    // one shape make the terms collinear: the fit may put a step's cost on any of them).
    assert!(
        cost.passes >= 11 && cost.base_ms + cost.per_row_ms + cost.per_mpair_ms > 0.0,
        "{cost:?}"
    );
    assert_eq!(cost.max_batch_tokens, 2048);
    // Without lending, or with nobody waiting for the CPU, the same streams run as fast as
    // the passes allow (a tiny model's pass takes well under a millisecond).
    let (free, _) = streams(false, target, 12).await;
    assert!(free < gap, "{free:?} vs {gap:?}");
    if std::fs::metadata("/proc/pressure/cpu").is_ok() {
        let (unwanted, _) = streams(true, target, 12).await;
        assert!(unwanted < gap, "{unwanted:?} vs {gap:?}");
    }
}

#[tokio::test]
async fn a_calibrated_worker_reports_a_cost_model_before_any_request() {
    let config = EngineConfig {
        max_batch_tokens: 512,
        ..Default::default()
    };
    let options = EngineThreadOptions {
        lend_slack: false,
        calibration_tokens: 1280,
    };
    let handle = spawn_engine(tiny_engine(512, config), options).unwrap();
    tokio::time::timeout(Duration::from_secs(60), handle.calibrated())
        .await
        .expect("calibration ends");
    let cost = handle.load().cost.report();
    // Priced from made-up passes alone: enough prompt tokens for a router to trust the
    // price (tandem_cost::MIN_PROMPT_TOKENS_SEEN), a decode step priced, nothing decoding.
    assert!(cost.passes >= 8, "{cost:?}");
    assert!(
        cost.prompt_tokens_seen >= tandem_cost::MIN_PROMPT_TOKENS_SEEN,
        "{cost:?}"
    );
    assert!(cost.per_token_ms + cost.per_mpair_ms > 0.0, "{cost:?}");
    // A tiny model's decode passes take microseconds beside its prompt passes' milliseconds:
    // the fit may put all of it on the prompt tokens (about one run in twelve on a 2-core
    // Zen 4), so what is asked is a model with no negative term, not a priced decode step.
    assert!(
        [
            cost.base_ms,
            cost.per_row_ms,
            cost.per_token_ms,
            cost.per_mpair_ms
        ]
        .iter()
        .all(|c| c.is_finite() && *c >= 0.0),
        "{cost:?}"
    );
    assert_eq!(cost.decode_rows, 0);
    assert_eq!(
        handle.load().steps.load(Ordering::Relaxed),
        0,
        "no pass counted"
    );
}
