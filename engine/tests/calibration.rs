//! Start-up calibration on the tiny built-in model: passes of several shapes are reported,
//! and the engine comes out of it as it went in (no sequence, no block held or cached, the
//! counters untouched, the same tokens for a request as on a fresh engine).

use std::time::Duration;

mod common;
use common::{engine, greedy, greedy_tokens, prompt, run_alone, tiny_model as model};
use tandem_engine::engine::EngineStats;
use tandem_engine::engine::StepShape;

#[test]
fn calibration_reports_passes_of_several_shapes_and_leaves_no_trace() {
    let model = model();
    // 256-token passes: the longest made-up prompt runs in chunks.
    let mut e = engine(&model, 512);
    let mut seen: Vec<StepShape> = Vec::new();
    let run = e
        .calibrate(1280, Duration::from_secs(60), &mut |shape, elapsed| {
            assert!(elapsed > Duration::ZERO);
            seen.push(*shape);
        })
        .unwrap();
    assert_eq!(run.passes, seen.len() as u64);
    let prompt_tokens: f64 = seen.iter().map(|s| s.other_tokens).sum();
    assert_eq!(run.prompt_tokens, prompt_tokens as u64);
    // Enough prompt tokens for a fit to price them (tandem_cost::MIN_PROMPT_TOKENS_SEEN),
    // with margin for its decay.
    assert!(
        prompt_tokens >= 1.1 * tandem_cost::MIN_PROMPT_TOKENS_SEEN,
        "{prompt_tokens}"
    );
    // Decode passes of one row and of several, prompt passes of several lengths, and a
    // chunk that starts past the beginning of its prompt (more attention per token).
    let decode_rows: Vec<f64> = seen
        .iter()
        .filter(|s| s.other_tokens == 0.0)
        .map(|s| s.sampled_rows)
        .collect();
    assert!(
        decode_rows.contains(&1.0) && decode_rows.contains(&8.0),
        "{seen:?}"
    );
    let mut chunk_lengths: Vec<u64> = seen
        .iter()
        .filter(|s| s.other_tokens > 100.0)
        .map(|s| s.other_tokens as u64)
        .collect();
    chunk_lengths.dedup();
    assert!(chunk_lengths.len() >= 2, "{seen:?}");
    assert!(
        seen.iter().any(|s| s.other_tokens > 100.0
            && s.attention_mpairs * 1e6 > s.other_tokens * (s.other_tokens + 1.0)),
        "no chunk after the start of its prompt: {seen:?}"
    );
    // Nothing left: no work, no block held, none named for the prefix cache, no count.
    assert!(!e.has_work());
    assert_eq!(e.used_blocks(), 0);
    assert_eq!(e.shared_pool().lock().named_count(), 0);
    assert_eq!(*e.stats(), EngineStats::default());
    // A request after it gets what it gets on a fresh engine.
    let p = prompt(3, 40);
    assert_eq!(greedy_tokens(&mut e, &p, 8), run_alone(&model, &p, 8));
}

#[test]
fn calibration_does_nothing_when_asked_for_nothing_or_when_requests_wait() {
    let model = model();
    let mut e = engine(&model, 128);
    let mut passes = 0;
    let run = e
        .calibrate(0, Duration::from_secs(60), &mut |_, _| passes += 1)
        .unwrap();
    assert_eq!((run.passes, passes), (0, 0));
    let (s, st) = greedy(2);
    e.add_request(prompt(0, 20), s, st).unwrap();
    let run = e
        .calibrate(1280, Duration::from_secs(60), &mut |_, _| passes += 1)
        .unwrap();
    assert_eq!((run.passes, passes), (0, 0));
    assert!(e.has_work(), "the real request is still queued");
}

#[test]
fn calibration_stops_adding_work_when_its_time_is_spent() {
    let model = model();
    let mut e = engine(&model, 512);
    let run = e.calibrate(1280, Duration::ZERO, &mut |_, _| {}).unwrap();
    assert_eq!(run.passes, 0);
    assert!(!e.has_work());
    assert_eq!(e.used_blocks(), 0);
}
