//! Engine benchmark: the machine's two physical floors (memory bandwidth from a large copy,
//! f32 matmul rate), then the model's prefill rate on a 512-token prompt and its decode rate
//! at batch 1, 8, 32 and 64, each set against the floor that bounds it.
//!
//! `cargo run --release -p tandem-engine --example engine_bench -- --model smollm2`
//! prints a table and, last, one JSON line. `--weights f32|bf16|q8_0|…` stores the weights
//! otherwise than the file does (default `native`); the decode floor counts the bytes a step
//! reads in that storage. `--kv-dtype bf16|f16` keeps the KV cache in half precision. `--isa avx2` (or `TANDEM_ISA=avx2`) runs the
//! kernels of another instruction set than the CPU's best; both print the set that ran.
//! `--prompt-len N`, `--decode-prompt-len N` (the decode runs' prompts, default 128) and
//! `--decode-steps N` size the runs; `--copy-mib N` (default 512) and
//! `--matmul-size N` (default 2048) size the floor measurements, which smoke runs shrink.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{Device, Tensor};
use rayon::prelude::*;
use tandem_engine::backend::cpu::kernels::{
    IntTile, Isa, Matrix, WeightData, isa, linear, select_isa,
};
use tandem_engine::{
    Engine, EngineConfig, LoadOptions, ModelSource, SamplingParams, StopParams, WeightFormat,
    load_model,
};

/// The engine alone: the machine's floors, then the model's prefill and decode rates.
#[derive(clap::Parser)]
struct Args {
    /// A preset (`smollm2`, `tiny`, `dummy:SHAPE`…), a GGUF file or a model folder.
    #[arg(long, default_value = "smollm2")]
    model: String,
    /// How the weights are stored: `native` (as the file stores them), `f32`, `bf16`,
    /// `q8_0`…
    #[arg(long, default_value = "native")]
    weights: WeightFormat,
    /// The KV cache's element type: `f32`, `bf16` or `f16`.
    #[arg(long, default_value = "f32")]
    kv_dtype: tandem_kv::KvDtype,
    /// Where models are cached (default: the user's cache folder).
    #[arg(long, env = "TANDEM_CACHE")]
    cache: Option<PathBuf>,
    /// Tokens of the prefill run's prompt.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    prompt_len: u32,
    /// Tokens of each decode run's prompts.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
    decode_prompt_len: u32,
    /// Steps each decode run times.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    decode_steps: u32,
    /// Size of the bandwidth measurement's buffers, MiB.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(4..=65536))]
    copy_mib: u32,
    /// Side of the square matmul that measures the peak.
    #[arg(long, default_value_t = 2048, value_parser = clap::value_parser!(u32).range(16..=16384))]
    matmul_size: u32,
    /// The kernels of another instruction set than the CPU's best (as `TANDEM_ISA`).
    #[arg(long)]
    isa: Option<String>,
}

/// Best-of-5 parallel copy of a `mib` MiB buffer (512 by default); bytes read plus bytes
/// written per second (STREAM's convention).
fn copy_bandwidth(mib: usize) -> f64 {
    let n = mib << 18; // f32 elements
    let src: Vec<f32> = (0..n).into_par_iter().map(|i| i as f32).collect();
    let mut dst = vec![0f32; n];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        dst.par_chunks_mut(1 << 20)
            .zip(src.par_chunks(1 << 20))
            .for_each(|(d, s)| d.copy_from_slice(s));
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    (2 * n * 4) as f64 / best
}

/// Best-of-5 parallel read (sum) of a `mib` MiB buffer, bytes per second: what a decode step
/// streaming weights can hope for; reported beside the copy figure.
fn read_bandwidth(mib: usize) -> f64 {
    let n = mib << 18;
    let src: Vec<f32> = (0..n).into_par_iter().map(|i| (i % 7) as f32).collect();
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        let total: f32 = src
            .par_chunks(1 << 20)
            .map(|c| {
                let mut acc = [0f32; 64];
                for ch in c.chunks_exact(64) {
                    for (a, v) in acc.iter_mut().zip(ch) {
                        *a += v;
                    }
                }
                acc.iter().sum::<f32>()
            })
            .sum();
        std::hint::black_box(total);
        best = best.min(t.elapsed().as_secs_f64());
    }
    (n * 4) as f64 / best
}

