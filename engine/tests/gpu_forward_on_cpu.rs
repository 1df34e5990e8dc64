//! The GPU forward pass, whole, on an emulated device: `backend::cuda::forward` (the same
//! code `GpuModel` runs on CUDA) drives the unchanged CUDA kernels through the CUDA-on-CPU
//! harness and does its GEMMs with cuBLAS's column-major definition applied to exactly the
//! arguments the CUDA device passes (`backend::cuda::blas::linear_call`). Its logits are compared with
//! the CPU engine's on the same bf16-rounded weights, on the scenarios of the on-GPU check
//! (`examples/gpu_check.rs`): a mixed-length batch, decode steps with sequences leaving, a
//! chunked prefill. The bar is the GPU issue's: 1e-2 relative (max |Δ| / max |cpu|).
//!
//! The host staging a GPU engine does for the KV transports (`backend::cuda::staging`: gather,
//! download, layout conversion; conversion, upload, scatter) runs here too, between the
//! emulated pass and CPU caches, and so does the whole device backend as the engine drives it
//! (each layer handed over during the pass, host staging released, received KV imported),
//! and a whole engine over it with prefix caching.
//!
//! This checks the pass's batch layout, buffer sizes, argument order, launch shapes and GEMM
//! mapping; what only a GPU can check (cuBLAS itself, streams, the device's rounding) stays
//! with `gpu_check` on the device.

mod cuda_on_cpu;

use tandem_engine::ChunkInfo;
use tandem_engine::backend::cuda::DeviceBackend;
use tandem_engine::backend::cuda::forward::{self as device_forward, DeviceWeights, StepBuffers};
use tandem_engine::backend::cuda::staging::KvStaging;
use tandem_engine::backend::{Batch, ComputeBackend};
use tandem_engine::config::{ModelConfig, WeightFormat};
use tandem_engine::model::dummy_model;
use tandem_engine::{
    Engine, EngineConfig, EngineError, Model, SamplingParams, SeqInput, StopParams,
};
use tandem_kv::DevicePoolLayout;
use tandem_kv::{BlockPool, KvCache, KvLocation, blocks_for};
use tandem_text::TextTokenizer;

use cuda_on_cpu::device::{Bytes, EmulatedDevice, launches_on_this_thread};

fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    let worst = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .fold(0f32, f32::max);
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    if got.iter().all(|v| v.is_finite()) {
        worst / scale.max(1e-6)
    } else {
        f32::INFINITY
    }
}

/// One model on the CPU engine and on the emulated GPU pass, each with its own KV cache of
/// the same blocks, and the worst relative error seen between their logits so far.
struct SideBySide {
    cpu: Model,
    weights: DeviceWeights<EmulatedDevice>,
    cpu_cache: KvCache,
    gpu_cache: Bytes,
    /// Kept across steps, as the backend keeps them.
    buffers: StepBuffers<EmulatedDevice>,
    blocks: usize,
    worst: f32,
    /// Where the last logits buffer lived and the most values it has held.
    last_logits: Option<(*const f32, usize)>,
}

impl SideBySide {
    fn new(cfg: &ModelConfig, name: &str, blocks: usize) -> Self {
        let cpu = dummy_model(cfg.clone(), WeightFormat::Bf16, 3, name).expect("model");
        let weights = DeviceWeights::upload(&EmulatedDevice, &cpu).expect("upload");
        let layout = cpu.kv_layout();
        Self {
            cpu_cache: KvCache::with_budget(layout.clone(), blocks * layout.block_bytes())
                .expect("cache"),
            gpu_cache: vec![
                0u8;
                2 * blocks
                    * device_forward::block_layer_elems(cfg)
                    * cfg.num_hidden_layers
            ],
            cpu,
            weights,
            buffers: StepBuffers::default(),
            blocks,
            worst: 0.0,
            last_logits: None,
        }
    }

