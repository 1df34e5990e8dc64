//! The `nccl` transport checked and timed on real GPUs (feature `nccl`; prints SKIP without a
//! GPU, without libnccl.so, or where NCCL will not join two ranks, as on one GPU). The parent
//! is the decode side: rank 0 on device 0, a Llama-3.1-8B-shaped device pool filled with one
//! byte pattern, a lease over scattered blocks, receiving through the lease table exactly as
//! the decode worker's receiver thread does. The child is the prefill side: rank 1 on the
//! last device, its own pool with another pattern, sending a 2048-token prompt's blocks layer
//! by layer with the transport's protocol. The parent checks every byte of its pool, commits
//! the lease, and times one local device-to-device copy of the same bytes for comparison.

use std::time::Instant;

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};
use tandem_kv::cuda::nccl::{self, DeviceScratch, NcclLink};
use tandem_kv::cuda::{DevicePool, device_present, local_copy_seconds};
use tandem_kv::{BLOCK_SIZE, DevicePoolLayout, KvCache, KvDtype, KvLayout};
use tandem_proto::v1::{KvCommit, Transport};
use tandem_transfer::nccl_wire::{self, Link, MESSAGE_AREA_BYTES};
use tandem_transfer::{DeviceLink, LeaseTable, LeaseToken};

const PROMPT_TOKENS: usize = 2048;
const SRC_BLOCKS: usize = PROMPT_TOKENS / BLOCK_SIZE;
const DST_BLOCKS: usize = 3 * SRC_BLOCKS;

/// Where logical block `lb` lands: every other block, so no two are adjacent.
fn dst_block(lb: usize) -> u32 {
    (2 * lb + 1) as u32
}

fn pattern(salt: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(salt))
        .collect()
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

/// Llama-3.1-8B's KV shape: 32 layers, 8 KV heads of 128.
fn layout() -> KvLayout {
    KvLayout {
        num_layers: 32,
        num_kv_heads: 8,
        head_dim: 128,
        block_size: BLOCK_SIZE,
        dtype: KvDtype::F32,
        model_fingerprint: "nccl-check".into(),
    }
}

/// Device `ordinal`'s primary context and its default stream.
fn device_stream(ordinal: usize) -> anyhow::Result<Arc<CudaStream>> {
    Ok(CudaContext::new(ordinal)?.default_stream())
}

