//! GPU benchmark (needs a CUDA device): the device's two ceilings measured in the same run (bf16
//! matrix-multiply rate through cuBLAS on random data, device-to-device copy bandwidth counting
//! bytes read plus written), then for SmolLM2 and a Llama-3.1-8B-shaped dummy model: prefill
//! tokens/s of a 2048-token prompt and its fraction of the matmul peak (FLOPs as computed: the
//! LM head for the last row only), and decode time per step at batch 1, 32 and 128 against the
//! read floor (the bytes one step must read, over the measured streaming bandwidth). Prints a
//! table, then one JSON line.
//!
//! `--profile`: builds the 8B dummy, warms up, then runs one 2048-token prefill, one decode
//! step at batch 1 and one at batch 128 between `cuProfilerStart`/`cuProfilerStop`, for
//! `ncu --profile-from-start off` (scripts/gpu/on-device.sh, step `profile`). Each forward
//! starts with the embedding kernel, which splits the three in ncu's launch list.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;
use tandem_engine::backend::cuda::forward::StepBuffers;
use tandem_engine::backend::cuda::gpu::{GpuContext, GpuModel, PoolSize, available, device_pool};
use tandem_engine::config::ModelConfig;
use tandem_engine::{LoadOptions, ModelSource, SeqInput, WeightFormat, load_model};
use tandem_kv::{BlockPool, blocks_for};

fn copy_bandwidth(gpu: &GpuContext) -> anyhow::Result<f64> {
    let n = 1usize << 30; // 2 GiB of bf16
    let src: CudaSlice<bf16> = gpu.stream.alloc_zeros(n)?;
    let mut dst: CudaSlice<bf16> = gpu.stream.alloc_zeros(n)?;
    gpu.stream.memcpy_dtod(&src, &mut dst)?;
    gpu.synchronize()?;
    let t = Instant::now();
    for _ in 0..10 {
        gpu.stream.memcpy_dtod(&src, &mut dst)?;
    }
    gpu.synchronize()?;
    // Bytes read plus bytes written, as device copy figures are usually quoted.
    Ok((10 * 2 * 2 * n) as f64 / t.elapsed().as_secs_f64())
}

/// `n` bf16 values in [-1, 1) from a fixed xorshift stream: the matmul peak is measured on
/// random data, since zeros run faster than real data on these chips.
fn random_bf16(n: usize, seed: u64) -> Vec<bf16> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            bf16::from_f32((x >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        })
        .collect()
}

fn matmul_rate(gpu: &GpuContext) -> anyhow::Result<f64> {
    use cudarc::cublas::{Gemm, GemmConfig, sys};
    let s = 8192usize;
    let a: CudaSlice<bf16> = gpu.stream.clone_htod(&random_bf16(s * s, 1))?;
    let b: CudaSlice<bf16> = gpu.stream.clone_htod(&random_bf16(s * s, 2))?;
    let mut c: CudaSlice<bf16> = gpu.stream.alloc_zeros(s * s)?;
    let cfg = GemmConfig {
        transa: sys::cublasOperation_t::CUBLAS_OP_N,
        transb: sys::cublasOperation_t::CUBLAS_OP_N,
        m: s as i32,
        n: s as i32,
        k: s as i32,
        alpha: bf16::ONE,
        lda: s as i32,
        ldb: s as i32,
        beta: bf16::ZERO,
        ldc: s as i32,
    };
    let blas = cudarc::cublas::CudaBlas::new(gpu.stream.clone())?;
    for _ in 0..3 {
        // SAFETY: square buffers of s² elements.
        unsafe { blas.gemm(cfg, &a, &b, &mut c)? };
    }
    gpu.synchronize()?;
    let t = Instant::now();
    for _ in 0..10 {
        unsafe { blas.gemm(cfg, &a, &b, &mut c)? };
    }
    gpu.synchronize()?;
    let _ = (a.device_ptr(&gpu.stream), c.device_ptr_mut(&gpu.stream));
    Ok(10.0 * 2.0 * (s * s * s) as f64 / t.elapsed().as_secs_f64())
}

/// Multiply-adds of a `t`-token prefill, counted as computed: every layer's projections for
/// every token, causal attention (half the square), the LM head for the last row only (the
/// embedding is a gather, no arithmetic).
fn prefill_flops(cfg: &ModelConfig, t: f64) -> f64 {
    let lm_head = (cfg.vocab_size * cfg.hidden_size) as f64;
    let embed = lm_head;
    let untied_head = if cfg.tie_word_embeddings {
        0.0
    } else {
        lm_head
    };
    let layers = cfg.num_parameters() as f64 - embed - untied_head;
    2.0 * layers * t
        + 2.0 * lm_head
        + 4.0 * cfg.num_hidden_layers as f64 * cfg.q_width() as f64 * t * t / 2.0
}

