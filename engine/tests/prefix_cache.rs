//! Prefix caching on the tiny built-in model: a prompt whose prefix was computed before runs
//! only the rest, the output is bit for bit what an engine without caching gives (greedy and
//! seeded, one request or many at once), cached blocks are evicted least recently used only
//! when space is needed, the last prompt token always runs, and KV imported from another
//! engine serves like KV computed here.

use std::collections::BTreeMap;
use std::sync::Arc;

use tandem_engine::{Engine, EngineConfig, Model, SamplingParams, StepOutput, StopParams};
use tandem_kv::BLOCK_SIZE;
use tandem_text::TextTokenizer;

#[allow(dead_code)]
mod common;

fn model() -> Arc<Model> {
    common::tiny_model()
}

fn engine(model: &Arc<Model>, blocks: usize, prefix_caching: bool) -> Engine {
    let config = EngineConfig {
        kv_budget_bytes: blocks * model.kv_layout().block_bytes(),
        max_batch_tokens: 256,
        max_running: 32,
        prefix_caching,
        ..Default::default()
    };
    Engine::new(model.clone(), TextTokenizer::byte_level(), config).unwrap()
}

/// `shared` tokens common to every `i`, then `own` tokens of `i`'s.
fn prompt(i: usize, shared: usize, own: usize) -> Vec<u32> {
    let mut p: Vec<u32> = (0..shared)
        .map(|j| 3 + ((j * 7 + 1) % 250) as u32)
        .collect();
    p.extend((0..own).map(|j| 3 + ((i * 31 + j * 11) % 250) as u32));
    p
}

