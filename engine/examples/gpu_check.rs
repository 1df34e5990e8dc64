//! GPU correctness check (needs a CUDA device; run on the GPU machine): the CUDA forward pass
//! against the CPU engine with the same bf16-rounded weights, on fresh random inputs: a
//! mixed-length batch, a chunked prefill, and decode steps with sequences joining. Passes when
//! every compared logit row is within 1e-2 relative (max |gpu − cpu| / max |cpu|). Then a
//! whole GPU engine with prefix caching against one without: a prompt extending an earlier
//! one takes the cached blocks from the device pool, computes only the rest, and gives the
//! same greedy tokens (their logprobs within 1e-2).
//!
//! `gpu_check [--model tiny|smollm2|dummy:PRESET] [--cache DIR]`; exits non-zero on failure.

use std::path::PathBuf;
use std::sync::Arc;

use tandem_engine::backend::Logits;
use tandem_engine::backend::cuda::forward::StepBuffers;
use tandem_engine::backend::cuda::gpu::{GpuContext, GpuModel, PoolSize, available, device_pool};
use tandem_engine::{
    Device, Engine, EngineConfig, LoadOptions, ModelSource, SamplingParams, SeqInput, StopParams,
    WeightFormat, load_model,
};
use tandem_kv::{BlockPool, KvCache, blocks_for};
use tandem_text::TextTokenizer;

fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let num = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    let den = b.iter().map(|y| y.abs()).fold(0f32, f32::max);
    num / den.max(1e-6)
}

/// The GPU forward pass against the CPU's on one model.
#[derive(clap::Parser)]
struct Args {
    /// A preset (`tiny`, `smollm2`…), a GGUF file or a model folder.
    #[arg(long, default_value = "tiny")]
    model: String,
    /// Where models are cached (default: the user's cache folder).
    #[arg(long, env = "TANDEM_CACHE")]
    cache: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args: Args = clap::Parser::parse();
    let model = args.model;
    let cache_dir = args
        .cache
        .unwrap_or_else(tandem_engine::fetch::default_cache_dir);
    if !available() {
        println!("SKIP: no CUDA device here");
        return Ok(());
    }
    let opts = LoadOptions {
        format: WeightFormat::Bf16,
        cache_dir,
        ..Default::default()
    };
    let (cpu, tokenizer) = load_model(&model.parse::<ModelSource>()?, &opts)?;
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
    let mut check = |label: &str, cpu_out: Vec<Vec<f32>>, gpu_out: Logits| {
        if cpu_out.len() != gpu_out.len() {
            println!(
                "{label}: {} logits rows, want {}",
                gpu_out.len(),
                cpu_out.len()
            );
            worst = f32::INFINITY;
        }
        for (i, (c, g)) in cpu_out.iter().zip(gpu_out.iter()).enumerate() {
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
    drop((gpu, gpu_cache, buffers));
    prefix_cache_check(Arc::new(cpu), tokenizer, vocab)?;
    println!("PASS");
    Ok(())
}

/// Two GPU engines, with and without prefix caching, on a prompt and then on a longer one
/// that extends it: the same greedy tokens, logprobs within 1e-2, and the second prompt's
/// cached blocks not computed again.
fn prefix_cache_check(
    model: Arc<tandem_engine::Model>,
    tokenizer: TextTokenizer,
    vocab: u32,
) -> anyhow::Result<()> {
    let engine = |prefix_caching: bool| {
        let config = EngineConfig {
            device: Device::Cuda {
                ordinal: 0,
                green_context_sms: None,
            },
            kv_budget_bytes: 256 * model.kv_layout().block_bytes(),
            prefix_caching,
            ..EngineConfig::default()
        };
        Engine::new(model.clone(), tokenizer.clone(), config)
    };
    let first: Vec<u32> = (0..100u32).map(|i| (i * 31 + 5) % vocab).collect();
    let mut second = first.clone();
    second.extend((0..40u32).map(|i| (i * 17 + 2) % vocab));
    let run = |e: &mut Engine, prompt: &[u32]| -> anyhow::Result<Vec<(u32, f32)>> {
        let stop = StopParams {
            max_tokens: 8,
            ignore_eos: true,
            ..StopParams::default()
        };
        e.add_request(prompt.to_vec(), SamplingParams::greedy(), stop)?;
        let mut out = Vec::new();
        while e.has_work() {
            out.extend(e.step()?.into_iter().map(|o| (o.token, o.logprob)));
        }
        Ok(out)
    };
    let (mut cached, mut plain) = (engine(true)?, engine(false)?);
    for prompt in [&first, &second] {
        let before = cached.stats().prefill_tokens;
        let (got, want) = (run(&mut cached, prompt)?, run(&mut plain, prompt)?);
        let tokens_equal = got.iter().map(|t| t.0).eq(want.iter().map(|t| t.0));
        let worst = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g.1 - w.1).abs())
            .fold(0f32, f32::max);
        let computed = cached.stats().prefill_tokens - before;
        println!(
            "prefix cache, {}-token prompt: {computed} tokens computed, tokens equal {tokens_equal}, max |Δ logprob| {worst:.2e}",
            prompt.len()
        );
        anyhow::ensure!(
            tokens_equal && worst <= 1e-2,
            "prefix caching changed the output"
        );
    }
    anyhow::ensure!(
        cached.stats().prefix_hit_tokens >= 96,
        "the second prompt did not reuse the first one's blocks"
    );
    Ok(())
}
