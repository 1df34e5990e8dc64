//! One-row `linear` (a batch-1 decode projection) per weight storage, twice: streaming from
//! memory (enough copies of the matrix to overflow the last-level cache, visited in turn) and
//! from cache (one copy, visited again and again). The weight bytes per second of each tells
//! whether a storage's tile is bound by memory or by its own arithmetic: a tile whose cached
//! rate is near the machine's bandwidth cannot reach that bandwidth from memory.
//!
//! Then the same matrix against `--batch` rows (default 64) from cache, in multiply-adds per
//! second: the compute rate of prefill and batched decode.
//!
//! `cargo run --release -p tandem-engine --example quant_bench -- [--formats q4_1,q4_1:fast,f32]
//! [--rows 3072] [--cols 576] [--batch 64] [--isa avx2]` prints a table and one JSON line. A
//! GGML format runs in `exact` mode, or with `:fast` in `fast` mode (integer dot products).
//! The default shape is SmolLM2's fused gate/up projection.

use std::time::{Duration, Instant};

use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use tandem_engine::backend::cpu::kernels::{
    Arrangement, IntTile, Isa, Matrix, QuantKind, QuantPanels, WeightData, isa, linear, select_isa,
};

/// Bytes of matrices streamed per pass of the "memory" case: several times any L3 here.
const MEMORY_BYTES: usize = 512 << 20;

/// One-row and batched `linear` per weight storage, from memory and from cache.
#[derive(clap::Parser)]
struct Args {
    /// Storages to time: `f32`, `bf16`, a GGML format (`q4_1`…) in `exact` mode, or with
    /// `:fast` in `fast` mode.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "q4_1,q4_1:fast,q8_0,q8_0:fast,q4_0,bf16,f32"
    )]
    formats: Vec<String>,
    /// Output features of the matrix.
    #[arg(long, default_value_t = 3072, value_parser = clap::value_parser!(u32).range(1..=65536))]
    rows: u32,
    /// Input features (a multiple of the format's block).
    #[arg(long, default_value_t = 576, value_parser = clap::value_parser!(u32).range(1..=65536))]
    cols: u32,
    /// Rows of the batched case.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    batch: u32,
    /// The kernels of another instruction set than the CPU's best (as `TANDEM_ISA`).
    #[arg(long)]
    isa: Option<String>,
}

fn main() -> anyhow::Result<()> {
    let args: Args = clap::Parser::parse();
    if let Some(name) = &args.isa {
        select_isa(Isa::parse(name)?)?;
    }
    let (rows, cols, batch) = (args.rows as usize, args.cols as usize, args.batch as usize);
    // Values in [-1, 1), deterministic: the rate does not depend on them.
    let values: Vec<f32> = (0..rows * cols)
        .map(|i| ((i as u64).wrapping_mul(2_654_435_761) % 2000) as f32 / 1000.0 - 1.0)
        .collect();
    let x: Vec<f32> = (0..cols * batch.max(1))
        .map(|i| (i % 17) as f32 / 17.0 - 0.5)
        .collect();
    let mut out = vec![0f32; rows * batch.max(1)];

    println!(
        "| storage | {rows}×{cols}, bytes | from memory | from cache | {batch} rows, from cache |"
    );
    println!("|---|---:|---:|---:|---:|");
    let mut json = Vec::new();
    for name in &args.formats {
        let name = name.as_str();
        let one = matrix(name, rows, cols, &values)?;
        let bytes = one.size_in_bytes();
        let copies = MEMORY_BYTES.div_ceil(bytes).max(2);
        let many: Vec<Matrix> = (0..copies).map(|_| one.clone()).collect();
        let memory = rate(&many, &x, &mut out, bytes);
        let cache = rate(std::slice::from_ref(&one), &x, &mut out, bytes);
        let macs = batch_rate(&one, &x, batch, &mut out);
        println!(
            "| {name} | {bytes} | {:.1} GB/s | {:.1} GB/s | {:.1} GMAC/s |",
            memory / 1e9,
            cache / 1e9,
            macs / 1e9
        );
        json.push(serde_json::json!({
            "storage": name, "bytes": bytes,
            "memory_gb_s": memory / 1e9, "cache_gb_s": cache / 1e9,
            "batch": batch, "batch_gmac_s": macs / 1e9,
        }));
    }
    println!(
        "{}",
        serde_json::json!({
            "isa": isa().to_string(),
            "int_tile": IntTile::for_isa(isa()).name(),
            "threads": tandem_engine::backend::cpu::kernels::team::threads(),
            "rows": rows, "cols": cols, "results": json,
        })
    );
    Ok(())
}

/// `values` (row-major) stored as `name`: a GGML format quantized by candle, or a float type.
fn matrix(name: &str, rows: usize, cols: usize, values: &[f32]) -> anyhow::Result<Matrix> {
    Ok(match name {
        "f32" => Matrix::new(rows, cols, WeightData::F32(values.to_vec())),
        "bf16" => Matrix::new(
            rows,
            cols,
            WeightData::Bf16(values.iter().map(|&v| half::bf16::from_f32(v)).collect()),
        ),
        "f16" => Matrix::new(
            rows,
            cols,
            WeightData::F16(values.iter().map(|&v| half::f16::from_f32(v)).collect()),
        ),
        other => {
            let (format, arrangement) = match other.split_once(':') {
                Some((format, "fast")) => (format, Arrangement::Quads),
                Some((_, mode)) => anyhow::bail!("unknown mode {mode} in {other} (fast)"),
                None => (other, Arrangement::InputMajor),
            };
            let kind = QuantKind::parse(format)
                .ok_or_else(|| anyhow::anyhow!("unknown storage {other}"))?;
            let t = Tensor::from_slice(values, (rows, cols), &Device::Cpu)?;
            let q = QTensor::quantize(&t, kind.to_ggml())?;
            let panels = QuantPanels::from_ggml_in(arrangement, kind, rows, cols, &q.data()?)?;
            Matrix::quantized(panels)
        }
    })
}

/// Multiply-adds per second of `batch`-row `linear` over one matrix, best of three passes of
/// at least [`PASS`] each (0 when `batch` is 0).
fn batch_rate(w: &Matrix, x: &[f32], batch: usize, out: &mut [f32]) -> f64 {
    if batch == 0 {
        return 0.0;
    }
    let macs = (batch * w.rows * w.cols) as f64;
    best_of_three(|| linear(x, batch, w, out), macs)
}

/// Weight bytes per second of one-row `linear` over `matrices` in turn, best of three
/// passes of at least [`PASS`] each.
fn rate(matrices: &[Matrix], x: &[f32], out: &mut [f32], bytes: usize) -> f64 {
    let mut next = 0;
    best_of_three(
        || {
            linear(x, 1, &matrices[next % matrices.len()], out);
            next += 1;
        },
        bytes as f64,
    )
}

/// Shortest time a pass runs: long enough that a shared VM's hiccups average out (a pass
/// of a fixed work count took 3-6 ms on these shapes and varied by 1.8x run to run).
const PASS: Duration = Duration::from_millis(300);

/// The best of three passes of `call`, each repeated until [`PASS`] has elapsed, as `units`
/// (what one call does) per second.
fn best_of_three(mut call: impl FnMut(), units: f64) -> f64 {
    let mut best = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        let mut calls = 0usize;
        while calls == 0 || t.elapsed() < PASS {
            call();
            calls += 1;
        }
        best = best.max(calls as f64 * units / t.elapsed().as_secs_f64());
    }
    best
}
