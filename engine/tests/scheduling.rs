//! The scheduler on the tiny built-in model: continuous batching, prompt chunks under a
//! paced allowance, prompts that end going first (shortest first, a cached history not
//! counted), preemption; every sequence gets the tokens it gets alone.

use std::collections::HashMap;
use std::sync::Arc;

mod common;
use common::{drain, engine, greedy, prompt, run_alone, tiny_model as model};
use tandem_engine::engine::EngineStats;
use tandem_engine::{Engine, FinishReason, Model, StepOutput};

type Outputs = HashMap<u64, Vec<StepOutput>>;
/// Sequences to check against their solo runs: (id, prompt index, prompt length, tokens asked).
type Checks = Vec<(u64, usize, usize, usize)>;

/// One step of `e`, its outputs added to `outs`.
fn step_into(e: &mut Engine, outs: &mut Outputs) {
    for o in e.step().unwrap() {
        outs.entry(o.id).or_default().push(o);
    }
}

/// Runs `e` to the end and checks that each of `ids` (id, prompt index, prompt length,
/// tokens asked) got the tokens it gets alone, and that every block came back.
fn drain_and_compare_solo(
    model: &Arc<Model>,
    e: &mut Engine,
    mut outs: Outputs,
    ids: Vec<(u64, usize, usize, usize)>,
) {
    for (id, o) in drain(e) {
        outs.entry(id).or_default().extend(o);
    }
    for (id, i, len, n) in ids {
        let got: Vec<u32> = outs[&id].iter().map(|o| o.token).collect();
        assert_eq!(got, run_alone(model, &prompt(i, len), n), "sequence {i}");
    }
    assert_eq!(e.used_blocks(), 0, "every block returned");
}

#[test]
fn continuous_batching_gives_each_sequence_its_solo_tokens() {
    let model = model();
    let mut e = engine(&model, 256);
    let lens = [3, 40, 17, 300, 1, 64, 90, 5];
    let mut ids = Vec::new();
    let mut outs = Outputs::new();
    // Sequences join at different steps while others decode.
    for (i, &len) in lens.iter().enumerate() {
        let (s, st) = greedy(12 + i);
        ids.push((e.add_request(prompt(i, len), s, st).unwrap(), i, len));
        for _ in 0..i {
            step_into(&mut e, &mut outs);
        }
    }
    for (id, o) in drain(&mut e) {
        outs.entry(id).or_default().extend(o);
    }
    for (id, i, len) in ids {
        let got: Vec<u32> = outs[&id].iter().map(|o| o.token).collect();
        assert_eq!(
            got,
            run_alone(&model, &prompt(i, len), 12 + i),
            "sequence {i}"
        );
        let last = outs[&id].last().unwrap();
        assert_eq!(last.finish, Some(FinishReason::Length));
        assert_eq!(last.completion_tokens, 12 + i);
        assert_eq!(last.prompt_tokens, len);
    }
    assert_eq!(e.used_blocks(), 0, "every block returned");
}

#[test]
fn a_prompt_beside_streams_runs_in_allowance_sized_chunks_with_the_same_tokens() {
    let model = model();
    let mut e = engine(&model, 256);
    let mut ids = Vec::new();
    // Two streams decoding, then a long prompt joins them.
    for i in 0..2 {
        let (s, st) = greedy(40);
        ids.push((e.add_request(prompt(i, 20), s, st).unwrap(), i, 20, 40));
    }
    let mut outs = Outputs::new();
    for _ in 0..2 {
        step_into(&mut e, &mut outs);
    }
    e.set_prompt_allowance(Some(32));
    let (s, st) = greedy(8);
    ids.push((e.add_request(prompt(7, 200), s, st).unwrap(), 7, 200, 8));
    let (decode, _) = e.decode_load();
    assert_eq!(decode.sampled_rows, 2.0, "both streams decode");
    // While the prompt runs beside the streams, each pass adds at most 32 of its tokens,
    // and every stream still gets its row.
    let mut prompt_passes = 0;
    while !outs.contains_key(&ids[2].0) {
        let produced = e.step().unwrap();
        let pass = e.last_pass();
        let streams = produced.iter().filter(|o| o.id != ids[2].0).count();
        if pass.other_tokens > 0.0 {
            prompt_passes += 1;
            assert!(
                pass.other_tokens + pass.sampled_rows <= 2.0 + 32.0,
                "{pass:?}"
            );
            assert_eq!(streams, 2, "a stream lost its step to a prompt chunk");
        }
        for o in produced {
            outs.entry(o.id).or_default().push(o);
        }
    }
    assert!(prompt_passes >= 200 / 32, "{prompt_passes} passes");
    // Without decode rows the allowance applies too (a new stream's prompt arriving
    // meanwhile waits for the pass), and a pass is never empty while a prompt waits.
    e.set_prompt_allowance(Some(16));
    let (s, st) = greedy(1);
    let mut alone = engine(&model, 64);
    alone.set_prompt_allowance(Some(16));
    alone.add_request(prompt(9, 100), s, st).unwrap();
    alone.step().unwrap();
    assert_eq!(alone.last_pass().other_tokens, 16.0);
    alone.set_prompt_allowance(Some(0));
    alone.step().unwrap();
    assert_eq!(
        alone.last_pass().other_tokens,
        16.0,
        "a block, not an empty pass"
    );
    alone.set_prompt_allowance(None);
    alone.step().unwrap();
    assert_eq!(alone.last_pass().other_tokens, 67.0);
    assert_eq!(alone.last_pass().sampled_rows, 1.0);
    drain_and_compare_solo(&model, &mut e, outs, ids);
}

