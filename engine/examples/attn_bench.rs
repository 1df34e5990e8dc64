//! Paged attention alone for decode rows: every layer's attention of `--batch` sequences at a
//! `--context`-token context, in a cache shaped like SmolLM2-135M's (30 layers, 9 query heads
//! over 3 KV heads of 64; flags change it), f32 KV, each sequence's blocks interleaved with the
//! others' as a shared pool lays them out. The cache is filled once and stays wherever the
//! machine keeps it (a short context's fits in the last-level cache, a long one's streams from
//! memory), so this times the kernel, not a decode step's competition with the weights.
//!
//! `cargo run --release -p tandem-engine --example attn_bench -- --context 144` prints the best
//! of five rounds: microseconds per step (every layer once) and per layer.

use std::time::Instant;

use tandem_engine::backend::cpu::kernels::attention::{AttnParams, AttnSeq, paged_attention};
use tandem_kv::{BLOCK_SIZE, KvCache, KvDtype, KvLayout};

/// Paged attention alone for decode rows.
#[derive(clap::Parser)]
struct Args {
    /// Tokens of context each sequence attends to (its own included).
    #[arg(long, default_value_t = 144, value_parser = clap::value_parser!(u32).range(1..=65536))]
    context: u32,
    /// Sequences, one decode row each.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=256))]
    batch: u16,
    /// Steps a round.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..))]
    reps: u32,
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u16).range(1..=256))]
    layers: u16,
    #[arg(long, default_value_t = 9, value_parser = clap::value_parser!(u16).range(1..=256))]
    heads: u16,
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=256))]
    kv_heads: u16,
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..=512))]
    head_dim: u16,
}

fn main() -> anyhow::Result<()> {
    let args: Args = clap::Parser::parse();
    let (ctx, batch, layers) = (
        args.context as usize,
        args.batch as usize,
        args.layers as usize,
    );
    let (heads, kv_heads, d) = (
        args.heads as usize,
        args.kv_heads as usize,
        args.head_dim as usize,
    );
    anyhow::ensure!(
        heads.is_multiple_of(kv_heads),
        "--heads must be a multiple of --kv-heads"
    );
    let layout = KvLayout {
        num_layers: layers,
        num_kv_heads: kv_heads,
        head_dim: d,
        block_size: BLOCK_SIZE,
        dtype: KvDtype::F32,
        model_fingerprint: "attn_bench".into(),
    };
    let blocks_each = ctx.div_ceil(BLOCK_SIZE);
    let blocks = blocks_each * batch;
    let mut cache = KvCache::with_budget(layout.clone(), blocks * layout.block_bytes())?;
    for l in 0..layers {
        for b in 0..blocks as u32 {
            for (i, v) in cache.block_layer_mut(l, b)?.iter_mut().enumerate() {
                *v = ((i * 7 + b as usize) % 13) as f32 * 0.01 - 0.06;
            }
        }
    }
    let tables: Vec<Vec<u32>> = (0..batch)
        .map(|s| (0..blocks_each).map(|j| (j * batch + s) as u32).collect())
        .collect();
    let seqs: Vec<AttnSeq<'_>> = tables
        .iter()
        .enumerate()
        .map(|(s, table)| AttnSeq {
            q_row: s,
            q_len: 1,
            start_pos: ctx - 1,
            block_table: table,
        })
        .collect();
    let q: Vec<f32> = (0..batch * heads * d)
        .map(|i| (i % 11) as f32 * 0.1 - 0.5)
        .collect();
    let mut out = vec![0f32; batch * heads * d];
    let params = AttnParams::causal(d);
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..args.reps {
            for l in 0..layers {
                paged_attention(&cache, l, &q, &seqs, heads, params, &mut out);
            }
        }
        best = best.min(t.elapsed().as_secs_f64() / args.reps as f64);
    }
    std::hint::black_box(&out);
    println!(
        "context {ctx}, batch {batch}: {:.1} us a step ({layers} layers), {:.2} us a layer",
        best * 1e6,
        best * 1e6 / layers as f64
    );
    Ok(())
}
