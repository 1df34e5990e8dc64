//! The `cuda-ipc` path checked and timed on a real GPU (two processes on one device; prints
//! SKIP without one). The parent allocates a decode worker's KV pool shaped for Llama-3.1-8B,
//! fills it with one byte pattern, exports it, and starts itself as the child with the handle.
//! The child (the prefill side) fills its own pool with another pattern, opens the handle and
//! copies a 2048-token prompt's blocks layer by layer, as the transport does: once into
//! scattered destination blocks (no copy merges: one copy per block and layer) and once into
//! consecutive ones (one copy per layer). The parent then checks every byte of its pool (the
//! copied blocks hold the child's pattern, all others its own) and times one local
//! device-to-device copy of the same bytes: the rate the IPC copies are measured against.
//! Prints a table, then one JSON line.

use std::time::Instant;

use half::bf16;
use tandem_engine::backend::cuda::gpu::{GpuContext, PoolSize, available, device_pool};
use tandem_engine::config::ModelConfig;
use tandem_kv::cuda::ipc::OpenedPeer;
use tandem_kv::{BLOCK_SIZE, plan_layer_copy};

const PROMPT_TOKENS: usize = 2048;
const SRC_BLOCKS: usize = PROMPT_TOKENS / BLOCK_SIZE;
const DST_BLOCKS: usize = 3 * SRC_BLOCKS;
/// Consecutive destination blocks start here (after the scattered ones' range).
const MERGED_START: u32 = (2 * SRC_BLOCKS) as u32;

fn pattern(salt: u16, len: usize) -> Vec<bf16> {
    (0..len)
        .map(|i| bf16::from_bits((i as u16).wrapping_mul(7).wrapping_add(salt)))
        .collect()
}

fn scattered(lb: usize) -> u32 {
    (2 * lb + 1) as u32
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> anyhow::Result<Vec<u8>> {
    (0..s.len())
        .step_by(2)
        .map(|i| Ok(u8::from_str_radix(&s[i..i + 2], 16)?))
        .collect()
}

/// The prefill side: copies into the parent's pool and prints `scattered_s merged_s`.
fn child(handle: &str) -> anyhow::Result<()> {
    let cfg = ModelConfig::preset("llama-3.1-8b")?;
    let gpu = GpuContext::new(0, None)?;
    let mut src = device_pool(&gpu, &cfg, PoolSize::Blocks(SRC_BLOCKS))?;
    let host = pattern(0x5a5a, src.data().len());
    gpu.stream.memcpy_htod(&host, src.data_mut())?;
    gpu.synchronize()?;
    let kv = src.describe();
    let peer = OpenedPeer::open(&unhex(handle)?, kv.context())?;
    let mut times = Vec::new();
    for dst_of in [scattered as fn(usize) -> u32, |lb| MERGED_START + lb as u32] {
        let pairs: Vec<(u32, u32)> = (0..SRC_BLOCKS).map(|lb| (lb as u32, dst_of(lb))).collect();
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t = Instant::now();
            for layer in 0..kv.num_layers() {
                let runs = plan_layer_copy(
                    layer,
                    kv.num_layers(),
                    kv.block_layer_bytes(),
                    kv.num_blocks(),
                    DST_BLOCKS,
                    &pairs,
                )?;
                // SAFETY: the plan keeps every run inside both pools; the parent waits for us.
                unsafe { peer.copy_runs(&kv, &runs)? };
            }
            kv.synchronize()?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        times.push(best);
    }
    println!("{} {}", times[0], times[1]);
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() == 3 && args[1] == "--child" {
        return child(&args[2]);
    }
    if !available() {
        println!("SKIP: no CUDA device here");
        return Ok(());
    }
    let cfg = ModelConfig::preset("llama-3.1-8b")?;
    let gpu = GpuContext::new(0, None)?;
    let mut dst = device_pool(&gpu, &cfg, PoolSize::Blocks(DST_BLOCKS))?;
    let own = pattern(0x0101, dst.data().len());
    gpu.stream.memcpy_htod(&own, dst.data_mut())?;
    gpu.synchronize()?;
    let export = dst.export()?;
    let out = std::process::Command::new(&args[0])
        .args(["--child", &hex(&export.ipc_handle)])
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "child failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout)?;
    let times: Vec<f64> = text
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    anyhow::ensure!(times.len() == 2, "child printed {text:?}");

    // Every byte: copied blocks hold the child's pattern at the source offsets.
    let mut got = vec![bf16::ZERO; dst.data().len()];
    gpu.stream.memcpy_dtoh(dst.data(), &mut got)?;
    gpu.synchronize()?;
    let piece = dst.layout().block_layer_elems;
    let layers = dst.layout().num_layers;
    let theirs = pattern(0x5a5a, layers * SRC_BLOCKS * piece);
    let mut source_of = vec![None; DST_BLOCKS];
    for lb in 0..SRC_BLOCKS {
        source_of[scattered(lb) as usize] = Some(lb);
        source_of[MERGED_START as usize + lb] = Some(lb);
    }
    let mut wrong = 0usize;
    for layer in 0..layers {
        for (block, src) in source_of.iter().enumerate() {
            let at = (layer * DST_BLOCKS + block) * piece;
            let want = match src {
                Some(lb) => &theirs[(layer * SRC_BLOCKS + lb) * piece..][..piece],
                None => &own[at..at + piece],
            };
            // Bits, not values: the patterns hold NaNs, which never equal themselves.
            let same = got[at..at + piece]
                .iter()
                .map(|v| v.to_bits())
                .eq(want.iter().map(|v| v.to_bits()));
            if !same {
                wrong += 1;
            }
        }
    }

    // The reference: one local device-to-device copy of the same bytes.
    let bytes = layers * SRC_BLOCKS * piece * 2;
    let local = tandem_kv::cuda::local_copy_seconds(&gpu.stream, bytes)?;
    let gbs = |s: f64| bytes as f64 / s / 1e9;
    println!(
        "| cuda-ipc, {PROMPT_TOKENS}-token prompt, Llama-3.1-8B KV ({:.0} MiB) | GB/s | vs local copy |",
        bytes as f64 / (1 << 20) as f64
    );
    println!("|---|---|---|");
    println!(
        "| local device-to-device copy (one call) | {:.0} | 1.00 |",
        gbs(local)
    );
    println!(
        "| IPC, scattered blocks ({} copies) | {:.0} | {:.2} |",
        layers * SRC_BLOCKS,
        gbs(times[0]),
        local / times[0]
    );
    println!(
        "| IPC, consecutive blocks ({layers} copies) | {:.0} | {:.2} |",
        gbs(times[1]),
        local / times[1]
    );
    println!(
        "{}",
        serde_json::json!({
            "bytes": bytes,
            "local_gb_s": gbs(local),
            "ipc_scattered_gb_s": gbs(times[0]),
            "ipc_consecutive_gb_s": gbs(times[1]),
            "wrong_block_layers": wrong,
        })
    );
    anyhow::ensure!(
        wrong == 0,
        "{wrong} block-layers differ from what was copied"
    );
    println!("PASS");
    Ok(())
}
