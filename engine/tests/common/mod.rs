//! What the engine's integration tests share: the disaggregated path inside one process. A
//! prefill engine runs the prompt and ships each (block, layer) as its layer completes; a
//! second engine imports them into blocks it reserved and continues the sequence.

use std::collections::HashMap;
use std::sync::Arc;

use tandem_engine::engine::ReceivedKv;
use tandem_engine::{
    Engine, EngineConfig, Model, SampledToken, SamplingParams, StepOutput, StopParams,
};
use tandem_text::TextTokenizer;

/// The greedy tokens of `prompt` prefilled on one engine and decoded on another (both made
/// by `engine`), the first token from the prefill side. Both engines must free every block.
/// As the workers do, only the blocks the decode side reads cross (a sliding-window model's
/// earlier ones stay behind), into a reservation of just those.
#[allow(dead_code)] // Not every test file that shares this module hands off.
pub fn handoff(engine: impl Fn() -> Engine, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let stop = StopParams {
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    };
    handoff_with(engine, prompt, SamplingParams::greedy(), stop)
        .iter()
        .map(|o| o.token)
        .collect()
}

/// [`handoff`] with any sampling and stop parameters, returning every output (of every
/// choice, each choice's in order). The prefill side stops after one token per choice and
/// sees the request's stop ids and `min_tokens`, as the prefill worker does.
#[allow(dead_code)]
pub fn handoff_with(
    engine: impl Fn() -> Engine,
    prompt: &[u32],
    sampling: SamplingParams,
    stop: StopParams,
) -> Vec<StepOutput> {
    let mut prefill = engine();
    let first_block = prefill.model().config().first_needed_block(prompt.len());
    let prefill_stop = StopParams {
        max_tokens: 1,
        stop_token_ids: stop.stop_token_ids.clone(),
        stop_strings: Vec::new(),
        ignore_eos: stop.ignore_eos,
        min_tokens: stop.min_tokens.min(1),
    };
    prefill
        .add_request(prompt.to_vec(), sampling.clone(), prefill_stop)
        .unwrap();
    let mut shipped: HashMap<(usize, usize), Vec<u8>> = HashMap::new();
    let mut firsts: Vec<StepOutput> = Vec::new();
    while prefill.has_work() {
        let outs = prefill
            .step_with(&mut |layer, cache, chunks| {
                for c in chunks {
                    for lb in c.logical_blocks().filter(|&lb| lb >= first_block) {
                        let bytes = cache.block_layer_bytes(layer, c.blocks[lb]).unwrap();
                        shipped.insert((lb - first_block, layer), bytes.to_vec());
                    }
                }
            })
            .unwrap();
        firsts.extend(outs);
    }
    firsts.sort_by_key(|o| o.choice);
    assert_eq!(firsts.len(), sampling.n, "one first token per choice");
    assert!(firsts.iter().all(|o| o.finish.is_some()));
    assert_eq!(prefill.used_blocks(), 0, "prefill side frees its blocks");

    let mut decode = engine();
    let blocks = decode.reserve(prompt.len()).unwrap();
    let layers = decode.model().config().num_hidden_layers;
    assert_eq!(
        blocks.len(),
        tandem_kv::blocks_for(prompt.len()) - first_block
    );
    assert_eq!(
        shipped.len(),
        blocks.len() * layers,
        "every needed block, once per layer"
    );
    for ((lb, layer), bytes) in &shipped {
        decode
            .import_block_layer(*layer, blocks[*lb], bytes)
            .unwrap();
    }
    let firsts = firsts
        .iter()
        .map(|first| SampledToken {
            token: first.token,
            logprob: first.logprob,
            top_logprobs: first.top_logprobs.clone(),
        })
        .collect();
    let (id, mut outputs) = decode
        .add_prefilled(
            prompt.to_vec(),
            firsts,
            ReceivedKv::host(blocks),
            sampling,
            stop,
            None,
        )
        .unwrap();
    outputs.extend(decode.run_to_completion(id).unwrap());
    assert_eq!(decode.used_blocks(), 0, "decode side frees its blocks");
    outputs.sort_by_key(|o| o.choice);
    outputs
}

/// The tiny built-in model with seeded weights (seed 0), as the engine tests share it.
#[allow(dead_code)] // Not every test file that shares this module builds models this way.
pub fn tiny_model() -> std::sync::Arc<tandem_engine::Model> {
    use tandem_engine::config::{ModelConfig, WeightFormat};
    std::sync::Arc::new(
        tandem_engine::model::dummy_model(
            ModelConfig::preset("tiny").unwrap(),
            WeightFormat::F32,
            0,
            "tiny",
        )
        .unwrap(),
    )
}