    /// Runs `seqs` on both sides and folds the logits' relative error into `worst`.
    fn step(&mut self, seqs: &[SeqInput<'_>]) {
        let want = self
            .cpu
            .forward(&mut self.cpu_cache, seqs, &mut |_, _| {})
            .expect("CPU forward");
        let got = device_forward::forward(
            &EmulatedDevice,
            self.cpu.config(),
            &self.weights,
            &mut self.gpu_cache,
            self.blocks,
            seqs,
            &mut self.buffers,
            &mut |_, _| Ok(()),
        )
        .expect("emulated GPU forward");
        assert_eq!(got.len(), want.len(), "logit rows");
        for (g, w) in got.iter().zip(&want) {
            self.worst = self.worst.max(relative_error(g, w));
        }
        // Handed back, the logits buffer is filled in place by a pass that fits in it.
        let values = got.len() * got.width();
        if let (Some((ptr, len)), Some(first)) = (self.last_logits, got.row(0))
            && values <= len
        {
            assert_eq!(
                first.as_ptr(),
                ptr,
                "the recycled logits buffer was not reused"
            );
        }
        if let Some(first) = got.row(0) {
            let kept = self.last_logits.map_or(0, |(_, len)| len);
            self.last_logits = Some((first.as_ptr(), values.max(kept)));
        }
        self.buffers.recycle_logits(got);
    }
}

#[test]
fn the_gpu_forward_pass_matches_the_cpu_engine() {
    // The tiny test model (GQA 4/2, head_dim 16), and one with SmolLM2's attention shape
    // (9 heads over 3, head_dim 64: two values per lane) and an untied head.
    let smol_attention = ModelConfig {
        hidden_size: 576,
        intermediate_size: 256,
        num_hidden_layers: 1,
        vocab_size: 300,
        tie_word_embeddings: false,
        ..ModelConfig::preset("smollm2-135m").expect("preset")
    };
    for (name, cfg) in [
        ("tiny", ModelConfig::preset("tiny").expect("preset")),
        ("smol-attention", smol_attention),
    ] {
        let blocks = 24;
        let mut pair = SideBySide::new(&cfg, name, blocks);
        let mut pool = BlockPool::new(blocks);
        let vocab = cfg.vocab_size as u32;
        let prompt = |seed: u32, len: usize| -> Vec<u32> {
            (0..len as u32)
                .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(97)) % vocab)
                .collect()
        };
        // 1. A mixed-length batch, from one token to past two blocks.
        let lens = [1usize, 7, 16, 33];
        let prompts: Vec<Vec<u32>> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| prompt(i as u32 + 1, n))
            .collect();
        let tables: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| pool.allocate(blocks_for(p.len() + 4)).expect("blocks"))
            .collect();
        let inputs: Vec<SeqInput<'_>> = prompts
            .iter()
            .zip(&tables)
            .map(|(p, t)| seq(p, 0, t))
            .collect();
        pair.step(&inputs);
        // 2. Decode steps on top, one sequence leaving each step.
        for step in 0..3 {
            let next: Vec<Vec<u32>> = prompts
                .iter()
                .map(|p| vec![(p[p.len() - 1] + step as u32 + 1) % vocab])
                .collect();
            let inputs: Vec<SeqInput<'_>> = next
                .iter()
                .zip(&tables)
                .zip(&prompts)
                .take(lens.len() - step)
                .map(|((n, t), p)| seq(n, p.len() + step, t))
                .collect();
            pair.step(&inputs);
        }
        // 3. A chunked prefill of 50 tokens, the middle chunk asking for no logits.
        let long = prompt(99, 50);
        let table = pool.allocate(blocks_for(50)).expect("blocks");
        let mut pos = 0;
        for (chunk, logits) in [(20, true), (20, false), (10, true)] {
            let input = [SeqInput {
                tokens: &long[pos..pos + chunk],
                start_pos: pos,
                block_table: &table,
                logits,
                all_logits: false,
            }];
            pair.step(&input);
            pos += chunk;
        }
        let worst = pair.worst;
        assert!(
            worst <= 1e-2,
            "{name}: worst relative error {worst:.2e} (limit 1e-2)"
        );
        eprintln!("{name}: worst relative error {worst:.2e}");
    }
}

