//! Runs decode steps at one batch size, for profiling (`perf record`):
//! `cargo run --release -p tandem-engine --example decode_profile -- 32 [steps] [prompt_len]`
//! (the first step prefills every prompt and is not timed).
use std::sync::Arc;
use std::time::Instant;

use tandem_engine::{
    Engine, EngineConfig, LoadOptions, ModelSource, SamplingParams, StopParams, load_model,
};

/// Decode steps of SmolLM2-135M at one batch size, timed.
#[derive(clap::Parser)]
struct Args {
    /// Sequences decoding together.
    #[arg(default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=256))]
    batch: u32,
    /// Steps timed.
    #[arg(default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..))]
    steps: u32,
    /// Tokens of each sequence's prompt.
    #[arg(default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..=8192))]
    prompt_len: u32,
    /// Where models are cached (default: the user's cache folder).
    #[arg(long, env = "TANDEM_CACHE")]
    cache: Option<std::path::PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args: Args = clap::Parser::parse();
    let (batch, steps, prompt_len) = (args.batch, args.steps as usize, args.prompt_len);
    let cache = args
        .cache
        .unwrap_or_else(tandem_engine::fetch::default_cache_dir);
    let opts = LoadOptions {
        cache_dir: cache,
        ..Default::default()
    };
    let (model, tok) = load_model(&ModelSource::DefaultSmolLm2, &opts)?;
    let config = EngineConfig {
        kv_budget_bytes: 2 << 30,
        max_batch_tokens: 8192,
        max_running: 256,
        ..Default::default()
    };
    let mut e = Engine::new(Arc::new(model), tok, config)?;
    for i in 0..batch {
        let p: Vec<u32> = (0..prompt_len)
            .map(|j| 3 + (j * 7919 + i * 104_729) % 49_000)
            .collect();
        e.add_request(
            p,
            SamplingParams::greedy(),
            StopParams {
                max_tokens: steps + 10,
                ignore_eos: true,
                ..Default::default()
            },
        )?;
    }
    e.step()?;
    e.step()?;
    let t = Instant::now();
    for _ in 0..steps {
        e.step()?;
    }
    println!(
        "batch {batch}: {:.2} ms/step",
        t.elapsed().as_secs_f64() * 1e3 / steps as f64
    );
    Ok(())
}
