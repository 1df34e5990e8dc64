//! What a prompt costs beside decode streams, by the size of the chunks it runs in: the
//! measurement behind `tandem_cost::MIN_PACED_CHUNK`. `--rows` streams decode (16-token
//! prompts, default 16) while one `--prompt-len`-token prompt (default 2048) runs beside them
//! in chunks of each size of `--chunks` (default 16,32,64,128,256,512), capped by the
//! engine's prompt allowance as a paced decode worker caps it; each size on a fresh engine.
//! The streams' passes alone are timed first.
//!
//! `cargo run --release -p tandem-engine --example chunk_cost -- --model smollm2` prints a
//! table: passes, the prompt's wall time, and its cost beyond the streams' own passes
//! (wall time less a streams-alone pass per pass), in total and per prompt token.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use tandem_engine::{
    Engine, EngineConfig, LoadOptions, ModelSource, SamplingParams, StopParams, load_model,
};

/// What a prompt costs beside decode streams, by the size of the chunks it runs in.
#[derive(clap::Parser)]
struct Args {
    /// The model (a preset name or a path, as `tandem-worker --model` takes).
    #[arg(long, default_value = "smollm2")]
    model: String,
    #[arg(long, env = "TANDEM_CACHE")]
    cache: Option<PathBuf>,
    /// Streams decoding beside the prompt.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..))]
    rows: u16,
    /// The prompt's length in tokens.
    #[arg(long, default_value_t = 2048, value_parser = clap::value_parser!(u32).range(2..))]
    prompt_len: u32,
    /// The chunk sizes to measure, one fresh engine each.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "16,32,64,128,256,512",
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    chunks: Vec<u32>,
}

fn main() -> anyhow::Result<()> {
    let args = <Args as clap::Parser>::parse();
    let (rows, prompt_len) = (usize::from(args.rows), args.prompt_len as usize);
    let cache = args
        .cache
        .clone()
        .unwrap_or_else(tandem_engine::fetch::default_cache_dir);
    let source: ModelSource = args.model.parse()?;
    let opts = LoadOptions {
        cache_dir: cache,
        ..Default::default()
    };
    eprintln!("loading {}...", args.model);
    let (model, tokenizer) = load_model(&source, &opts)?;
    let model = Arc::new(model);
    let vocab = model.config().vocab_size as u32;
    let prompt = |seed: u32, len: usize| -> Vec<u32> {
        (0..len as u32)
            .map(|i| 3 + (i * 7919 + seed * 104_729) % (vocab - 3))
            .collect()
    };
    let stop = |n| StopParams {
        max_tokens: n,
        ignore_eos: true,
        ..Default::default()
    };
    // Streams that outlast the prompt at any chunk size (one token a pass).
    let stream_tokens = prompt_len + 64;
    let streams_up = || -> anyhow::Result<Engine> {
        let config = EngineConfig {
            kv_budget_bytes: 2 << 30,
            max_batch_tokens: prompt_len.max(rows * 16),
            max_running: rows + 1,
            ..Default::default()
        };
        let mut engine = Engine::new(model.clone(), tokenizer.clone(), config)?;
        for i in 0..rows {
            engine.add_request(
                prompt(i as u32, 16),
                SamplingParams::greedy(),
                stop(stream_tokens),
            )?;
        }
        engine.step()?; // the streams' prompts
        engine.step()?; // a first decode step: warm-up
        Ok(engine)
    };
    // The streams alone, 32 passes.
    let mut engine = streams_up()?;
    let t = Instant::now();
    for _ in 0..32 {
        engine.step()?;
    }
    let alone_ms = t.elapsed().as_secs_f64() * 1e3 / 32.0;
    println!(
        "{} streams, a {}-token prompt beside them; the streams' pass alone: {alone_ms:.1} ms",
        rows, prompt_len
    );
    println!(
        "| chunk | passes | prompt wall (ms) | beyond the streams' passes (ms) | per prompt token (ms) |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: |");
    for chunk in args.chunks.iter().map(|&c| c as usize) {
        let mut engine = streams_up()?;
        let id = engine.add_request(prompt(999, prompt_len), SamplingParams::greedy(), stop(1))?;
        engine.set_prompt_allowance(Some(chunk));
        let t = Instant::now();
        let mut passes = 0usize;
        loop {
            let outputs = engine.step()?;
            passes += 1;
            if outputs.iter().any(|o| o.request == id) {
                break;
            }
            anyhow::ensure!(passes <= prompt_len + 1, "the prompt never finished");
        }
        let wall = t.elapsed().as_secs_f64() * 1e3;
        let beyond = wall - passes as f64 * alone_ms;
        println!(
            "| {chunk} | {passes} | {wall:.0} | {beyond:.0} | {:.3} |",
            beyond / prompt_len as f64
        );
    }
    Ok(())
}
