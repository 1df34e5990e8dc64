//! GPU correctness check (needs a CUDA device; run on the GPU machine): the CUDA forward pass
//! against the CPU engine with the same bf16-rounded weights, on fresh random inputs: a
//! mixed-length batch, a chunked prefill, and decode steps with sequences joining. Passes when
//! every compared logit row is within 1e-2 relative (max |gpu − cpu| / max |cpu|).
//!
//! `gpu_check [--model tiny|smollm2|dummy:PRESET] [--cache DIR]`; exits non-zero on failure.

use std::path::PathBuf;
use std::sync::Arc;

use tandem_engine::backend::cuda::forward::StepBuffers;
use tandem_engine::backend::cuda::gpu::{GpuContext, GpuModel, PoolSize, available, device_pool};
use tandem_engine::{LoadOptions, ModelSource, SeqInput, WeightFormat, load_model};
use tandem_kv::{BlockPool, KvCache, blocks_for};

fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let num = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    let den = b.iter().map(|y| y.abs()).fold(0f32, f32::max);
    num / den.max(1e-6)
}

fn main() -> anyhow::Result<()> {
    let mut model = "tiny".to_string();
    let mut cache_dir = std::env::var_os("TANDEM_CACHE")
        .map_or_else(tandem_engine::fetch::default_cache_dir, PathBuf::from);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--model" => model = args.next().unwrap_or_default(),
            "--cache" => cache_dir = args.next().unwrap_or_default().into(),
            other => anyhow::bail!("unknown flag {other}"),
        }
    }
    if !available() {
        println!("SKIP: no CUDA device here");
        return Ok(());
    }
    let opts = LoadOptions {
        format: WeightFormat::Bf16,
        cache_dir,
        ..Default::default()
    };
    let (cpu, _) = load_model(&model.parse::<ModelSource>()?, &opts)?;
    let gpu_ctx = Arc::new(GpuContext::new(0, None)?);
    let gpu = GpuModel::upload(gpu_ctx.clone(), &cpu)?;
    let cfg = cpu.config().clone();
    let vocab = cfg.vocab_size as u32;
    let layout = cpu.kv_layout();
    let blocks = 256;
    let mut cpu_cache = KvCache::with_budget(layout.clone(), blocks * layout.block_bytes())?;
    let mut buffers = StepBuffers::default();
    let mut gpu_cache = device_pool(
        &gpu_ctx,
        &cfg,
        PoolSize::Budget(blocks * layout.block_bytes() / 2),
    )?;
    let mut pool = BlockPool::new(blocks.min(gpu_cache.layout().num_blocks));
    let prompt = |seed: u32, len: usize| -> Vec<u32> {
        (0..len as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(97)) % vocab)
            .collect()
    };
    let mut worst = 0f32;
    let mut check = |label: &str, cpu_out: Vec<Vec<f32>>, gpu_out: Vec<Vec<f32>>| {
        for (i, (c, g)) in cpu_out.iter().zip(&gpu_out).enumerate() {
            let e = rel_err(g, c);
            worst = worst.max(e);
            println!("{label} row {i}: relative error {e:.2e}");
        }
    };
    // 1. A mixed-length batch.
    let lens = [1usize, 7, 16, 33, 100];
    let prompts: Vec<Vec<u32>> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| prompt(i as u32 + 1, n))
        .collect();
    let tables: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| pool.allocate(blocks_for(p.len() + 16)))
        .collect::<Result<_, _>>()?;
    let inputs: Vec<SeqInput<'_>> = prompts
        .iter()
        .zip(&tables)
        .map(|(p, t)| SeqInput {
            tokens: p,
            start_pos: 0,
            block_table: t,
            logits: true,
            all_logits: false,
        })
        .collect();
    let c = cpu.forward(&mut cpu_cache, &inputs, &mut |_, _| {})?;
    let g = gpu.forward(&mut gpu_cache, &inputs, &mut buffers)?;
    check("batch", c, g);
    // 2. Decode steps on top of that batch, one sequence at a time leaving.
    for step in 0..8 {
        let next: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| vec![(p[p.len() - 1] + step as u32 + 1) % vocab])
            .collect();
        let inputs: Vec<SeqInput<'_>> = next
            .iter()
            .zip(&tables)
            .zip(&prompts)
            .take(lens.len() - step % 3)
            .map(|((n, t), p)| SeqInput {
                tokens: n,
                start_pos: p.len() + step,
                block_table: t,
                logits: true,
                all_logits: false,
            })
            .collect();
        let c = cpu.forward(&mut cpu_cache, &inputs, &mut |_, _| {})?;
        let g = gpu.forward(&mut gpu_cache, &inputs, &mut buffers)?;
        check(&format!("decode step {step}"), c, g);
    }
    // 3. A chunked prefill of 300 tokens.
    let long = prompt(99, 300);
    let table = pool.allocate(blocks_for(300))?;
    let mut pos = 0;
    for chunk in [128, 128, 44] {
        let input = [SeqInput {
            tokens: &long[pos..pos + chunk],
            start_pos: pos,
            block_table: &table,
            logits: true,
            all_logits: false,
        }];
        let c = cpu.forward(&mut cpu_cache, &input, &mut |_, _| {})?;
        let g = gpu.forward(&mut gpu_cache, &input, &mut buffers)?;
        check(&format!("chunk at {pos}"), c, g);
        pos += chunk;
    }
    println!("worst relative error {worst:.2e} (limit 1e-2)");
    anyhow::ensure!(worst <= 1e-2, "GPU and CPU disagree beyond bf16 tolerance");
    println!("PASS");
    Ok(())
}
