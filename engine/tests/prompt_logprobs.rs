//! Prompt logprobs on the tiny built-in model: every prompt token's logprob, rank and
//! alternatives equal, bit for bit, what a one-token-at-a-time forward pass gives for it
//! (whatever the chunking), they come once with choice 0's first token, and a prefill
//! engine reports them for the decode side.

use std::sync::Arc;

use tandem_engine::{
    Engine, EngineConfig, Model, PromptLogprob, SamplingParams, SeqInput, StopParams,
};
use tandem_kv::{KvCache, blocks_for};
use tandem_text::TextTokenizer;

#[allow(dead_code)]
mod common;

fn model() -> Arc<Model> {
    common::tiny_model()
}

fn engine(model: &Arc<Model>, max_batch_tokens: usize) -> Engine {
    let config = EngineConfig {
        kv_budget_bytes: 128 * model.kv_layout().block_bytes(),
        max_batch_tokens,
        max_running: 16,
        ..Default::default()
    };
    Engine::new(model.clone(), TextTokenizer::byte_level(), config).unwrap()
}

fn prompt(len: usize) -> Vec<u32> {
    (0..len).map(|j| 3 + ((j * 13 + 5) % 250) as u32).collect()
}

/// Each token's entry from a forward pass of one token at a time (each row sees exactly its
/// prefix).
fn reference(model: &Model, tokens: &[u32], top: usize) -> Vec<PromptLogprob> {
    let layout = model.kv_layout();
    let blocks = blocks_for(tokens.len());
    let mut cache = KvCache::with_budget(layout.clone(), blocks * layout.block_bytes()).unwrap();
    let table: Vec<u32> = (0..blocks as u32).collect();
    tokens
        .windows(2)
        .enumerate()
        .map(|(pos, pair)| {
            let input = SeqInput {
                tokens: &pair[..1],
                start_pos: pos,
                block_table: &table,
                logits: true,
                all_logits: false,
            };
            let row = model
                .forward(&mut cache, &[input], &mut |_, _| {})
                .unwrap()
                .pop()
                .unwrap();
            PromptLogprob::of(&row, pair[1], top)
        })
        .collect()
}

fn asking(top: usize, n: usize) -> SamplingParams {
    SamplingParams {
        prompt_logprobs: Some(top),
        n,
        ..SamplingParams::greedy()
    }
}

fn stop(max_tokens: usize) -> StopParams {
    StopParams {
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

#[test]
fn prompt_logprobs_equal_a_token_by_token_pass_in_any_chunking() {
    let model = model();
    let p = prompt(70);
    let want = reference(&model, &p, 3);
    assert_eq!(want.len(), 69);
    // One chunk, and chunks of 16 tokens (several passes, each keeping every row).
    for max_batch_tokens in [256, 16] {
        let mut e = engine(&model, max_batch_tokens);
        let id = e.add_request(p.clone(), asking(3, 1), stop(4)).unwrap();
        let outputs = e.run_to_completion(id).unwrap();
        assert_eq!(outputs[0].prompt_logprobs, want, "{max_batch_tokens}");
        assert!(outputs[1..].iter().all(|o| o.prompt_logprobs.is_empty()));
        for entry in &want {
            assert!(entry.rank >= 1 && entry.logprob <= 0.0);
            assert_eq!(entry.top_logprobs.len(), 3);
            assert!(entry.top_logprobs[0].1 >= entry.logprob);
        }
    }
    // The greedy path is unchanged by asking for them.
    let mut plain = engine(&model, 256);
    let id = plain
        .add_request(p.clone(), SamplingParams::greedy(), stop(4))
        .unwrap();
    let tokens: Vec<u32> = plain
        .run_to_completion(id)
        .unwrap()
        .iter()
        .map(|o| o.token)
        .collect();
    let mut e = engine(&model, 256);
    let id = e.add_request(p, asking(0, 1), stop(4)).unwrap();
    let outputs = e.run_to_completion(id).unwrap();
    assert_eq!(outputs.iter().map(|o| o.token).collect::<Vec<_>>(), tokens);
    assert!(
        outputs[0]
            .prompt_logprobs
            .iter()
            .all(|e| e.top_logprobs.is_empty())
    );
}

#[test]
fn only_choice_zero_reports_them_and_the_prefill_side_does() {
    let model = model();
    let p = prompt(30);
    let want = reference(&model, &p, 2);
    let mut e = engine(&model, 256);
    let id = e.add_request(p.clone(), asking(2, 3), stop(3)).unwrap();
    let outputs = e.run_to_completion(id).unwrap();
    let reporting: Vec<u32> = outputs
        .iter()
        .filter(|o| !o.prompt_logprobs.is_empty())
        .map(|o| o.choice)
        .collect();
    assert_eq!(reporting, vec![0]);
    // A prefill engine (one token) reports them with its first token.
    let mut prefill = engine(&model, 256);
    let id = prefill.add_request(p, asking(2, 1), stop(1)).unwrap();
    let out = prefill.run_to_completion(id).unwrap();
    assert_eq!(out[0].prompt_logprobs, want);
    assert_eq!(prefill.used_blocks(), 0);
}

#[test]
fn more_than_twenty_alternatives_are_refused() {
    let model = model();
    let mut e = engine(&model, 256);
    let err = e
        .add_request(prompt(5), asking(21, 1), stop(1))
        .unwrap_err();
    assert!(err.is_invalid_request(), "{err}");
    assert!(err.to_string().contains("prompt_logprobs"), "{err}");
}