fn stop(max_tokens: usize) -> StopParams {
    StopParams {
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

fn seeded(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 8.0,
        top_k: 40,
        seed: Some(seed),
        top_logprobs: 2,
        ..SamplingParams::default()
    }
}

/// Each request's (token, logprob, alternatives), by request, after running them all at once.
type Outputs = BTreeMap<u64, Vec<(u32, f32, Vec<(u32, f32)>)>>;

fn run_all(e: &mut Engine, requests: &[(Vec<u32>, SamplingParams)], max_tokens: usize) -> Outputs {
    let ids: Vec<u64> = requests
        .iter()
        .map(|(p, s)| {
            e.add_request(p.clone(), s.clone(), stop(max_tokens))
                .unwrap()
        })
        .collect();
    let mut out: Outputs = BTreeMap::new();
    let mut guard = 0;
    while e.has_work() {
        for o in e.step().unwrap() {
            let StepOutput {
                request,
                token,
                logprob,
                top_logprobs,
                ..
            } = o;
            out.entry(request)
                .or_default()
                .push((token, logprob, top_logprobs));
        }
        guard += 1;
        assert!(guard < 10_000);
    }
    // Renumber by position in `requests`, so that two engines' outputs compare.
    ids.iter()
        .enumerate()
        .map(|(i, id)| (i as u64, out.remove(id).unwrap_or_default()))
        .collect()
}

#[test]
fn a_cached_prefix_is_not_computed_again_and_changes_nothing() {
    let model = model();
    let first = prompt(0, 90, 10);
    let second = prompt(1, 90, 10);
    let mut e = engine(&model, 64, true);
    run_all(&mut e, &[(first, seeded(1))], 6);
    let before = e.stats().prefill_tokens;
    let cached = run_all(&mut e, &[(second.clone(), seeded(2))], 6);
    let computed = e.stats().prefill_tokens - before;
    // 90 shared tokens: 5 full blocks (80 tokens) are found; 20 tokens run.
    assert_eq!(computed, 20, "{:?}", e.stats());
    assert_eq!(e.stats().prefix_hit_tokens, 80);
    assert_eq!(e.used_blocks(), 0, "cached blocks count as free");
    let mut plain = engine(&model, 64, false);
    assert_eq!(cached, run_all(&mut plain, &[(second, seeded(2))], 6));
    assert_eq!(plain.stats().prefix_hit_tokens, 0);
}

#[test]
fn many_requests_at_once_match_an_engine_without_caching() {
    let model = model();
    let requests: Vec<(Vec<u32>, SamplingParams)> = (0..12)
        .map(|i| {
            let p = prompt(i % 4, 40 + 16 * (i % 3), 5 + i);
            let s = if i % 2 == 0 {
                SamplingParams::greedy()
            } else {
                seeded(i as u64)
            };
            (p, s)
        })
        .collect();
    let mut cached = engine(&model, 96, true);
    // Twice: the second round finds the first round's blocks (and its own running mates').
    let a = run_all(&mut cached, &requests, 10);
    let b = run_all(&mut cached, &requests, 10);
    let mut plain = engine(&model, 96, false);
    let want = run_all(&mut plain, &requests, 10);
    assert_eq!(a, want);
    assert_eq!(b, want);
    assert!(cached.stats().prefix_hit_tokens > 0);
    assert!(cached.stats().prefill_tokens < plain.stats().prefill_tokens * 2);
}

#[test]
fn cached_blocks_are_evicted_least_recently_used_when_space_is_needed() {
    let model = model();
    // 8 blocks: prompt A (3 full blocks + 1) and then B, which needs 7, evicts A's.
    let a = prompt(0, 0, 50);
    let b = prompt(1, 0, 100);
    let mut e = engine(&model, 8, true);
    let first = run_all(&mut e, &[(a.clone(), SamplingParams::greedy())], 4);
    run_all(&mut e, &[(b, SamplingParams::greedy())], 4);
    let hits = e.stats().prefix_hit_tokens;
    let again = run_all(&mut e, &[(a, SamplingParams::greedy())], 4);
    assert_eq!(again, first);
    assert_eq!(
        e.stats().prefix_hit_tokens,
        hits,
        "A's blocks were evicted for B"
    );
    assert_eq!(e.used_blocks(), 0);
}

#[test]
fn the_last_prompt_token_always_runs() {
    let model = model();
    let p = prompt(0, 0, 2 * BLOCK_SIZE);
    let mut e = engine(&model, 16, true);
    let first = run_all(&mut e, &[(p.clone(), SamplingParams::greedy())], 3);
    let before = e.stats().prefill_tokens;
    let again = run_all(&mut e, &[(p, SamplingParams::greedy())], 3);
    assert_eq!(again, first);
    // Two full blocks are cached, but the second holds the last token: only one is used.
    assert_eq!(e.stats().prefill_tokens - before, BLOCK_SIZE as u64);
}

#[test]
fn the_queued_prefill_work_leaves_out_what_the_cache_holds() {
    let model = model();
    let mut e = engine(&model, 64, true);
    run_all(&mut e, &[(prompt(0, 80, 20), SamplingParams::greedy())], 2);
    assert_eq!(e.pending_prefill_tokens(), 0);
    // Waiting: one prompt sharing the 80-token prefix (5 blocks cached), one new prompt.
    e.add_request(prompt(1, 80, 20), SamplingParams::greedy(), stop(2))
        .unwrap();
    e.add_request(prompt(2, 0, 50), SamplingParams::greedy(), stop(2))
        .unwrap();
    assert_eq!(e.pending_prefill_tokens(), (100 - 80) + 50);
    let mut off = engine(&model, 64, false);
    off.add_request(prompt(1, 80, 20), SamplingParams::greedy(), stop(2))
        .unwrap();
    assert_eq!(off.pending_prefill_tokens(), 100);
}

#[test]
fn a_request_told_to_compute_its_whole_prompt_ignores_the_cache() {
    let model = model();
    let mut e = engine(&model, 64, true);
    let p = prompt(0, 80, 20);
    let first = run_all(&mut e, &[(p.clone(), SamplingParams::greedy())], 3);
    let id = e
        .add_request(p.clone(), SamplingParams::greedy(), stop(3))
        .unwrap();
    e.compute_whole_prompt(id);
    assert_eq!(e.pending_prefill_tokens(), 100);
    let before = e.stats().prefill_tokens;
    let mut again = Vec::new();
    while e.has_work() {
        again.extend(e.step().unwrap().into_iter().map(|o| o.token));
    }
    assert_eq!(e.stats().prefill_tokens - before, 100, "nothing reused");
    let want: Vec<u32> = first.values().next().unwrap().iter().map(|t| t.0).collect();
    assert_eq!(again, want);
}

#[test]
fn prompt_logprobs_are_computed_whatever_the_cache_holds() {
    let model = model();
    let p = prompt(0, 60, 4);
    let mut e = engine(&model, 32, true);
    run_all(&mut e, &[(p.clone(), SamplingParams::greedy())], 2);
    let asking = SamplingParams {
        prompt_logprobs: Some(1),
        ..SamplingParams::greedy()
    };
    let id = e.add_request(p.clone(), asking, stop(2)).unwrap();
    let outputs = e.run_to_completion(id).unwrap();
    assert_eq!(outputs[0].prompt_logprobs.len(), p.len() - 1);
}

/// Blocks `from..to` of `prompt` as `engine` caches them, block-major (each block's layers in
/// order): what a prefill worker pulls from a decode worker.
fn cached_kv(engine: &Engine, prompt: &[u32], from: usize, to: usize) -> Vec<u8> {
    let pool = engine.shared_pool();
    let salt = engine.prefix_salt().unwrap();
    let held = Engine::hold_cached_prefix(&pool, salt, prompt);
    assert!(held.len() >= to, "{} blocks cached", held.len());
    let cache = engine.cache();
    let mut data = Vec::new();
    for &block in &held[from..to] {
        for layer in 0..cache.layout().num_layers {
            data.extend_from_slice(cache.block_layer_bytes(layer, block).unwrap());
        }
    }
    pool.release(&held).unwrap();
    data
}

#[test]
fn a_prefix_imported_from_another_engine_is_not_computed_and_changes_nothing() {
    let model = model();
    let p = prompt(0, 90, 10);
    // The engine that holds the whole prefix (a decode worker's).
    let mut holder = engine(&model, 64, true);
    run_all(&mut holder, &[(p.clone(), SamplingParams::greedy())], 2);
    // One that holds only its first two blocks (a prefill worker that saw an earlier turn).
    let mut e = engine(&model, 64, true);
    run_all(&mut e, &[(p[..40].to_vec(), SamplingParams::greedy())], 1);
    assert_eq!(
        Engine::cached_prefix_blocks(&e.shared_pool(), e.prefix_salt().unwrap(), &p),
        2
    );
    // A gap before the imported blocks: they could never be reached, so nothing is added.
    let tail = cached_kv(&holder, &p, 3, 6);
    assert_eq!(e.import_cached_prefix(&p, 3, &tail).unwrap(), 0);
    // Torn data, or blocks past the ones a prompt may reuse, are refused.
    let data = cached_kv(&holder, &p, 2, 6);
    assert!(e.import_cached_prefix(&p, 2, &data[1..]).is_err());
    assert!(e.import_cached_prefix(&p[..90], 2, &data).is_err());
    assert!(e.imports_prefix_kv());
    assert_eq!(e.import_cached_prefix(&p, 2, &data).unwrap(), 4);
    assert_eq!(
        Engine::cached_prefix_blocks(&e.shared_pool(), e.prefix_salt().unwrap(), &p),
        6
    );
    assert_eq!(e.used_blocks(), 0, "imported blocks wait idle in the cache");
    // Importing again adds nothing: the blocks are there.
    assert_eq!(e.import_cached_prefix(&p, 2, &data).unwrap(), 0);
    let before = e.stats().prefill_tokens;
    let got = run_all(&mut e, &[(p.clone(), SamplingParams::greedy())], 6);
    assert_eq!(
        e.stats().prefill_tokens - before,
        4,
        "only the last block ran"
    );
    let mut plain = engine(&model, 64, false);
    assert_eq!(
        got,
        run_all(&mut plain, &[(p.clone(), SamplingParams::greedy())], 6)
    );
    // An engine that does not cache prefixes takes nothing.
    assert!(!plain.imports_prefix_kv());
    assert_eq!(plain.import_cached_prefix(&p, 0, &data).unwrap(), 0);
}
