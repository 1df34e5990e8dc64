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

struct Args {
    model: String,
    cache: PathBuf,
    rows: usize,
    prompt_len: usize,
    chunks: Vec<usize>,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut args = Args {
        model: "smollm2".into(),
        cache: std::env::var_os("TANDEM_CACHE")
            .map_or_else(tandem_engine::fetch::default_cache_dir, PathBuf::from),
        rows: 16,
        prompt_len: 2048,
        chunks: vec![16, 32, 64, 128, 256, 512],
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .ok_or_else(|| anyhow::anyhow!("{flag} needs a value"))
        };
        match flag.as_str() {
            "--model" => args.model = value()?,
            "--cache" => args.cache = value()?.into(),
            "--rows" => args.rows = value()?.parse()?,
            "--prompt-len" => args.prompt_len = value()?.parse()?,
            "--chunks" => {
                args.chunks = value()?
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()?
            }
            other => anyhow::bail!(
                "unknown flag {other} (--model, --cache, --rows, --prompt-len, --chunks)"
            ),
        }
    }
    anyhow::ensure!(
        args.rows >= 1 && args.prompt_len >= 2 && args.chunks.iter().all(|&c| c >= 1),
        "--rows, --prompt-len and every chunk must be positive (--prompt-len at least 2)"
    );
    Ok(args)
}

fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    let source: ModelSource = args.model.parse()?;
    let opts = LoadOptions {
        cache_dir: args.cache.clone(),
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
    let stream_tokens = args.prompt_len + 64;
    let streams_up = || -> anyhow::Result<Engine> {
        let config = EngineConfig {
            kv_budget_bytes: 2 << 30,
            max_batch_tokens: args.prompt_len.max(args.rows * 16),
            max_running: args.rows + 1,
            ..Default::default()
        };
        let mut engine = Engine::new(model.clone(), tokenizer.clone(), config)?;
        for i in 0..args.rows {
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
        args.rows, args.prompt_len
    );
    println!(
        "| chunk | passes | prompt wall (ms) | beyond the streams' passes (ms) | per prompt token (ms) |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: |");
    for &chunk in &args.chunks {
        let mut engine = streams_up()?;
        let id = engine.add_request(
            prompt(999, args.prompt_len),
            SamplingParams::greedy(),
            stop(1),
        )?;
        engine.set_prompt_allowance(Some(chunk));
        let t = Instant::now();
        let mut passes = 0usize;
        loop {
            let outputs = engine.step()?;
            passes += 1;
            if outputs.iter().any(|o| o.request == id) {
                break;
            }
            anyhow::ensure!(passes <= args.prompt_len + 1, "the prompt never finished");
        }
        let wall = t.elapsed().as_secs_f64() * 1e3;
        let beyond = wall - passes as f64 * alone_ms;
        println!(
            "| {chunk} | {passes} | {wall:.0} | {beyond:.0} | {:.3} |",
            beyond / args.prompt_len as f64
        );
    }
    Ok(())
}
