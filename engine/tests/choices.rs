//! Requests with `n > 1` choices on the tiny built-in model: the prompt runs once, the choices
//! share its full blocks and copy its last partial one, each choice is exactly the `n = 1`
//! request with seed `seed + i` (aggregated, after a handoff, and through preemption), and
//! every block comes back.

use std::collections::BTreeMap;
use std::sync::Arc;

use tandem_engine::{Engine, EngineConfig, Model, SamplingParams, StepOutput, StopParams};
use tandem_kv::{BLOCK_SIZE, blocks_for};
use tandem_text::TextTokenizer;

#[allow(dead_code)]
mod common;

fn model() -> Arc<Model> {
    common::tiny_model()
}

fn engine(model: &Arc<Model>, blocks: usize) -> Engine {
    let config = EngineConfig {
        kv_budget_bytes: blocks * model.kv_layout().block_bytes(),
        max_batch_tokens: 256,
        max_running: 64,
        ..Default::default()
    };
    Engine::new(model.clone(), TextTokenizer::byte_level(), config).unwrap()
}

fn prompt(len: usize) -> Vec<u32> {
    (0..len).map(|j| 3 + ((j * 7 + 11) % 250) as u32).collect()
}

/// Sampled (so that choices differ) and seeded (so that they reproduce).
fn sampled(n: usize) -> SamplingParams {
    SamplingParams {
        // The tiny model's logits are sharp: a high temperature makes sampling visible.
        temperature: 8.0,
        top_k: 40,
        seed: Some(77),
        top_logprobs: 2,
        n,
        ..SamplingParams::default()
    }
}