/// Bytes one decode step must read at least: every layer's weights and the LM head once (the
/// embedding contributes one row per sequence).
fn decode_read_bytes(cfg: &ModelConfig) -> f64 {
    let embed = (cfg.vocab_size * cfg.hidden_size) as f64;
    let params = cfg.num_parameters() as f64;
    let read = if cfg.tie_word_embeddings {
        params
    } else {
        params - embed
    };
    read * 2.0
}

struct ModelResult {
    name: String,
    prefill_tok_s: f64,
    prefill_vs_peak: f64,
    floor_ms: f64,
    decode_ms: Vec<(usize, f64)>,
}

fn bench_model(
    gpu: &Arc<GpuContext>,
    name: &str,
    model: &GpuModel,
    peak: f64,
    bandwidth: f64,
) -> anyhow::Result<ModelResult> {
    let cfg = &model.cfg;
    let vocab = cfg.vocab_size as u32;
    let mut cache = device_pool(gpu, cfg, PoolSize::Budget(40 << 30))?;
    let mut buffers = StepBuffers::default();
    let mut pool = BlockPool::new(cache.layout().num_blocks);
    let prompt = |seed: u32, len: usize| -> Vec<u32> {
        (0..len as u32)
            .map(|i| (i * 7919 + seed * 104_729) % vocab)
            .collect()
    };
    // Prefill: one 2048-token prompt (best of 3).
    let p = prompt(1, 2048);
    let table = pool.allocate(blocks_for(2048))?;
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        model.forward(
            &mut cache,
            &[SeqInput {
                tokens: &p,
                start_pos: 0,
                block_table: &table,
                logits: true,
                all_logits: false,
            }],
            &mut buffers,
        )?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    pool.release(&table)?;
    let t = 2048.0;
    let flops = prefill_flops(cfg, t);
    let mut decode_ms = Vec::new();
    for &batch in &[1usize, 32, 128] {
        let ctx = 512;
        let prompts: Vec<Vec<u32>> = (0..batch).map(|i| prompt(i as u32 + 2, ctx)).collect();
        let tables: Vec<Vec<u32>> = (0..batch)
            .map(|_| pool.allocate(blocks_for(ctx + 64)))
            .collect::<Result<_, _>>()?;
        for chunk in prompts.iter().zip(&tables).collect::<Vec<_>>().chunks(8) {
            let inputs: Vec<SeqInput<'_>> = chunk
                .iter()
                .map(|(p, t)| SeqInput {
                    tokens: p,
                    start_pos: 0,
                    block_table: t,
                    logits: false,
                    all_logits: false,
                })
                .collect();
            model.forward(&mut cache, &inputs, &mut buffers)?;
        }
        let steps = 16;
        let next: Vec<Vec<u32>> = (0..batch).map(|i| vec![(i as u32 * 31) % vocab]).collect();
        let t0 = Instant::now();
        for s in 0..steps {
            let inputs: Vec<SeqInput<'_>> = next
                .iter()
                .zip(&tables)
                .map(|(n, t)| SeqInput {
                    tokens: n,
                    start_pos: ctx + s,
                    block_table: t,
                    logits: true,
                    all_logits: false,
                })
                .collect();
            model.forward(&mut cache, &inputs, &mut buffers)?;
        }
        decode_ms.push((batch, t0.elapsed().as_secs_f64() * 1e3 / steps as f64));
        for t in &tables {
            pool.release(t)?;
        }
    }
    Ok(ModelResult {
        name: name.to_string(),
        prefill_tok_s: t / best,
        prefill_vs_peak: flops / best / peak,
        // A copy's figure counts bytes read plus written, the rate a read-only stream gets.
        floor_ms: decode_read_bytes(cfg) / bandwidth * 1e3,
        decode_ms,
    })
}

/// One decode step: one token per sequence at position `pos`, logits for each.
fn decode_step(
    model: &GpuModel,
    cache: &mut tandem_kv::cuda::DevicePool,
    buffers: &mut StepBuffers<tandem_engine::backend::cuda::gpu::CudaDevice>,
    next: &[Vec<u32>],
    tables: &[Vec<u32>],
    pos: usize,
) -> anyhow::Result<()> {
    let inputs: Vec<SeqInput<'_>> = next
        .iter()
        .zip(tables)
        .map(|(n, t)| SeqInput {
            tokens: n,
            start_pos: pos,
            block_table: t,
            logits: true,
            all_logits: false,
        })
        .collect();
    model.forward(cache, &inputs, buffers)?;
    Ok(())
}