/// f32 matmul rate: candle's BLAS (gemm) on `s`³ (2048³ by default), and this crate's
/// batch-invariant kernel on the same shape; the better of the two is the peak.
fn matmul_rates(s: usize) -> anyhow::Result<(f64, f64)> {
    let flops = 2.0 * (s * s * s) as f64;
    let a = Tensor::randn(0f32, 1.0, (s, s), &Device::Cpu)?;
    let b = Tensor::randn(0f32, 1.0, (s, s), &Device::Cpu)?;
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        std::hint::black_box(a.matmul(&b)?);
        best = best.min(t.elapsed().as_secs_f64());
    }
    let candle = flops / best;
    let x: Vec<f32> = a.flatten_all()?.to_vec1()?;
    let w = Matrix::new(s, s, WeightData::F32(b.flatten_all()?.to_vec1()?));
    let mut out = vec![0f32; s * s];
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        linear(&x, s, &w, &mut out);
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok((candle, flops / best))
}

fn main() -> anyhow::Result<()> {
    let args: Args = clap::Parser::parse();
    if let Some(name) = &args.isa {
        select_isa(Isa::parse(name)?)?;
    }
    let cache = args
        .cache
        .clone()
        .unwrap_or_else(tandem_engine::fetch::default_cache_dir);
    let (prompt_len, decode_prompt_len, decode_steps) = (
        args.prompt_len as usize,
        args.decode_prompt_len as usize,
        args.decode_steps as usize,
    );
    let threads = rayon::current_num_threads();
    // Resolve the kernels' instruction set before timing anything (TANDEM_ISA is refused here,
    // with its reason, if this CPU cannot run it).
    let isa = match tandem_engine::backend::cpu::kernels::isa_from_env()? {
        Some(chosen) => select_isa(chosen)?,
        None => isa(),
    };
    eprintln!("measuring floors ({threads} threads, {isa} kernels)...");
    let bandwidth = copy_bandwidth(args.copy_mib as usize);
    let read_bw = read_bandwidth(args.copy_mib as usize);
    let (candle_gflops, own_gflops) = matmul_rates(args.matmul_size as usize)?;
    let m = args.matmul_size as usize;
    let peak = candle_gflops.max(own_gflops);

    let source: ModelSource = args.model.parse()?;
    let opts = LoadOptions {
        format: args.weights,
        kv_dtype: args.kv_dtype,
        cache_dir: cache,
        tokenizer: None,
        ..Default::default()
    };
    eprintln!("loading {}...", args.model);
    let (model, tokenizer) = load_model(&source, &opts)?;
    let model = Arc::new(model);
    let cfg = model.config().clone();
    // What one decode step reads: every layer matrix, the LM head and the norms (an untied
    // embedding table is only looked up), in the format they are stored in.
    let weight_bytes = model.weights().bytes_read_per_step();
    let vocab = cfg.vocab_size as u32;
    let config = EngineConfig {
        kv_budget_bytes: 2 << 30,
        max_batch_tokens: 4096,
        max_running: 256,
        ..Default::default()
    };
    let prompt = |seed: u32, len: usize| -> Vec<u32> {
        (0..len as u32)
            .map(|i| 3 + (i * 7919 + seed * 104_729) % (vocab - 3))
            .collect()
    };
    let greedy = SamplingParams::greedy();
    let stop = |n| StopParams {
        max_tokens: n,
        ignore_eos: true,
        ..Default::default()
    };

    // Prefill: one 512-token prompt in one forward pass (best of 3).
    let mut prefill_s = f64::MAX;
    for i in 0..3 {
        let mut engine = Engine::new(model.clone(), tokenizer.clone(), config.clone())?;
        engine.add_request(prompt(i, prompt_len), greedy.clone(), stop(1))?;
        let t = Instant::now();
        engine.step()?;
        prefill_s = prefill_s.min(t.elapsed().as_secs_f64());
    }
    let t = prompt_len as f64;
    let linear_flops = 2.0 * (cfg.num_parameters() - cfg.vocab_size * cfg.hidden_size) as f64 * t
        + 2.0 * (cfg.vocab_size * cfg.hidden_size) as f64; // LM head for the last token only
    let attn_flops =
        2.0 * 2.0 * cfg.num_hidden_layers as f64 * (cfg.q_width() as f64) * t * (t + 1.0) / 2.0;
    let prefill_flops = linear_flops + attn_flops;
    let prefill_tok_s = t / prefill_s;
    let prefill_vs_peak = prefill_flops / prefill_s / peak;

    // Decode: N sequences with 128-token prompts (--decode-prompt-len), timed over steps that
    // are pure decode.
    let mut decode = Vec::new();
    for &batch in &[1usize, 8, 32, 64] {
        let mut engine = Engine::new(model.clone(), tokenizer.clone(), config.clone())?;
        for i in 0..batch {
            engine.add_request(
                prompt(i as u32, decode_prompt_len),
                greedy.clone(),
                stop(decode_steps + 2),
            )?;
        }
        engine.step()?; // prefill of every prompt (fits the token budget)
        engine.step()?; // first decode step: warm-up
        let t0 = Instant::now();
        let mut tokens = 0;
        for _ in 0..decode_steps {
            tokens += engine.step()?.len();
        }
        let secs = t0.elapsed().as_secs_f64();
        decode.push((batch, secs / decode_steps as f64, tokens as f64 / secs));
    }
    // The floor uses the faster of the two bandwidth figures, so it is never flattering.
    let floor_step = weight_bytes as f64 / bandwidth.max(read_bw);
    let b1_step = decode[0].1;
    let b1_tok = decode[0].2;
    let b32_tok = decode.iter().find(|d| d.0 == 32).map_or(0.0, |d| d.2);

    println!("| measure | value |");
    println!("|---|---|");
    println!("| threads | {threads} |");
    println!("| kernels (instruction set) | {isa} |");
    let compute = tandem_engine::backend::cpu::kernels::compute_decision();
    let int_tile = compute.mode.integer_tile(isa).map_or("none", IntTile::name);
    println!(
        "| quantized weights compute (TANDEM_COMPUTE) | {} ({}; integer tile: {int_tile}) |",
        compute.mode, compute.reason
    );
    println!(
        "| memory bandwidth (copy, read+write) | {:.1} GB/s |",
        bandwidth / 1e9
    );
    println!(
        "| memory bandwidth (read only, for reference) | {:.1} GB/s |",
        read_bw / 1e9
    );
    println!(
        "| f32 matmul {m}³, candle/gemm | {:.1} GFLOP/s |",
        candle_gflops / 1e9
    );
    println!(
        "| f32 matmul {m}³, tandem batch-invariant kernel | {:.1} GFLOP/s |",
        own_gflops / 1e9
    );
    println!(
        "| model | {} (--weights {}: {}; {} KV; {:.1} MB of weights read per decode step) |",
        model.name(),
        args.weights.name(),
        model.storage_summary(),
        args.kv_dtype.name(),
        weight_bytes as f64 / 1e6
    );
    println!(
        "| prefill {} tokens | {:.1} ms, {:.0} tok/s, {:.1} GFLOP/s ({:.2} of peak) |",
        args.prompt_len,
        prefill_s * 1e3,
        prefill_tok_s,
        prefill_flops / prefill_s / 1e9,
        prefill_vs_peak
    );
    println!(
        "| decode step floor (weights / bandwidth) | {:.1} ms |",
        floor_step * 1e3
    );
    for (batch, step, tok_s) in &decode {
        println!(
            "| decode batch {batch} | {:.1} ms/step, {:.1} tok/s |",
            step * 1e3,
            tok_s
        );
    }
    let json = serde_json::json!({
        "model": model.name(),
        "weights": args.weights.name(),
        "kv_dtype": args.kv_dtype.name(),
        "storage": model.storage_summary(),
        "threads": threads,
        "isa": isa.name(),
        "compute": compute.mode.name(),
        "int_tile": int_tile,
        "bandwidth_gb_s": bandwidth / 1e9,
        "read_bandwidth_gb_s": read_bw / 1e9,
        "matmul_peak_gflops": peak / 1e9,
        "candle_matmul_gflops": candle_gflops / 1e9,
        "tandem_matmul_gflops": own_gflops / 1e9,
        "weight_bytes": weight_bytes,
        "prefill_tokens": args.prompt_len,
        "prefill_tok_s": prefill_tok_s,
        "decode_tok_s": decode.iter().map(|d| (format!("b{}", d.0), serde_json::json!(d.2))).collect::<serde_json::Map<_, _>>(),
        "decode_b1_step_ms": b1_step * 1e3,
        "decode_floor_step_ms": floor_step * 1e3,
        "decode_b1_vs_bandwidth_floor": floor_step / b1_step,
        "prefill_vs_matmul_peak": prefill_vs_peak,
        "decode_b32_speedup_vs_b1": b32_tok / b1_tok,
    });
    println!("{json}");
    Ok(())
}