#[test]
fn a_bad_batch_is_an_error_before_any_launch() {
    let cfg = ModelConfig::preset("tiny").expect("preset");
    let cpu = dummy_model(cfg.clone(), WeightFormat::Bf16, 3, "tiny").expect("model");
    let weights = DeviceWeights::upload(&EmulatedDevice, &cpu).expect("upload");
    let mut cache = vec![0u8; 2 * 4 * device_forward::block_layer_elems(&cfg) * 2];
    let run = |cache: &mut Bytes, tokens: &[u32], table: &[u32]| {
        device_forward::forward(
            &EmulatedDevice,
            &cfg,
            &weights,
            cache,
            4,
            &[SeqInput {
                tokens,
                start_pos: 0,
                block_table: table,
                logits: true,
                all_logits: false,
            }],
            &mut StepBuffers::default(),
            &mut |_, _| Ok(()),
        )
    };
    // No harness is needed: each is refused on the host.
    assert!(matches!(
        run(&mut cache, &[1, 2], &[9]),
        Err(EngineError::InvalidKv(_))
    ));
    assert!(matches!(
        run(&mut cache, &[500], &[0]),
        Err(EngineError::UnknownToken { id: 500, .. })
    ));
    assert!(matches!(
        run(&mut cache, &[1; 17], &[0]),
        Err(EngineError::InvalidKv(_))
    ));
}

/// One sequence of `tokens` at `start_pos` over `table`, asking for logits.
fn seq<'a>(tokens: &'a [u32], start_pos: usize, table: &'a [u32]) -> SeqInput<'a> {
    SeqInput {
        tokens,
        start_pos,
        block_table: table,
        logits: true,
        all_logits: false,
    }
}

#[test]
fn host_staging_carries_prompt_kv_to_the_cpu_cache_and_back_exactly() {
    let cfg = ModelConfig::preset("tiny").expect("preset");
    let cpu = dummy_model(cfg.clone(), WeightFormat::Bf16, 5, "tiny").expect("model");
    let weights = DeviceWeights::upload(&EmulatedDevice, &cpu).expect("upload");
    let layout = cpu.kv_layout();
    let blocks = 12;
    let pool = DevicePoolLayout {
        num_layers: cfg.num_hidden_layers,
        num_blocks: blocks,
        block_layer_elems: device_forward::block_layer_elems(&cfg),
    };
    let pool_bytes = 2 * pool.num_layers * blocks * pool.block_layer_elems;
    let host_cache = || KvCache::with_budget(layout.clone(), blocks * layout.block_bytes());
    // Scattered blocks, 37 tokens: the last block partly filled.
    let table = [7u32, 2, 9];
    let prompt: Vec<u32> = (0..37u32)
        .map(|i| (i * 31 + 5) % cfg.vocab_size as u32)
        .collect();

    // Prefill side: the emulated pass writes the prompt's KV on the device, and staging
    // copies it to a host cache, layer by layer, as a GPU prefill worker does for shm, tcp
    // and grpc.
    let mut device = vec![0u8; pool_bytes];
    device_forward::forward(
        &EmulatedDevice,
        &cfg,
        &weights,
        &mut device,
        blocks,
        &[seq(&prompt, 0, &table)],
        &mut StepBuffers::default(),
        &mut |_, _| Ok(()),
    )
    .expect("prefill pass");
    let mut staged = host_cache().expect("cache");
    let mut staging = KvStaging::new(&EmulatedDevice, &pool, &table)
        .expect("staging")
        .expect("blocks to stage");
    for layer in 0..pool.num_layers {
        staging
            .download_layer(&EmulatedDevice, &pool, &device, &mut staged, layer, &table)
            .expect("download");
    }
    // It matches the KV the CPU engine computes for the same prompt, to bf16.
    let mut cpu_cache = host_cache().expect("cache");
    cpu.forward(&mut cpu_cache, &[seq(&prompt, 0, &table)], &mut |_, _| {})
        .expect("CPU prefill");
    for layer in 0..pool.num_layers {
        for &b in &table {
            let got = staged.block_layer(layer, b).expect("block");
            let want = cpu_cache.block_layer(layer, b).expect("block");
            let err = relative_error(got, want);
            assert!(
                err <= 1e-2,
                "layer {layer} block {b}: relative error {err:.2e}"
            );
        }
    }

    // Decode side: KV received into a host cache goes up to a fresh device pool, bit for bit
    // what the prefill pass wrote (bf16 → f32 → bf16 is exact).
    let mut received = vec![0u8; pool_bytes];
    KvStaging::new(&EmulatedDevice, &pool, &table)
        .expect("staging")
        .expect("blocks to stage")
        .upload_all(&EmulatedDevice, &pool, &staged, &mut received, &table)
        .expect("upload");
    assert!(
        received == device,
        "the uploaded pool differs from the one the KV came from"
    );

    // And a decode step on it agrees with the CPU engine's.
    let next = [prompt[36]];
    let want = cpu
        .forward(&mut cpu_cache, &[seq(&next, 37, &table)], &mut |_, _| {})
        .expect("CPU decode");
    let got = device_forward::forward(
        &EmulatedDevice,
        &cfg,
        &weights,
        &mut received,
        blocks,
        &[seq(&next, 37, &table)],
        &mut StepBuffers::default(),
        &mut |_, _| Ok(()),
    )
    .expect("decode pass");
    let err = relative_error(got.row(0).expect("a logits row"), &want[0]);
    assert!(
        err <= 1e-2,
        "decode after staging: relative error {err:.2e}"
    );

    // A block outside the pool is refused before any launch.
    assert!(matches!(
        KvStaging::new(&EmulatedDevice, &pool, &[3, blocks as u32]),
        Err(EngineError::InvalidKv(_))
    ));
}

