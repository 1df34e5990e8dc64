//! Runs decode steps at one batch size, for profiling (`perf record`):
//! `cargo run --release -p tandem-engine --example decode_profile -- 32 [steps] [prompt_len]`
//! (the first step prefills every prompt and is not timed).
use std::sync::Arc;
use std::time::Instant;

use tandem_engine::{
    Engine, EngineConfig, LoadOptions, ModelSource, SamplingParams, StopParams, load_model,
};

fn main() -> anyhow::Result<()> {
    let arg = |i: usize, default: usize| std::env::args().nth(i).map_or(Ok(default), |s| s.parse());
    let (batch, steps, prompt_len) = (arg(1, 32)?, arg(2, 50)?, arg(3, 128)? as u32);
    let cache = std::env::var_os("TANDEM_CACHE")
        .map_or_else(tandem_engine::fetch::default_cache_dir, Into::into);
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
    for i in 0..batch as u32 {
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