/// The prefill side: joins as rank 1 and sends every layer of lease `lease` (its
/// capability, hex: this check's two processes are one test, so argv carries it).
fn child(id: &str, lease: &str, ordinal: usize) -> anyhow::Result<()> {
    let lease = LeaseToken::from_wire(&unhex(lease)?)?;
    let stream = device_stream(ordinal)?;
    let src = DevicePool::new(&stream, DevicePoolLayout::for_layout(&layout(), SRC_BLOCKS))?;
    let kv = src.describe();
    let link = match NcclLink::join(&unhex(id)?, 1, stream.clone()) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("child: {e}");
            std::process::exit(3);
        }
    };
    let scratch = DeviceScratch::new(MESSAGE_AREA_BYTES + kv.block_layer_bytes(), kv.context())?;
    // SAFETY: the whole pool, ours.
    unsafe { link.upload(kv.base(), &pattern(0x5a, kv.layout.bytes()))? };
    let mut wire = DeviceLink::new(&link, &scratch);
    wire.synchronize()?;
    let logical: Vec<u32> = (0..SRC_BLOCKS as u32).collect();
    for layer in 0..kv.num_layers() {
        let sources: Vec<u64> = (0..SRC_BLOCKS as u32)
            .map(|b| kv.base() + kv.layout.piece_byte_offset(layer, b) as u64)
            .collect();
        nccl_wire::send_layer(
            &mut wire,
            &lease,
            layer,
            kv.block_layer_bytes(),
            &logical,
            &sources,
        )?;
    }
    wire.synchronize()?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() == 5 && args[1] == "--child" {
        return child(&args[2], &args[3], args[4].parse()?);
    }
    if !device_present() || !nccl::available() {
        println!("SKIP: no CUDA device or no libnccl.so here");
        return Ok(());
    }
    let devices = cudarc::driver::CudaContext::device_count()? as usize;
    let stream = device_stream(0)?;
    let layout = layout();
    let dst = DevicePool::new(&stream, DevicePoolLayout::for_layout(&layout, DST_BLOCKS))?;
    let kv = dst.describe();
    // The lease table needs only the layout's layer count from its host cache.
    let host = KvCache::with_budget(layout.clone(), layout.block_bytes())?;
    let table = LeaseTable::new(host.block_writer(), layout.hash(), None)
        .with_device_pool(kv.block_layer_bytes());
    let blocks: Vec<u32> = (0..SRC_BLOCKS).map(dst_block).collect();
    let (lease, mut committed) = table.create(blocks, PROMPT_TOKENS, "nccl-check")?;
    let id = nccl::unique_id()?;
    let mut child = std::process::Command::new(&args[0])
        .args([
            "--child",
            &hex(&id),
            &hex(lease.token().as_bytes()),
            &(devices - 1).to_string(),
        ])
        .spawn()?;
    let link = match NcclLink::join(&id, 0, nccl::receive_stream(kv.context())?) {
        Ok(l) => l,
        Err(e) => {
            let _ = child.wait();
            println!("SKIP: NCCL would not join two ranks on {devices} GPU(s): {e}");
            return Ok(());
        }
    };
    let scratch = DeviceScratch::new(MESSAGE_AREA_BYTES + kv.block_layer_bytes(), kv.context())?;
    let own = pattern(0x01, kv.layout.bytes());
    // SAFETY: the whole pool, ours.
    unsafe { link.upload(kv.base(), &own)? };
    let mut wire = DeviceLink::new(&link, &scratch);
    wire.synchronize()?;
    let pool = tandem_transfer::DevicePool {
        base: kv.base(),
        num_blocks: kv.num_blocks(),
        piece: kv.block_layer_bytes(),
    };
    let mut started = None;
    for _ in 0..kv.num_layers() {
        let got = nccl_wire::receive_layer(&mut wire, &table, &pool)?;
        started.get_or_insert_with(Instant::now);
        anyhow::ensure!(got.kept, "layer {} was drained", got.header.layer);
    }
    // Timed from the end of the first layer (before it, the child is still starting): the
    // rate counts the other layers' bytes only.
    let seconds = started.map_or(0.0, |t| t.elapsed().as_secs_f64());
    let layers = kv.num_layers();
    let timed_share = (layers - 1) as f64 / layers as f64;
    anyhow::ensure!(child.wait()?.success(), "the sending process failed");

    let mut got = vec![0u8; kv.layout.bytes()];
    // SAFETY: the whole pool, ours.
    unsafe { link.download(kv.base(), &mut got)? };
    let piece = kv.block_layer_bytes();
    let theirs = pattern(0x5a, layers * SRC_BLOCKS * piece);
    let mut wrong = 0usize;
    for layer in 0..layers {
        for block in 0..DST_BLOCKS {
            let at = (layer * DST_BLOCKS + block) * piece;
            let sent = (block % 2 == 1)
                .then_some(block / 2)
                .filter(|&lb| lb < SRC_BLOCKS);
            let want = match sent {
                Some(lb) => &theirs[(layer * SRC_BLOCKS + lb) * piece..][..piece],
                None => &own[at..at + piece],
            };
            if got[at..at + piece] != *want {
                wrong += 1;
            }
        }
    }
    let commit = KvCommit {
        lease: lease.token().as_bytes().to_vec(),
        kv_layout_hash: table.layout_hash().into(),
        num_tokens: PROMPT_TOKENS as u32,
        transport: Transport::Nccl as i32,
        ..Default::default()
    };
    let bytes = table.commit(&commit)?;
    anyhow::ensure!(committed.try_recv().is_ok(), "the lease was not handed on");

    let local = local_copy_seconds(&stream, bytes as usize)?;
    let gbs = |s: f64| bytes as f64 / s / 1e9;
    println!(
        "| nccl, {PROMPT_TOKENS}-token prompt, Llama-3.1-8B KV, GPU {} to GPU 0 | GB/s | vs local copy |",
        devices - 1
    );
    println!("|---|---|---|");
    println!(
        "| local device-to-device copy (one call) | {:.0} | 1.00 |",
        gbs(local)
    );
    println!(
        "| nccl, {} block messages | {:.0} | {:.2} |",
        layers * SRC_BLOCKS,
        gbs(seconds / timed_share),
        local / (seconds / timed_share)
    );
    println!(
        "{{\"bytes\": {bytes}, \"local_gb_s\": {:.1}, \"nccl_gb_s\": {:.1}, \"wrong_block_layers\": {wrong}}}",
        gbs(local),
        gbs(seconds / timed_share)
    );
    anyhow::ensure!(wrong == 0, "{wrong} block-layers differ from what was sent");
    println!("PASS");
    Ok(())
}