fn stop(max_tokens: usize) -> StopParams {
    StopParams {
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

/// Each choice's tokens, by choice.
fn by_choice(outputs: &[StepOutput]) -> BTreeMap<u32, Vec<u32>> {
    let mut choices: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for o in outputs {
        choices.entry(o.choice).or_default().push(o.token);
    }
    choices
}

/// The `n = 1` request that choice `choice` must equal: the same, with seed `seed + choice`.
fn solo(model: &Arc<Model>, p: &[u32], sampling: &SamplingParams, choice: u64) -> Vec<u32> {
    let mut e = engine(model, 64);
    let single = SamplingParams {
        n: 1,
        seed: sampling.seed.map(|s| s + choice),
        ..sampling.clone()
    };
    let id = e.add_request(p.to_vec(), single, stop(12)).unwrap();
    e.run_to_completion(id)
        .unwrap()
        .iter()
        .map(|o| o.token)
        .collect()
}

#[test]
fn choices_run_the_prompt_once_and_each_equals_its_seeded_single_request() {
    let model = model();
    // A prompt ending mid-block (its last block is copied) and one ending on a block boundary.
    for len in [37, 2 * BLOCK_SIZE] {
        let p = prompt(len);
        let n = 3;
        let mut e = engine(&model, 64);
        let id = e.add_request(p.clone(), sampled(n), stop(12)).unwrap();
        let first_step = e.step().unwrap();
        assert_eq!(first_step.len(), n, "every choice's first token at once");
        assert!(first_step.iter().all(|o| o.request == id));
        let partial = usize::from(len % BLOCK_SIZE != 0);
        assert_eq!(
            e.used_blocks(),
            len / BLOCK_SIZE + n * partial,
            "the full blocks are shared, the partial one copied per choice"
        );
        let mut outputs = first_step;
        outputs.extend(e.run_to_completion(id).unwrap());
        assert_eq!(e.stats().prefill_tokens, len as u64, "prefilled once");
        assert_eq!(e.used_blocks(), 0, "every shared block freed");
        let choices = by_choice(&outputs);
        assert_eq!(choices.len(), n);
        for (choice, tokens) in &choices {
            assert_eq!(tokens.len(), 12);
            assert_eq!(
                tokens,
                &solo(&model, &p, &sampled(n), u64::from(*choice)),
                "choice {choice} of a {len}-token prompt"
            );
        }
        assert_ne!(choices[&0], choices[&1], "seeds differ, so do the choices");
    }
}

#[test]
fn greedy_choices_are_identical() {
    let model = model();
    let mut e = engine(&model, 64);
    let greedy = SamplingParams {
        n: 4,
        ..SamplingParams::greedy()
    };
    let id = e.add_request(prompt(21), greedy, stop(10)).unwrap();
    let choices = by_choice(&e.run_to_completion(id).unwrap());
    assert_eq!(choices.len(), 4);
    assert!(choices.values().all(|t| t == &choices[&0]));
    assert_eq!(e.used_blocks(), 0);
}

#[test]
fn choices_after_a_handoff_equal_the_aggregated_ones() {
    let model = model();
    let p = prompt(45);
    let sampling = sampled(3);
    let handed = common::handoff_with(|| engine(&model, 64), &p, sampling.clone(), stop(12));
    let mut e = engine(&model, 64);
    let id = e.add_request(p, sampling, stop(12)).unwrap();
    let aggregated = e.run_to_completion(id).unwrap();
    assert_eq!(by_choice(&handed), by_choice(&aggregated));
    let logprobs = |outs: &[StepOutput]| {
        let mut v: Vec<_> = outs
            .iter()
            .map(|o| (o.choice, o.logprob, o.top_logprobs.clone()))
            .collect();
        v.sort_by_key(|entry| entry.0);
        v
    };
    assert_eq!(logprobs(&handed), logprobs(&aggregated));
}

#[test]
fn preempted_choices_recompute_to_the_same_tokens() {
    let model = model();
    let p = prompt(40);
    let n = 4;
    // 40 prompt + 30 generated tokens need 5 blocks per choice: 4 choices cannot all fit in
    // 12 blocks, even sharing the prompt's 2 full ones.
    let mut e = engine(&model, 12);
    let mut sampling = sampled(n);
    sampling.top_logprobs = 0;
    let stop = StopParams {
        max_tokens: 30,
        ..stop(30)
    };
    let id = e
        .add_request(p.clone(), sampling.clone(), stop.clone())
        .unwrap();
    let outputs = e.run_to_completion(id).unwrap();
    assert!(e.stats().preemptions > 0, "the pool was too small for all");
    assert_eq!(e.used_blocks(), 0);
    let choices = by_choice(&outputs);
    for (choice, tokens) in &choices {
        let mut alone = engine(&model, 64);
        let single = SamplingParams {
            n: 1,
            seed: sampling.seed.map(|s| s + u64::from(*choice)),
            ..sampling.clone()
        };
        let sid = alone.add_request(p.clone(), single, stop.clone()).unwrap();
        let want: Vec<u32> = alone
            .run_to_completion(sid)
            .unwrap()
            .iter()
            .map(|o| o.token)
            .collect();
        assert_eq!(tokens, &want, "choice {choice}");
    }
}

#[test]
fn aborting_a_request_frees_every_choice() {
    let model = model();
    let mut e = engine(&model, 64);
    let id = e.add_request(prompt(50), sampled(5), stop(40)).unwrap();
    e.step().unwrap();
    e.step().unwrap();
    assert!(e.used_blocks() >= blocks_for(50));
    assert_eq!(e.num_running(), 5);
    assert!(e.abort(id));
    assert_eq!(e.used_blocks(), 0);
    assert!(!e.has_work());
    assert!(!e.abort(id));
}

#[test]
fn choices_that_end_at_their_first_token_hold_no_blocks() {
    let model = model();
    let mut e = engine(&model, 64);
    let id = e.add_request(prompt(30), sampled(6), stop(1)).unwrap();
    let outputs = e.run_to_completion(id).unwrap();
    assert_eq!(outputs.len(), 6);
    assert!(outputs.iter().all(|o| o.finish.is_some()));
    let mut choices: Vec<u32> = outputs.iter().map(|o| o.choice).collect();
    choices.sort_unstable();
    assert_eq!(choices, (0..6).collect::<Vec<_>>());
    assert_eq!(e.used_blocks(), 0);
}

#[test]
fn a_choice_without_a_block_for_its_copy_recomputes_the_partial_block() {
    let model = model();
    let p = prompt(40);
    // 40 tokens take 3 blocks (the last partial); one more is free: the first other choice
    // gets its copy, the second recomputes its last 8 prompt tokens instead.
    let mut e = engine(&model, blocks_for(40) + 1);
    let mut sampling = sampled(3);
    sampling.top_logprobs = 0;
    let id = e.add_request(p.clone(), sampling.clone(), stop(6)).unwrap();
    let outputs = e.run_to_completion(id).unwrap();
    assert_eq!(e.used_blocks(), 0);
    assert!(
        e.stats().prefill_tokens > 40,
        "some prompt tokens ran again: {:?}",
        e.stats()
    );
    for (choice, tokens) in &by_choice(&outputs) {
        let mut alone = engine(&model, 64);
        let single = SamplingParams {
            n: 1,
            seed: sampling.seed.map(|s| s + u64::from(*choice)),
            ..sampling.clone()
        };
        let sid = alone.add_request(p.clone(), single, stop(6)).unwrap();
        let want: Vec<u32> = alone
            .run_to_completion(sid)
            .unwrap()
            .iter()
            .map(|o| o.token)
            .collect();
        assert_eq!(tokens, &want, "choice {choice}");
    }
}
