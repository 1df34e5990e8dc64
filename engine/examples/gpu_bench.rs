//! GPU benchmark (needs a CUDA device): the device's ceilings measured in the same run (bf16
//! matrix-multiply rate through cuBLAS on random data; a read-only stream's bandwidth; a
//! device-to-device copy's, counting bytes read plus written), then for SmolLM2 and a
//! Llama-3.1-8B-shaped dummy model: prefill tokens/s of 512-, 2048- and 8192-token prompts and
//! their fraction of the matmul peak (FLOPs as computed: the LM head for the last row only),
//! and decode time per step at batch 1, 8, 32 and 128 with contexts of 512 and 4096 against
//! the read floor (the weight bytes one step must read, plus the batch's KV, over the
//! read-only bandwidth). Decode runs attend over random KV written straight into the pool.
//! Prints a table, then one JSON line.
//!
//! `--profile`: builds the 8B dummy, warms up, then runs one 2048-token prefill, one decode
//! step at batch 1 and one at batch 128 between `cuProfilerStart`/`cuProfilerStop`, for
//! `ncu --profile-from-start off` (scripts/gpu/on-device.sh, step `profile`). Each forward
//! starts with the embedding kernel, which splits the three in ncu's launch list.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{
    CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use half::bf16;
use tandem_engine::backend::cuda::forward::StepBuffers;
use tandem_engine::backend::cuda::gpu::{
    CudaDevice, GpuContext, GpuModel, PoolSize, available, device_pool,
};
use tandem_engine::backend::cuda::launch::{Kernel, KernelArg, Launch, LaunchDevice};
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

/// The benchmark's own kernel, compiled with NVRTC beside the engine's: a read-only stream
/// (16-byte loads folded into one word, written only on an impossible value so the loads
/// stay) for the decode floor. The KV pool gets random contents from the engine's seeded
/// fill instead of prompts run through the model (decode timings at long contexts would
/// otherwise wait on minutes of prefill).
const BENCH_KERNELS: &str = r#"
struct alignas(16) words4 { unsigned int x, y, z, w; };
extern "C" __global__ void read_stream(const words4* __restrict__ src, long long n,
                                       unsigned int* __restrict__ out) {
    unsigned int acc = 0;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
        words4 v = src[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) out[0] = acc;
}
"#;

struct BenchKernels {
    read_stream: CudaFunction,
}

impl BenchKernels {
    fn new(gpu: &GpuContext) -> anyhow::Result<Self> {
        let ptx = cudarc::nvrtc::compile_ptx(BENCH_KERNELS)?;
        let module = gpu.ctx.load_module(ptx)?;
        Ok(Self {
            read_stream: module.load_function("read_stream")?,
        })
    }