/// `--profile` (see the module doc): one prefill and two decode steps of the 8B dummy, warmed
/// up, inside the profiler's window.
fn profile(gpu: &Arc<GpuContext>) -> anyhow::Result<()> {
    let model = GpuModel::dummy(gpu.clone(), ModelConfig::preset("llama-3.1-8b")?, 0)?;
    let vocab = model.cfg.vocab_size as u32;
    let mut cache = device_pool(gpu, &model.cfg, PoolSize::Budget(40 << 30))?;
    let mut buffers = StepBuffers::default();
    let mut pool = BlockPool::new(cache.layout().num_blocks);
    let prompt: Vec<u32> = (0..2048u32).map(|i| (i * 7919) % vocab).collect();
    let long = pool.allocate(blocks_for(2048))?;
    let ctx = 512;
    let tables: Vec<Vec<u32>> = (0..128)
        .map(|_| pool.allocate(blocks_for(ctx + 8)))
        .collect::<Result<_, _>>()?;
    let prefill = |cache: &mut tandem_kv::cuda::DevicePool,
                   buffers: &mut StepBuffers<tandem_engine::backend::cuda::gpu::CudaDevice>,
                   tokens: &[u32],
                   table: &[u32]| {
        model.forward(
            cache,
            &[SeqInput {
                tokens,
                start_pos: 0,
                block_table: table,
                logits: true,
                all_logits: false,
            }],
            buffers,
        )
    };
    for t in &tables {
        prefill(&mut cache, &mut buffers, &prompt[..ctx], t)?;
    }
    let next: Vec<Vec<u32>> = (0..128u32).map(|i| vec![(i * 31) % vocab]).collect();
    // The same pass twice: first to warm up (module loads, cuBLAS heuristics and buffer growth
    // stay out of the window), then inside it.
    let mut pass = |pos: usize| -> anyhow::Result<()> {
        prefill(&mut cache, &mut buffers, &prompt, &long)?;
        decode_step(
            &model,
            &mut cache,
            &mut buffers,
            &next[..1],
            &tables[..1],
            pos,
        )?;
        decode_step(&model, &mut cache, &mut buffers, &next, &tables, pos)?;
        gpu.synchronize()?;
        Ok(())
    };
    pass(ctx)?;
    cudarc::driver::profiler_start()?;
    pass(ctx + 1)?;
    cudarc::driver::profiler_stop()?;
    println!("profiled: prefill 2048 tokens, decode batch 1 and batch 128 at context {ctx}");
    Ok(())
}

fn main() -> anyhow::Result<()> {
    if !available() {
        println!("SKIP: no CUDA device here");
        return Ok(());
    }
    let cache_dir = std::env::var_os("TANDEM_CACHE")
        .map_or_else(tandem_engine::fetch::default_cache_dir, PathBuf::from);
    // Under a deployment's green-context share (or an MPS percentage from the environment),
    // the benchmark measures what that share gets.
    let green = std::env::var("TANDEM_GREEN_CONTEXT_SMS")
        .ok()
        .and_then(|v| v.parse().ok());
    let gpu = Arc::new(GpuContext::new(0, green)?);
    println!("device share: {} SMs", gpu.sms);
    if std::env::args().any(|a| a == "--profile") {
        return profile(&gpu);
    }
    let bandwidth = copy_bandwidth(&gpu)?;
    let peak = matmul_rate(&gpu)?;
    let mut results = Vec::new();
    if let Ok((cpu, _)) = load_model(
        &ModelSource::DefaultSmolLm2,
        &LoadOptions {
            format: WeightFormat::Bf16,
            cache_dir,
            ..Default::default()
        },
    ) {
        let m = GpuModel::upload(gpu.clone(), &cpu)?;
        results.push(bench_model(&gpu, "SmolLM2-135M", &m, peak, bandwidth)?);
    }
    let l8 = GpuModel::dummy(gpu.clone(), ModelConfig::preset("llama-3.1-8b")?, 0)?;
    results.push(bench_model(
        &gpu,
        "dummy Llama-3.1-8B",
        &l8,
        peak,
        bandwidth,
    )?);
    println!("| measure | value |\n|---|---|");
    println!(
        "| device copy bandwidth (read + write) | {:.0} GB/s |",
        bandwidth / 1e9
    );
    println!(
        "| bf16 matmul 8192³ (cuBLAS) | {:.0} TFLOP/s |",
        peak / 1e12
    );
    let mut json = serde_json::Map::new();
    json.insert(
        "copy_bandwidth_gb_s".into(),
        serde_json::json!(bandwidth / 1e9),
    );
    json.insert("bf16_matmul_tflops".into(), serde_json::json!(peak / 1e12));
    for r in &results {
        println!(
            "| {}: prefill 2048 tokens | {:.0} tok/s ({:.2} of matmul peak) |",
            r.name, r.prefill_tok_s, r.prefill_vs_peak
        );
        for (b, ms) in &r.decode_ms {
            println!(
                "| {}: decode batch {b} | {ms:.2} ms/step (weight floor {:.2} ms, {:.2} of it) |",
                r.name,
                r.floor_ms,
                r.floor_ms / ms
            );
        }
        json.insert(
            r.name.clone(),
            serde_json::json!({
                "prefill_tok_s": r.prefill_tok_s,
                "prefill_vs_matmul_peak": r.prefill_vs_peak,
                "decode_floor_ms": r.floor_ms,
                "decode_ms": r.decode_ms.iter().map(|(b, ms)| (format!("b{b}"), serde_json::json!(ms))).collect::<serde_json::Map<_, _>>(),
            }),
        );
    }
    println!("{}", serde_json::Value::Object(json));
    Ok(())
}