/// Two streams decoding with prompt chunks beside them capped at 32 tokens a pass, after
/// `before` (if any) ran to its first token, then two 200-token prompts: the first under way
/// (its first chunk computed), the second waiting behind it.
fn streams_and_a_long_prompt_under_way(
    model: &Arc<Model>,
    before: Option<&[u32]>,
) -> (Engine, Outputs, Checks) {
    let mut e = engine(model, 256);
    let mut ids = Vec::new();
    let mut outs = Outputs::new();
    for i in 0..2 {
        let (s, st) = greedy(30);
        ids.push((e.add_request(prompt(i, 20), s, st).unwrap(), i, 20, 30));
    }
    step_into(&mut e, &mut outs);
    e.set_prompt_allowance(Some(32));
    if let Some(before) = before {
        let (s, st) = greedy(1);
        let first = e.add_request(before.to_vec(), s, st).unwrap();
        while !outs.contains_key(&first) {
            step_into(&mut e, &mut outs);
        }
        outs.remove(&first);
    }
    for i in 2..4 {
        let (s, st) = greedy(4);
        ids.push((e.add_request(prompt(i, 200), s, st).unwrap(), i, 200, 4));
    }
    step_into(&mut e, &mut outs);
    assert_eq!(e.num_waiting(), 1, "the second long prompt waits");
    (e, outs, ids)
}

#[test]
fn a_short_prompt_does_not_wait_behind_long_ones() {
    let model = model();
    let (mut e, mut outs, mut ids) = streams_and_a_long_prompt_under_way(&model, None);
    // A short prompt queued behind both ends in the next pass, beside the streams, and the
    // first long prompt's chunk takes the rest of the allowance.
    let (s, st) = greedy(3);
    let short = e.add_request(prompt(4, 10), s, st).unwrap();
    ids.push((short, 4, 10, 3));
    step_into(&mut e, &mut outs);
    assert_eq!(outs[&short].len(), 1, "the short prompt's first token");
    let pass = e.last_pass();
    assert_eq!(pass.sampled_rows, 3.0, "two streams and the short prompt");
    assert_eq!(pass.other_tokens, 9.0 + 16.0, "{pass:?}");
    assert_eq!(e.num_waiting(), 1, "the second long prompt still waits");
    drain_and_compare_solo(&model, &mut e, outs, ids);
}

#[test]
fn a_short_prompt_goes_before_whole_prompts_queued_ahead_of_it() {
    let model = model();
    let mut e = engine(&model, 256);
    let mut ids = Vec::new();
    let mut outs = Outputs::new();
    // A prefill worker's queue: two prompts that each fill a whole 256-token pass, then a
    // short one, all waiting before the first pass.
    for i in 0..2 {
        let (s, st) = greedy(2);
        ids.push((e.add_request(prompt(i, 256), s, st).unwrap(), i, 256, 2));
    }
    let (s, st) = greedy(2);
    let short = e.add_request(prompt(2, 10), s, st).unwrap();
    ids.push((short, 2, 10, 2));
    step_into(&mut e, &mut outs);
    // The short one ends in the first pass; the first long one takes the rest of it (in
    // whole blocks: 240 of the 246 tokens left).
    assert_eq!(outs[&short].len(), 1, "the short prompt's first token");
    let pass = e.last_pass();
    assert_eq!(pass.sampled_rows, 1.0, "{pass:?}");
    assert_eq!(pass.other_tokens, 9.0 + 240.0, "{pass:?}");
    assert_eq!(e.num_waiting(), 1, "the second long prompt waits");
    drain_and_compare_solo(&model, &mut e, outs, ids);
}

#[test]
fn a_next_turn_counts_only_what_its_cached_history_lacks() {
    let model = model();
    // A first turn of 96 tokens ran to its end (its blocks stay cached) before the long
    // prompts came; its next turn is those 96 tokens and 10 more: 106 tokens, 10 to compute,
    // which end within one 32-token allowance ahead of the long prompt's chunk.
    let history = prompt(5, 96);
    let (mut e, mut outs, ids) = streams_and_a_long_prompt_under_way(&model, Some(&history));
    let mut next = history;
    next.extend(prompt(6, 10));
    let (s, st) = greedy(3);
    let turn = e.add_request(next.clone(), s, st).unwrap();
    step_into(&mut e, &mut outs);
    assert_eq!(
        outs[&turn].len(),
        1,
        "the next turn's first token, in one pass"
    );
    assert_eq!(
        e.last_pass().sampled_rows,
        3.0,
        "two streams and the next turn"
    );
    for (id, o) in drain(&mut e) {
        outs.entry(id).or_default().extend(o);
    }
    let got: Vec<u32> = outs[&turn].iter().map(|o| o.token).collect();
    assert_eq!(got, run_alone(&model, &next, 3), "the next turn");
    drain_and_compare_solo(&model, &mut e, outs, ids);
}

#[test]
fn preemption_recomputes_without_changing_tokens() {
    let model = model();
    // 12 blocks: four sequences of 40-token prompts growing to 80 tokens cannot all fit.
    let mut e = engine(&model, 12);
    let mut ids = Vec::new();
    for i in 0..4 {
        let (s, st) = greedy(40);
        ids.push((e.add_request(prompt(i, 40), s, st).unwrap(), i));
    }
    let outs = drain(&mut e);
    let stats: &EngineStats = e.stats();
    assert!(stats.preemptions > 0, "the pool was meant to run dry");
    for (id, i) in ids {
        let got: Vec<u32> = outs[&id].iter().map(|o| o.token).collect();
        assert_eq!(got, run_alone(&model, &prompt(i, 40), 40), "sequence {i}");
    }
    assert_eq!(e.used_blocks(), 0);
}