/// The outputs of `prompt` split at token `at` (whole blocks): one engine computes the first
/// `at` tokens and ships their KV; another imports it into a reservation for the whole
/// prompt, computes the rest and generates, as a decode worker does for a split prompt.
#[allow(dead_code)] // Only the engine tests split prompts.
pub fn split_handoff(
    engine: impl Fn() -> Engine,
    prompt: &[u32],
    at: usize,
    sampling: SamplingParams,
    stop: StopParams,
) -> Vec<StepOutput> {
    let mut prefill = engine();
    let part_stop = StopParams {
        max_tokens: 1,
        ..Default::default()
    };
    prefill
        .add_request(prompt[..at].to_vec(), SamplingParams::greedy(), part_stop)
        .unwrap();
    let mut shipped: HashMap<(usize, usize), Vec<u8>> = HashMap::new();
    while prefill.has_work() {
        prefill
            .step_with(&mut |layer, cache, chunks| {
                for c in chunks {
                    for lb in c.logical_blocks() {
                        let bytes = cache.block_layer_bytes(layer, c.blocks[lb]).unwrap();
                        shipped.insert((lb, layer), bytes.to_vec());
                    }
                }
            })
            .unwrap();
    }
    let mut decode = engine();
    let blocks = decode.reserve(prompt.len()).unwrap();
    let layers = decode.model().config().num_hidden_layers;
    assert_eq!(shipped.len(), at / tandem_kv::BLOCK_SIZE * layers);
    for ((lb, layer), bytes) in &shipped {
        decode
            .import_block_layer(*layer, blocks[*lb], bytes)
            .unwrap();
    }
    let id = decode
        .add_partly_prefilled(
            prompt.to_vec(),
            at,
            ReceivedKv::host(blocks),
            sampling,
            stop,
            None,
        )
        .unwrap();
    let mut outputs = decode.run_to_completion(id).unwrap();
    assert_eq!(decode.used_blocks(), 0, "decode side frees its blocks");
    outputs.sort_by_key(|o| o.choice);
    outputs
}

/// An engine on `model` with `blocks` KV blocks, 256-token passes and 64 sequences at most.
#[allow(dead_code)] // Shared by the engine and scheduling tests only.
pub fn engine(model: &Arc<Model>, blocks: usize) -> Engine {
    let bytes = blocks * model.kv_layout().block_bytes();
    let config = EngineConfig {
        kv_budget_bytes: bytes,
        max_batch_tokens: 256,
        max_running: 64,
        ..Default::default()
    };
    Engine::new(model.clone(), TextTokenizer::byte_level(), config).unwrap()
}

/// Prompt `i` of `len` tokens: distinct per `i`, away from the special tokens.
#[allow(dead_code)]
pub fn prompt(i: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|j| 3 + ((i * 31 + j * 7) % 250) as u32)
        .collect()
}

/// Greedy sampling for `max_tokens` tokens, EOS ignored.
#[allow(dead_code)]
pub fn greedy(max_tokens: usize) -> (SamplingParams, StopParams) {
    (
        SamplingParams::greedy(),
        StopParams {
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        },
    )
}

/// The greedy tokens of `p` alone on a fresh engine: what every batch must reproduce.
#[allow(dead_code)]
pub fn run_alone(model: &Arc<Model>, p: &[u32], max_tokens: usize) -> Vec<u32> {
    greedy_tokens(&mut engine(model, 64), p, max_tokens)
}

/// The greedy tokens of `p` run to completion on `e`.
#[allow(dead_code)]
pub fn greedy_tokens(e: &mut Engine, p: &[u32], max_tokens: usize) -> Vec<u32> {
    let (s, st) = greedy(max_tokens);
    let id = e.add_request(p.to_vec(), s, st).unwrap();
    e.run_to_completion(id)
        .unwrap()
        .iter()
        .map(|o| o.token)
        .collect()
}

/// Steps `e` until it has no work, collecting every output by sequence.
#[allow(dead_code)]
pub fn drain(e: &mut Engine) -> HashMap<u64, Vec<StepOutput>> {
    let mut outs: HashMap<u64, Vec<StepOutput>> = HashMap::new();
    let mut guard = 0;
    while e.has_work() {
        for o in e.step().unwrap() {
            outs.entry(o.id).or_default().push(o);
        }
        guard += 1;
        assert!(guard < 10_000, "engine did not finish");
    }
    outs
}
