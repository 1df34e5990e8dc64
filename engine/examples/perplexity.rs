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

/// Perplexity of one model stored each way, on the same tokens of a text.
#[derive(clap::Parser)]
struct Args {
    /// A preset (`smollm2`, `tiny`…), a GGUF file or a model folder.
    #[arg(long, default_value = "smollm2")]
    model: String,
    /// The weight storages to compare, the first the baseline the others are set against.
    #[arg(
        long = "weights",
        value_delimiter = ',',
        default_value = "f32,native,bf16,q8_0,q4_0,q4_1"
    )]
    formats: Vec<WeightFormat>,
    /// The text whose tokens are scored.
    #[arg(long)]
    text: PathBuf,
    /// Tokens of the text scored.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(2..))]
    tokens: u32,
    /// The KV cache's element type: `f32`, `bf16` or `f16`.
    #[arg(long, default_value = "f32")]
    kv_dtype: tandem_kv::KvDtype,
    /// Where models are cached (default: the user's cache folder).
    #[arg(long, env = "TANDEM_CACHE")]
    cache: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args: Args = clap::Parser::parse();
    let cache = args
        .cache
        .clone()
        .unwrap_or_else(tandem_engine::fetch::default_cache_dir);
    let source: ModelSource = args.model.parse()?;
    let text = std::fs::read_to_string(&args.text)?;
    let mut rows = Vec::new();
    let mut tokens = Vec::new();
    for &format in &args.formats {
        let opts = LoadOptions {
            format,
            cache_dir: cache.clone(),
            kv_dtype: args.kv_dtype,
            tokenizer: None,
            ..Default::default()
        };
        eprintln!("loading {} as {format}...", args.model);
        let (model, tokenizer) = load_model(&source, &opts)?;
        if tokens.is_empty() {
            tokens = tokenizer.encode(&text, false)?;
            anyhow::ensure!(
                tokens.len() >= args.tokens as usize,
                "the text has {} tokens, fewer than --tokens {}",
                tokens.len(),
                args.tokens
            );
            tokens.truncate(args.tokens as usize);
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