    fn grid(gpu: &GpuContext) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (gpu.sms * 8, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Bytes per second of a stream that only reads (4 GiB, median of 10 passes).
    fn read_bandwidth(&self, gpu: &Arc<GpuContext>) -> anyhow::Result<f64> {
        let bytes = 4usize << 30;
        let mut src: CudaSlice<bf16> = gpu.stream.alloc_zeros(bytes / 2)?;
        self.fill(gpu, &mut src, 7)?;
        let mut out: CudaSlice<u32> = gpu.stream.alloc_zeros(1)?;
        let words = (bytes / 16) as i64;
        let mut times = Vec::new();
        for pass in 0..11 {
            let t = Instant::now();
            let mut b = gpu.stream.launch_builder(&self.read_stream);
            b.arg(&src).arg(&words).arg(&mut out);
            // SAFETY: read_stream(const words4*, long long, unsigned*) reads `words` 16-byte
            // words of `src` (bytes / 16 of them) and may write out[0].
            unsafe { b.launch(Self::grid(gpu))? };
            gpu.synchronize()?;
            if pass > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        Ok(bytes as f64 / median(&mut times))
    }

    /// Fills `buf` with seeded bf16 values in [-1, 1) (the engine's dummy-weight kernel).
    fn fill(
        &self,
        gpu: &Arc<GpuContext>,
        buf: &mut CudaSlice<bf16>,
        seed: u64,
    ) -> anyhow::Result<()> {
        let n = buf.len();
        let device = CudaDevice::new(gpu.clone());
        // SAFETY: fill_uniform_bf16(bf16*, long long, unsigned long long, float) writes the
        // n elements of `buf`.
        unsafe {
            device.launch(
                Kernel::FillUniformBf16,
                Launch::covering(n.min(1 << 24), 256),
                &mut [
                    KernelArg::Bf16Mut(buf),
                    KernelArg::Long(n as i64),
                    KernelArg::ULong(seed),
                    KernelArg::Float(1.0),
                ],
            )?;
        }
        Ok(())
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Prompt lengths of the prefill runs, and (context, batch) pairs of the decode runs. A
/// batch whose KV does not fit the benchmark's pool is reported as skipped.
const PREFILL_LENGTHS: [usize; 3] = [512, 2048, 8192];
const DECODE_CONTEXTS: [usize; 2] = [512, 4096];
const DECODE_BATCHES: [usize; 4] = [1, 8, 32, 128];
/// The KV pool of the benchmark (16 GB of 8B weights beside it fit an 80 GB card).
const POOL_BYTES: usize = 40 << 30;

struct Prefill {
    tokens: usize,
    tok_s: f64,
    vs_peak: f64,
}

struct Decode {
    context: usize,
    batch: usize,
    /// None: the batch's KV does not fit the pool.
    ms: Option<f64>,
    /// The weights and the batch's KV over the read-only bandwidth.
    floor_ms: f64,
}

struct ModelResult {
    name: String,
    prefill: Vec<Prefill>,
    floor_ms: f64,
    decode: Vec<Decode>,
}

fn bench_model(
    gpu: &Arc<GpuContext>,
    bench: &BenchKernels,
    name: &str,
    model: &GpuModel,
    peak: f64,
    read_bandwidth: f64,
) -> anyhow::Result<ModelResult> {
    let cfg = &model.cfg;
    let vocab = cfg.vocab_size as u32;
    let mut cache = device_pool(gpu, cfg, PoolSize::Budget(POOL_BYTES))?;
    bench.fill(gpu, cache.data_mut(), 11)?;
    let mut buffers = StepBuffers::default();
    let mut pool = BlockPool::new(cache.layout().num_blocks);
    let mut prefill = Vec::new();
    for &len in &PREFILL_LENGTHS {
        let p: Vec<u32> = (0..len as u32)
            .map(|i| (i * 7919 + 104_729) % vocab)
            .collect();
        let table = pool.allocate(blocks_for(len))?;
        // The first run warms up (buffer growth, cuBLAS heuristics); the best of the rest.
        let runs = if len > 2048 { 2 } else { 4 };
        let mut times = Vec::new();
        for _ in 0..runs {
            let t = Instant::now();
            let logits = model.forward(
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
            times.push(t.elapsed().as_secs_f64());
            buffers.recycle_logits(logits);
        }
        pool.release(&table)?;
        let best = times[1..].iter().copied().fold(f64::MAX, f64::min);
        prefill.push(Prefill {
            tokens: len,
            tok_s: len as f64 / best,
            vs_peak: prefill_flops(cfg, len as f64) / best / peak,
        });
    }
    let mut decode = Vec::new();
    for &context in &DECODE_CONTEXTS {
        for &batch in &DECODE_BATCHES {
            let steps = 16;
            let blocks = blocks_for(context + steps + 1);
            if batch * blocks > pool.free_count() {
                decode.push(Decode {
                    context,
                    batch,
                    ms: None,
                    floor_ms: 0.0,
                });
                continue;
            }
            // The pool holds random KV: each sequence attends over `context` positions of
            // it without a prefill.
            let tables: Vec<Vec<u32>> = (0..batch)
                .map(|_| pool.allocate(blocks))
                .collect::<Result<_, _>>()?;
            let next: Vec<Vec<u32>> = (0..batch).map(|i| vec![(i as u32 * 31) % vocab]).collect();
            decode_step(model, &mut cache, &mut buffers, &next, &tables, context)?;
            gpu.synchronize()?;
            let t0 = Instant::now();
            for s in 1..=steps {
                decode_step(model, &mut cache, &mut buffers, &next, &tables, context + s)?;
            }
            gpu.synchronize()?;
            let ms = t0.elapsed().as_secs_f64() * 1e3 / steps as f64;
            let kv_bytes =
                (batch * context * cfg.num_hidden_layers * 2 * cfg.kv_width() * 2) as f64;
            decode.push(Decode {
                context,
                batch,
                ms: Some(ms),
                floor_ms: (decode_read_bytes(cfg) + kv_bytes) / read_bandwidth * 1e3,
            });
            for t in &tables {
                pool.release(t)?;
            }
        }
    }
    Ok(ModelResult {
        name: name.to_string(),
        prefill,
        floor_ms: decode_read_bytes(cfg) / read_bandwidth * 1e3,
        decode,
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
    // As the engine does once it has sampled: the next step fills the same buffer.
    let logits = model.forward(cache, &inputs, buffers)?;
    buffers.recycle_logits(logits);
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
                   table: &[u32]|
     -> anyhow::Result<()> {
        let logits = model.forward(
            cache,
            &[SeqInput {
                tokens,
                start_pos: 0,
                block_table: table,
                logits: true,
                all_logits: false,
            }],
            buffers,
        )?;
        buffers.recycle_logits(logits);
        Ok(())
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
    let bench = BenchKernels::new(&gpu)?;
    let copy = copy_bandwidth(&gpu)?;
    let read = bench.read_bandwidth(&gpu)?;
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
        results.push(bench_model(&gpu, &bench, "SmolLM2-135M", &m, peak, read)?);
    }
    let l8 = GpuModel::dummy(gpu.clone(), ModelConfig::preset("llama-3.1-8b")?, 0)?;
    results.push(bench_model(
        &gpu,
        &bench,
        "dummy Llama-3.1-8B",
        &l8,
        peak,
        read,
    )?);
    println!("| measure | value |\n|---|---|");
    println!(
        "| device copy bandwidth (read + write) | {:.0} GB/s |",
        copy / 1e9
    );
    println!("| read-only stream | {:.0} GB/s |", read / 1e9);
    println!(
        "| bf16 matmul 8192³ (cuBLAS, random data) | {:.0} TFLOP/s |",
        peak / 1e12
    );
    let mut json = serde_json::Map::new();
    json.insert("copy_bandwidth_gb_s".into(), serde_json::json!(copy / 1e9));
    json.insert("read_bandwidth_gb_s".into(), serde_json::json!(read / 1e9));
    json.insert("bf16_matmul_tflops".into(), serde_json::json!(peak / 1e12));
    for r in &results {
        let mut prefill = serde_json::Map::new();
        for p in &r.prefill {
            println!(
                "| {}: prefill {} tokens | {:.0} tok/s ({:.3} of matmul peak) |",
                r.name, p.tokens, p.tok_s, p.vs_peak
            );
            prefill.insert(
                format!("t{}", p.tokens),
                serde_json::json!({"tok_s": p.tok_s, "vs_matmul_peak": p.vs_peak}),
            );
        }
        let mut decode = serde_json::Map::new();
        for d in &r.decode {
            let key = format!("c{}_b{}", d.context, d.batch);
            match d.ms {
                Some(ms) => {
                    println!(
                        "| {}: decode batch {} at context {} | {ms:.2} ms/step (read floor with KV {:.2} ms: {:.2}x it) |",
                        r.name,
                        d.batch,
                        d.context,
                        d.floor_ms,
                        ms / d.floor_ms
                    );
                    decode.insert(key, serde_json::json!({"ms": ms, "floor_ms": d.floor_ms}));
                }
                None => {
                    println!(
                        "| {}: decode batch {} at context {} | skipped: its KV exceeds the {} GiB pool |",
                        r.name,
                        d.batch,
                        d.context,
                        POOL_BYTES >> 30
                    );
                    decode.insert(key, serde_json::Value::Null);
                }
            }
        }
        json.insert(
            r.name.clone(),
            serde_json::json!({
                "prefill": prefill,
                "decode_floor_ms": r.floor_ms,
                "decode_ms": decode,
            }),
        );
    }
    println!("{}", serde_json::Value::Object(json));
    Ok(())
}
