//! Perplexity of one model stored each way `--weights` allows, on the same tokens of a text:
//! what a storage format costs in accuracy, beside the bytes a decode step reads in it.
//!
//! `cargo run --release -p tandem-engine --example perplexity -- --text FILE
//!  [--model smollm2] [--weights native,f32,bf16,q8_0,q4_0] [--kv-dtype f32] [--tokens 512]`
//! prints a table and, last, one JSON line. The first format listed is the baseline the
//! others are set against. `scripts/bench-quant` runs it on the book text.

use std::path::PathBuf;

use tandem_engine::eval::perplexity;
use tandem_engine::{LoadOptions, ModelSource, WeightFormat, load_model};

struct Args {
    model: String,
    formats: Vec<WeightFormat>,
    text: PathBuf,
    tokens: usize,
    kv_dtype: tandem_kv::KvDtype,
    cache: PathBuf,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut model = "smollm2".to_string();
    let mut formats = "f32,native,bf16,q8_0,q4_0,q4_1".to_string();
    let mut text = None;
    let mut tokens = 512;
    let mut kv_dtype = tandem_kv::KvDtype::F32;
    let mut cache = std::env::var_os("TANDEM_CACHE")
        .map_or_else(tandem_engine::fetch::default_cache_dir, PathBuf::from);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .ok_or_else(|| anyhow::anyhow!("{flag} needs a value"))
        };
        match flag.as_str() {
            "--model" => model = value()?,
            "--weights" => formats = value()?,
            "--text" => text = Some(PathBuf::from(value()?)),
            "--tokens" => tokens = value()?.parse()?,
            "--cache" => cache = value()?.into(),
            "--kv-dtype" => kv_dtype = value()?.parse()?,
            other => anyhow::bail!(
                "unknown flag {other} (--model, --weights, --kv-dtype, --text, --tokens, --cache)"
            ),
        }
    }
    let formats = formats
        .split(',')
        .map(str::parse)
        .collect::<Result<Vec<WeightFormat>, _>>()?;
    let text = text.ok_or_else(|| anyhow::anyhow!("--text FILE is required"))?;
    anyhow::ensure!(tokens >= 2, "--tokens must be at least 2");
    Ok(Args {
        model,
        formats,
        text,
        tokens,
        kv_dtype,
        cache,
    })
}

fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    let source: ModelSource = args.model.parse()?;
    let text = std::fs::read_to_string(&args.text)?;
    let mut rows = Vec::new();
    let mut tokens = Vec::new();
    for &format in &args.formats {
        let opts = LoadOptions {
            format,
            cache_dir: args.cache.clone(),
            kv_dtype: args.kv_dtype,
            tokenizer: None,
            ..Default::default()
        };
        eprintln!("loading {} as {format}...", args.model);
        let (model, tokenizer) = load_model(&source, &opts)?;
        if tokens.is_empty() {
            tokens = tokenizer.encode(&text, false)?;
            anyhow::ensure!(
                tokens.len() >= args.tokens,
                "the text has {} tokens, fewer than --tokens {}",
                tokens.len(),
                args.tokens
            );
            tokens.truncate(args.tokens);
        }
        let t = std::time::Instant::now();
        let ppl = perplexity(&model, &tokens)?;
        eprintln!(
            "  perplexity {ppl:.4} in {:.1} s",
            t.elapsed().as_secs_f64()
        );
        rows.push((
            format,
            model.storage_summary(),
            model.weights().bytes_read_per_step(),
            ppl,
        ));
    }
    let base = rows[0].3;
    println!(
        "quantized weights compute in {} mode (TANDEM_COMPUTE)",
        tandem_engine::backend::cpu::kernels::compute_mode()
    );
    println!(
        "| --weights | storage | MB read per decode step | perplexity | vs {} |",
        rows[0].0
    );
    println!("|---|---|---|---|---|");
    for (format, storage, bytes, ppl) in &rows {
        println!(
            "| {format} | {storage} | {:.1} | {ppl:.4} | {:+.2} % |",
            *bytes as f64 / 1e6,
            (ppl / base - 1.0) * 100.0
        );
    }
    let json = serde_json::json!({
        "model": args.model,
        "text": args.text.file_name().and_then(|n| n.to_str()),
        "tokens": tokens.len(),
        "kv_dtype": args.kv_dtype.name(),
        "compute": tandem_engine::backend::cpu::kernels::compute_mode().name(),
        "baseline": rows[0].0.name(),
        "results": rows.iter().map(|(f, s, b, p)| serde_json::json!({
            "weights": f.name(),
            "storage": s,
            "bytes_per_step": b,
            "perplexity": p,
            "vs_baseline": p / base,
        })).collect::<Vec<_>>(),
    });
    println!("{json}");
    Ok(())
}