/// The device backend as the engine drives it, on the emulated device: after each layer of a
/// prompt, that layer's KV reaches the host view (and no later layer's yet), matching the CPU
/// engine to bf16; once the hook has run, the host releases it. Step buffers are kept across
/// steps. On the decode side, KV received into the host is uploaded, released, and decoded
/// from as the CPU engine does.
#[test]
fn the_device_backend_hands_each_layer_over_then_releases_it() {
    // SmolLM2's attention shape: a block-layer of 24 KiB, whole pages the host can release.
    let cfg = ModelConfig {
        num_hidden_layers: 3,
        vocab_size: 512,
        ..ModelConfig::preset("smollm2-135m").expect("preset")
    };
    let cpu = dummy_model(cfg.clone(), WeightFormat::Bf16, 9, "smol3").expect("model");
    let layout = cpu.kv_layout();
    let blocks = 12;
    let host_cache = || KvCache::with_budget(layout.clone(), blocks * layout.block_bytes());
    let table = vec![7u32, 2, 9];
    let prompt: Vec<u32> = (0..37u32).map(|i| (i * 31 + 5) % 512).collect();
    let chunks = [ChunkInfo {
        id: 1,
        start_pos: 0,
        len: prompt.len(),
        blocks: table.clone(),
    }];
    let mut cpu_cache = host_cache().expect("cache");
    cpu.forward(&mut cpu_cache, &[seq(&prompt, 0, &table)], &mut |_, _| {})
        .expect("CPU prefill");

    let mut backend =
        DeviceBackend::new(EmulatedDevice, "emulated", &cpu, blocks).expect("backend");
    assert!(backend.device_kv().is_none(), "no device memory to name");
    let mut host = host_cache().expect("cache");
    let mut seen = Vec::new();
    let mut at = Vec::new();
    let inputs = [seq(&prompt, 0, &table)];
    let batch = Batch {
        seqs: &inputs,
        chunks: &chunks,
        prompt_work: true,
    };
    let start = launches_on_this_thread();
    backend
        .forward(&mut host, &batch, &mut |layer, view, _| {
            for &b in &table {
                let got = view.block_layer(layer, b).expect("block");
                let want = cpu_cache.block_layer(layer, b).expect("block");
                let err = relative_error(got, want);
                assert!(err <= 1e-2, "layer {layer} block {b}: {err:.2e}");
                if layer + 1 < cfg.num_hidden_layers {
                    let next = view.block_layer(layer + 1, b).expect("block");
                    assert!(
                        next.iter().all(|&v| v == 0.0),
                        "layer {} came early",
                        layer + 1
                    );
                }
            }
            seen.push(layer);
            at.push(launches_on_this_thread());
        })
        .expect("prefill on the device");
    assert_eq!(seen, [0, 1, 2], "one hook per layer, in order");
    // Each layer is handed over during the pass, once the next layer is queued (the device
    // computes it meanwhile): the first hook after the embedding and two layers, then one
    // hook per layer's worth of launches, the last after the pass.
    let end = launches_on_this_thread();
    let at: Vec<usize> = at.iter().map(|a| a - start).collect();
    let per_layer = at[1] - at[0];
    assert_eq!(
        at[0],
        1 + 2 * per_layer,
        "first hook at {at:?}, pass of {}",
        end - start
    );
    assert!(at[1] < end - start, "layer 1 waited for the end: {at:?}");
    assert_eq!(
        at[2],
        end - start,
        "the last layer comes down after the pass"
    );
    for layer in 0..cfg.num_hidden_layers {
        for &b in &table {
            let left = host.block_layer(layer, b).expect("block");
            assert!(
                left.iter().all(|&v| v == 0.0),
                "layer {layer} block {b} kept"
            );
        }
    }
    assert_eq!(backend.buffers().allocations(), 1);

    // Without host export (device-to-device transports), the hook still runs per layer and
    // the host is left alone.
    backend.set_host_kv_export(false);
    let mut calls = 0;
    backend
        .forward(&mut host, &batch, &mut |_, _, _| calls += 1)
        .expect("prefill without host copies");
    assert_eq!(calls, 3);
    assert!(
        host.block_layer(0, 7)
            .expect("block")
            .iter()
            .all(|&v| v == 0.0)
    );

    // Decode side: the CPU's KV arrives in a host cache, goes up, and is released there.
    let next = [prompt[36]];
    let want = cpu
        .forward(&mut cpu_cache, &[seq(&next, 37, &table)], &mut |_, _| {})
        .expect("CPU decode");
    let mut decoder =
        DeviceBackend::new(EmulatedDevice, "emulated", &cpu, blocks).expect("backend");
    decoder
        .import_blocks(&mut cpu_cache, &table, KvLocation::Host)
        .expect("import");
    assert!(
        cpu_cache
            .block_layer(1, 2)
            .expect("block")
            .iter()
            .all(|&v| v == 0.0)
    );
    let decode_inputs = [seq(&next, 37, &table)];
    let decode = Batch {
        seqs: &decode_inputs,
        chunks: &[],
        prompt_work: false,
    };
    let mut hooks = 0;
    let got = decoder
        .forward(&mut cpu_cache, &decode, &mut |_, _, _| hooks += 1)
        .expect("decode on the device");
    assert_eq!(hooks, 0, "decode steps need no hook");
    let err = relative_error(got.row(0).expect("a logits row"), &want[0]);
    assert!(err <= 1e-2, "decode after import: {err:.2e}");
    // A one-row step reuses the buffers a 37-row one made; device-resident KV needs nothing.
    backend
        .forward(&mut host, &decode, &mut |_, _, _| {})
        .expect("decode step");
    assert_eq!(backend.buffers().allocations(), 1);
    assert!(backend.buffers().capacity() >= 37);
    decoder
        .import_blocks(&mut cpu_cache, &table, KvLocation::Device)
        .expect("device-resident KV");
}

#[test]
fn families_the_device_kernels_lack_are_refused_by_name() {
    for (preset, lacks) in [
        ("qwen2.5-0.5b", "biases on the Q, K and V projections"),
        ("qwen3-0.6b", "per-head RMSNorm of Q and K"),
        ("gemma2-2b", "Gemma's post-norms"),
        // Phi-3 mini's 2047-key window is shorter than its 4096-token context.
        ("phi3-mini", "sliding-window attention"),
    ] {
        let full = ModelConfig::preset(preset).expect("preset");
        let cfg = ModelConfig {
            num_hidden_layers: 1,
            vocab_size: 64,
            hidden_size: full.hidden_size.min(512),
            intermediate_size: full.intermediate_size.min(512),
            ..full
        };
        let model = dummy_model(cfg, WeightFormat::Bf16, 1, preset).expect("model");
        match DeviceBackend::new(EmulatedDevice, "emulated", &model, 4) {
            Err(EngineError::Unsupported(why)) => {
                assert!(why.contains(lacks) && why.contains("--device cpu"), "{why}")
            }
            Err(other) => panic!("{preset}: {other}"),
            Ok(_) => panic!("{preset} must be refused on the GPU engine"),
        }
    }
}

/// Prefix caching on the device backend as the engine drives it: a prompt whose prefix an
/// earlier request computed takes those blocks of the device pool and computes only the rest,
/// and every token and logprob is what the same engine without caching gives (the blocks a
/// pass wrote on the device are the ones a later pass reads).
#[test]
fn a_cached_prefix_on_the_device_backend_changes_only_the_work() {
    let cfg = ModelConfig::preset("tiny").expect("preset");
    let model =
        std::sync::Arc::new(dummy_model(cfg, WeightFormat::Bf16, 5, "tiny").expect("model"));
    let engine = |prefix_caching: bool| {
        let blocks = 32;
        let layout = model.kv_layout();
        let cache =
            KvCache::with_budget(layout.clone(), blocks * layout.block_bytes()).expect("cache");
        let backend = DeviceBackend::new(EmulatedDevice, "emulated", &model, cache.num_blocks())
            .expect("backend");
        let config = EngineConfig {
            kv_budget_bytes: blocks * layout.block_bytes(),
            max_batch_tokens: 256,
            prefix_caching,
            ..EngineConfig::default()
        };
        Engine::with_backend(
            model.clone(),
            TextTokenizer::byte_level(),
            config,
            cache,
            Box::new(backend),
        )
        .expect("engine")
    };
    let first: Vec<u32> = (0..36u32).map(|i| 3 + (i * 31 + 5) % 250).collect();
    let mut second = first.clone();
    second.extend((0..12u32).map(|i| 3 + (i * 17 + 2) % 250));
    let sampling = SamplingParams {
        top_logprobs: 2,
        ..SamplingParams::greedy()
    };
    let stop = StopParams {
        max_tokens: 3,
        ignore_eos: true,
        ..StopParams::default()
    };
    let run = |e: &mut Engine, prompt: &[u32]| {
        e.add_request(prompt.to_vec(), sampling.clone(), stop.clone())
            .expect("add");
        let mut out = Vec::new();
        for _ in 0..100 {
            if !e.has_work() {
                break;
            }
            for o in e.step().expect("step") {
                out.push((o.token, o.logprob.to_bits(), o.top_logprobs.clone()));
            }
        }
        out
    };
    let (mut cached, mut plain) = (engine(true), engine(false));
    assert_eq!(run(&mut cached, &first), run(&mut plain, &first));
    let before = cached.stats().prefill_tokens;
    assert_eq!(run(&mut cached, &second), run(&mut plain, &second));
    // The 36-token prompt left 2 full blocks: the second prompt computed 48 - 32 tokens.
    assert_eq!(cached.stats().prefill_tokens - before, 16);
    assert_eq!(cached.stats().prefix_hit_tokens, 32);
}
