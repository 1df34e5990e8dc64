//! tandem's CUDA kernels (`engine/src/backend/cuda/kernels.cu`), unchanged, run on the CPU and checked
//! against the CPU engine on fresh random inputs, so their indexing and math are tested on
//! every machine and not only where a GPU is lent.
//!
//! `tests/cuda_on_cpu/emu.h` supplies the few device-language pieces the kernels use (every
//! CUDA thread an OS thread, block and warp barriers for `__syncthreads` and shuffles); the
//! harness beside it runs one launch per process. Each launch below uses the grid and block
//! shape, and the argument types, that `gpu/forward.rs` uses. A C++20 compiler is needed
//! (`$CXX`, else `c++`): without one the tests skip, except under `CI`, where they fail.
//! What this cannot check is the device itself: rounding of its fast exponential, memory
//! ordering between real warps, cuBLAS, streams. The GPU run (scripts/gpu/on-device.sh)
//! covers those.

mod cuda_on_cpu;

use half::bf16;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use tandem_engine::backend::cpu::kernels::attention::{AttnParams, AttnSeq, paged_attention};
use tandem_engine::backend::cpu::kernels::{RopeTable, rms_norm, silu_mul};
use tandem_engine::backend::cuda::attention::Plan;
use tandem_engine::backend::cuda::launch::Launch;
use tandem_engine::config::ModelConfig;
use tandem_kv::{BLOCK_SIZE, KvCache, KvDtype, KvLayout, KvStorage, staging};

use cuda_on_cpu::{
    Arg, bf16_bytes, bf16s, blocks_for, f32_bytes, f32s, i32_bytes, launch, per_row, to_f32,
    try_launch,
};

/// Rounding a result to bf16 costs at most 2^-9 of it: anything past that is a kernel's error.
const BF16_OUTPUT: f32 = 1.0 / 256.0;
/// The tensor-core attention also rounds Q and the softmax weights to bf16 (as FlashAttention
/// does): about one bf16 step of the largest output (2.7e-3 seen), with a margin.
const FLASH_BF16: f32 = 1.0 / 128.0;

fn random(rng: &mut StdRng, n: usize, amp: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-amp..amp)).collect()
}

/// Largest element-wise error relative to the reference's largest magnitude (the measure the
/// GPU issue sets at 1e-2 for bf16 outputs; these use [`BF16_OUTPUT`], tighter, so that small
/// systematic errors show).
fn assert_close(what: &str, got: &[f32], want: &[f32], tolerance: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
    let (worst, at) = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .enumerate()
        .fold(
            (0f32, 0),
            |(m, at), (i, e)| if e > m { (e, i) } else { (m, at) },
        );
    assert!(
        worst / scale <= tolerance && got.iter().all(|v| v.is_finite()),
        "{what}: relative error {} at {at} (got {}, want {})",
        worst / scale,
        got[at],
        want[at]
    );
}

#[test]
fn embed_rows_and_gather_rows_copy_the_right_rows() {
    let mut rng = StdRng::seed_from_u64(1);
    let (vocab, hidden) = (50, 96);
    let table: Vec<bf16> = random(&mut rng, vocab * hidden, 1.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let tokens: Vec<u32> = vec![3, 49, 0, 3, 17];
    let rows = tokens.len();
    let token_bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let out = launch(
        "embed_rows",
        per_row(rows),
        256,
        &[
            Arg::Buf(bf16_bytes(&table)),
            Arg::Buf(token_bytes),
            Arg::Buf(vec![0; rows * hidden * 4]),
            Arg::I32(rows as i32),
            Arg::I32(hidden as i32),
        ],
    );
    let x = f32s(&out[2]);
    for (r, &t) in tokens.iter().enumerate() {
        let want = to_f32(&table[t as usize * hidden..(t as usize + 1) * hidden]);
        assert_eq!(&x[r * hidden..(r + 1) * hidden], &want[..], "row {r}");
    }
    let wanted = [4i32, 0, 2];
    let out = launch(
        "gather_rows",
        per_row(wanted.len()),
        256,
        &[
            Arg::Buf(f32_bytes(&x)),
            Arg::Buf(i32_bytes(&wanted)),
            Arg::Buf(vec![0; wanted.len() * hidden * 4]),
            Arg::I32(wanted.len() as i32),
            Arg::I32(hidden as i32),
        ],
    );
    let gathered = f32s(&out[2]);
    for (i, &r) in wanted.iter().enumerate() {
        let r = r as usize;
        assert_eq!(
            &gathered[i * hidden..(i + 1) * hidden],
            &x[r * hidden..(r + 1) * hidden]
        );
    }
}

#[test]
fn rms_norm_matches_the_cpu_engine() {
    let mut rng = StdRng::seed_from_u64(2);
    // SmolLM2's width (not a multiple of the threads) and a narrow one, at the forward
    // pass's 1024 threads and at 256.
    for (hidden, threads) in [(576, 1024), (64, 1024), (576, 256)] {
        let rows = 3;
        let x = random(&mut rng, rows * hidden, 4.0);
        let w = random(&mut rng, hidden, 2.0);
        let eps = 1e-5f32;
        let out = launch(
            "rms_norm_bf16",
            per_row(rows),
            threads,
            &[
                Arg::Buf(f32_bytes(&x)),
                Arg::Buf(f32_bytes(&w)),
                Arg::Buf(vec![0; rows * hidden * 2]),
                Arg::I32(rows as i32),
                Arg::I32(hidden as i32),
                Arg::F32(eps),
            ],
        );
        let mut want = vec![0f32; rows * hidden];
        rms_norm(&x, &w, eps, &mut want);
        assert_close(
            &format!("rms_norm, hidden {hidden}"),
            &to_f32(&bf16s(&out[2])),
            &want,
            BF16_OUTPUT,
        );
    }
}

#[test]
fn rope_and_kv_write_match_the_cpu_engine() {
    let mut rng = StdRng::seed_from_u64(3);
    // Plain RoPE (SmolLM2) and Llama 3.1's scaled frequencies.
    for preset in ["smollm2-135m", "llama-3.1-8b"] {
        let cfg = ModelConfig::preset(preset).expect("preset");
        let (qh, kvh, d) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let width = cfg.q_width() + 2 * cfg.kv_width();
        // One sequence; its block table points the blocks these positions fall in at four
        // physical blocks (positions 0 and 1 share one), everything else at block 0.
        let positions: Vec<usize> = vec![0, 1, 17, 4095, 8191];
        let rows = positions.len();
        let max_blocks = 8192 / BLOCK_SIZE;
        let mut table = vec![0i32; max_blocks];
        let physical = [
            (0, 2),
            (1, 0),
            (4095 / BLOCK_SIZE, 3),
            (8191 / BLOCK_SIZE, 1),
        ];
        for &(logical, block) in &physical {
            table[logical] = block;
        }
        let layout = KvLayout {
            num_layers: 2,
            num_kv_heads: kvh,
            head_dim: d,
            block_size: BLOCK_SIZE,
            dtype: KvDtype::F32,
            model_fingerprint: String::new(),
        };
        let num_blocks = 4;
        let block_elems = layout.block_layer_elems();
        let layer = 1;
        let layer_offset = (layer * num_blocks * block_elems) as i64;
        let cache = bf16_bytes(&vec![
            bf16::NAN;
            layout.num_layers * num_blocks * block_elems
        ]);
        let qkv = random(&mut rng, rows * width, 1.0);
        let rope = RopeTable::new(&cfg);
        let pos_i32: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
        // One block per token (many SMs' worth of tokens), heads split unevenly between
        // blocks, one head per block: the shapes `Launch::rope` picks for prefill and decode.
        for multiprocessors in [1, 7, 132] {
            let (shape, heads_per_block) = Launch::rope(rows, qh + kvh, multiprocessors);
            let preset = format!("{preset}, {heads_per_block} heads per block");
            let out = launch(
                "rope_kv_write",
                shape.blocks,
                shape.threads,
                &[
                    Arg::Buf(f32_bytes(&qkv)),
                    Arg::Buf(i32_bytes(&pos_i32)),
                    Arg::Buf(f32_bytes(rope.inv_freq())),
                    Arg::Buf(i32_bytes(&vec![0; rows])),
                    Arg::Buf(i32_bytes(&table)),
                    Arg::I32(max_blocks as i32),
                    Arg::Buf(cache.clone()),
                    Arg::I64(layer_offset),
                    Arg::I32(rows as i32),
                    Arg::I32(width as i32),
                    Arg::I32(qh as i32),
                    Arg::I32(kvh as i32),
                    Arg::I32(d as i32),
                    Arg::I32(heads_per_block as i32),
                ],
            );
            let got = f32s(&out[0]);
            let mut want = qkv.clone();
            let (cos, sin) = rope.cos_sin(&positions);
            // K follows Q in a fused row, so one call rotates both.
            rope.apply(&mut want, width, 0, qh + kvh, &cos, &sin);
            assert_close(&format!("rope, {preset}"), &got, &want, 1e-4);
            let (k_start, v_start) = (cfg.q_width(), cfg.q_width() + cfg.kv_width());
            for r in 0..rows {
                assert_eq!(
                    &got[r * width + v_start..(r + 1) * width],
                    &qkv[r * width + v_start..(r + 1) * width],
                    "{preset}: V must not be rotated"
                );
            }
            // Each token's rotated K and its V, in bf16, in its slot; nothing else written (the
            // cache was NaN) but in the layer asked for.
            let device = bf16s(&out[5]);
            let part = kvh * BLOCK_SIZE * d;
            let mut written = vec![false; device.len()];
            for (r, &pos) in positions.iter().enumerate() {
                let block = table[pos / BLOCK_SIZE] as usize;
                let base = layer_offset as usize + block * block_elems;
                for h in 0..kvh {
                    for i in 0..d {
                        let at = base + (h * BLOCK_SIZE + pos % BLOCK_SIZE) * d + i;
                        let k = got[r * width + k_start + h * d + i];
                        let v = qkv[r * width + v_start + h * d + i];
                        assert_eq!(device[at], bf16::from_f32(k), "{preset}: K of row {r}");
                        assert_eq!(
                            device[at + part],
                            bf16::from_f32(v),
                            "{preset}: V of row {r}"
                        );
                        written[at] = true;
                        written[at + part] = true;
                    }
                }
            }
            assert!(
                device.iter().zip(&written).all(|(v, &w)| w || v.is_nan()),
                "{preset}: a write outside the tokens' slots"
            );
        }
    }
}

/// One batch of token rows against the paged cache, as `GpuModel::forward` lays it out.
struct Batch {
    /// (sequence, start position, rows)
    entries: Vec<(usize, usize, usize)>,
}

/// Runs `rope_kv_write`, then both attention kernels for `batch` on the emulated device
/// cache, and checks them against the CPU engine's attention over the same cache converted
/// to the CPU layout.
#[allow(clippy::too_many_arguments)]
fn attention_step(
    rng: &mut StdRng,
    layout: &KvLayout,
    num_blocks: usize,
    device_cache: &mut Vec<u8>,
    tables: &[Vec<u32>],
    batch: &Batch,
    layer: usize,
    q_heads: usize,
) {
    let (kvh, d) = (layout.num_kv_heads, layout.head_dim);
    let (qw, kw) = (q_heads * d, kvh * d);
    let width = qw + 2 * kw;
    let rows: usize = batch.entries.iter().map(|e| e.2).sum();
    let qkv = random(rng, rows * width, 1.0);
    let (mut positions, mut token_seq) = (Vec::new(), Vec::new());
    for (bi, &(_, start, n)) in batch.entries.iter().enumerate() {
        positions.extend((start..start + n).map(|p| p as i32));
        token_seq.extend(std::iter::repeat_n(bi as i32, n));
    }
    let max_blocks = batch
        .entries
        .iter()
        .map(|e| tables[e.0].len())
        .max()
        .unwrap_or(1);
    let mut table_rows = vec![0i32; batch.entries.len() * max_blocks];
    for (bi, e) in batch.entries.iter().enumerate() {
        for (j, &b) in tables[e.0].iter().enumerate() {
            table_rows[bi * max_blocks + j] = b as i32;
        }
    }
    let layer_offset = (layer * num_blocks * layout.block_layer_elems()) as i64;
    let cfg = ModelConfig {
        num_attention_heads: q_heads,
        num_key_value_heads: kvh,
        head_dim: d,
        ..ModelConfig::preset("tiny").expect("preset")
    };
    // A few SMs, so that small batches split their heads between blocks as on the GPU.
    let (shape, heads_per_block) = Launch::rope(rows, q_heads + kvh, 4);
    let out = launch(
        "rope_kv_write",
        shape.blocks,
        shape.threads,
        &[
            Arg::Buf(f32_bytes(&qkv)),
            Arg::Buf(i32_bytes(&positions)),
            Arg::Buf(f32_bytes(RopeTable::new(&cfg).inv_freq())),
            Arg::Buf(i32_bytes(&token_seq)),
            Arg::Buf(i32_bytes(&table_rows)),
            Arg::I32(max_blocks as i32),
            Arg::Buf(std::mem::take(device_cache)),
            Arg::I64(layer_offset),
            Arg::I32(rows as i32),
            Arg::I32(width as i32),
            Arg::I32(q_heads as i32),
            Arg::I32(kvh as i32),
            Arg::I32(d as i32),
            Arg::I32(heads_per_block as i32),
        ],
    );
    *device_cache = out[5].clone();
    // The rows as RoPE left them: what attention reads (Q) and what went to the cache (K).
    let qkv = f32s(&out[0]);

    // The CPU engine's view: the device cache converted block by block (the staging
    // conversion the transports rely on).
    let device = bf16s(device_cache);
    let mut cache = KvCache::new(
        layout.clone(),
        num_blocks,
        KvStorage::anonymous(num_blocks * layout.block_bytes()).expect("storage"),
    )
    .expect("cache");
    let n = layout.block_layer_elems();
    for l in 0..layout.num_layers {
        for b in 0..num_blocks {
            let off = (l * num_blocks + b) * n;
            let host = cache.block_layer_mut(l, b as u32).expect("block");
            staging::from_device_layout(layout, &device[off..off + n], host).expect("convert");
        }
    }
    // rope_kv_write put each token's K and V (bf16-rounded) in its slot of its own layer only.
    for (r, (&pos, &bi)) in positions.iter().zip(&token_seq).enumerate() {
        let seq = batch.entries[bi as usize].0;
        let block = tables[seq][pos as usize / BLOCK_SIZE];
        let (k, v) = cache
            .read_token(layer, block, pos as usize % BLOCK_SIZE)
            .expect("token");
        let row = &qkv[r * width..(r + 1) * width];
        let round =
            |x: &[f32]| -> Vec<f32> { x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect() };
        assert_eq!(k, round(&row[qw..qw + kw]), "K of row {r}");
        assert_eq!(v, round(&row[qw + kw..]), "V of row {r}");
    }
    let q: Vec<f32> = qkv
        .chunks_exact(width)
        .flat_map(|row| row[..qw].to_vec())
        .collect();
    let mut q_row = 0;
    let seqs: Vec<AttnSeq<'_>> = batch
        .entries
        .iter()
        .map(|&(seq, start, n)| {
            let s = AttnSeq {
                q_row,
                q_len: n,
                start_pos: start,
                block_table: &tables[seq],
            };
            q_row += n;
            s
        })
        .collect();
    let mut want = vec![0f32; rows * qw];
    paged_attention(
        &cache,
        layer,
        &q,
        &seqs,
        q_heads,
        AttnParams::causal(d),
        &mut want,
    );
    let scale = 1.0 / (d as f32).sqrt();
    let what = format!("{q_heads} heads over {kvh}, head_dim {d}");
    let paged = launch(
        "paged_attention",
        blocks_for(rows * q_heads * 32, 128),
        128,
        &[
            Arg::Buf(f32_bytes(&qkv)),
            Arg::Buf(i32_bytes(&positions)),
            Arg::Buf(i32_bytes(&token_seq)),
            Arg::Buf(i32_bytes(&table_rows)),
            Arg::I32(max_blocks as i32),
            Arg::Buf(device_cache.clone()),
            Arg::I64(layer_offset),
            Arg::Buf(poisoned_bf16(rows * qw)),
            Arg::I32(rows as i32),
            Arg::I32(width as i32),
            Arg::I32(q_heads as i32),
            Arg::I32(kvh as i32),
            Arg::I32(d as i32),
            Arg::F32(scale),
        ],
    );
    let got = to_f32(&bf16s(&paged[5]));
    assert_close(
        &format!("paged attention, {what}"),
        &got,
        &want,
        BF16_OUTPUT,
    );
    if !matches!(d, 64 | 128) {
        return;
    }
    // The tensor-core kernel: bf16 Q and P on top of the bf16 output (FlashAttention's
    // rounding), once reading whole contexts and once split into many parts.
    let spans: Vec<(usize, usize, usize)> = {
        let mut first = 0;
        batch
            .entries
            .iter()
            .map(|&(_, start, n)| {
                first += n;
                (first - n, n, start)
            })
            .collect()
    };
    for multiprocessors in [1, 64] {
        let plan = Plan::new(&cfg, &spans, multiprocessors);
        let partial_len = rows * q_heads * plan.splits * (d + 2);
        let flash = launch(
            "flash_attention",
            (plan.tile_count() * kvh * plan.splits) as u32,
            128,
            &[
                Arg::Buf(f32_bytes(&qkv)),
                Arg::Buf(i32_bytes(&positions)),
                Arg::Buf(i32_bytes(&token_seq)),
                Arg::Buf(i32_bytes(&table_rows)),
                Arg::I32(max_blocks as i32),
                Arg::Buf(device_cache.clone()),
                Arg::I64(layer_offset),
                Arg::Buf(i32_bytes(&plan.tiles)),
                Arg::I32(plan.splits as i32),
                Arg::I32(plan.keys_per_split as i32),
                Arg::Buf(poisoned_bf16(rows * qw)),
                Arg::Buf(f32_bytes(&vec![f32::NAN; partial_len])),
                Arg::I32(width as i32),
                Arg::I32(q_heads as i32),
                Arg::I32(kvh as i32),
                Arg::I32(d as i32),
                Arg::F32(scale),
            ],
        );
        let mut out = flash[6].clone();
        if plan.splits > 1 {
            let combined = launch(
                "attention_combine",
                per_row(rows * q_heads),
                128,
                &[
                    Arg::Buf(flash[7].clone()),
                    Arg::Buf(poisoned_bf16(rows * qw)),
                    Arg::I32(rows as i32),
                    Arg::I32(q_heads as i32),
                    Arg::I32(d as i32),
                    Arg::I32(plan.splits as i32),
                ],
            );
            out = combined[1].clone();
        }
        let got = to_f32(&bf16s(&out));
        assert_close(
            &format!("flash attention, {what}, {} splits", plan.splits),
            &got,
            &want,
            FLASH_BF16,
        );
    }
}

/// NaN in every element, so that one a kernel leaves unwritten fails the comparison.
fn poisoned_bf16(n: usize) -> Vec<u8> {
    bf16_bytes(&vec![bf16::NAN; n])
}

#[test]
fn rope_kv_write_and_both_attention_kernels_match_the_cpu_engine() {
    let mut rng = StdRng::seed_from_u64(4);
    // SmolLM2's heads, Llama's head_dim 128 with its GQA group of 4 and with 2, plain
    // multi-head attention (64 tokens a tensor-core tile), and a head size only the CUDA-core
    // kernel takes.
    for (q_heads, kv_heads, head_dim) in
        [(9, 3, 64), (8, 2, 128), (4, 2, 128), (2, 2, 64), (2, 2, 32)]
    {
        let layout = KvLayout {
            num_layers: 2,
            num_kv_heads: kv_heads,
            head_dim,
            block_size: BLOCK_SIZE,
            dtype: KvDtype::F32,
            model_fingerprint: String::new(),
        };
        let num_blocks = 14;
        let mut cache = vec![0u8; 2 * layout.num_layers * num_blocks * layout.block_layer_elems()];
        // Scattered physical blocks: sequence 0 reaches 150 tokens (10 blocks), 1 reaches 21 (2).
        let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
        ids.shuffle(&mut rng);
        let tables = vec![ids[..10].to_vec(), ids[10..12].to_vec()];
        // Two prefills (sequence 0 over several query and key tiles), then a prefill chunk
        // that continues at 100 beside a decode step, then a decode step at 137.
        let steps = [
            Batch {
                entries: vec![(0, 0, 100), (1, 0, 20)],
            },
            Batch {
                entries: vec![(1, 20, 1), (0, 100, 37)],
            },
            Batch {
                entries: vec![(0, 137, 1)],
            },
        ];
        for step in &steps {
            attention_step(
                &mut rng, &layout, num_blocks, &mut cache, &tables, step, 1, q_heads,
            );
        }
        // Layer 0 was never written: layer_offset kept the writes in layer 1.
        let layer_bytes = num_blocks * layout.block_layer_elems() * 2;
        assert!(cache[..layer_bytes].iter().all(|&b| b == 0));
    }
}

#[test]
fn silu_mul_matches_the_cpu_engine() {
    let mut rng = StdRng::seed_from_u64(5);
    let (rows, f) = (3, 1536);
    let gate_up = random(&mut rng, rows * 2 * f, 6.0);
    // Two blocks for 4608 outputs: the grid-stride loop must cover the rest, as it does when
    // forward.rs caps the grid.
    let out = launch(
        "silu_mul_bf16",
        2,
        256,
        &[
            Arg::Buf(f32_bytes(&gate_up)),
            Arg::Buf(vec![0; rows * f * 2]),
            Arg::I32(rows as i32),
            Arg::I32(f as i32),
        ],
    );
    let mut want = vec![0f32; rows * f];
    silu_mul(&gate_up, f, &mut want);
    assert_close("silu_mul", &to_f32(&bf16s(&out[1])), &want, BF16_OUTPUT);
}

#[test]
fn fill_uniform_is_seeded_bounded_and_uniform() {
    let n = 20_000usize;
    let amp = 0.05f32;
    let fill = |seed: u64| -> Vec<f32> {
        let out = launch(
            "fill_uniform_bf16",
            blocks_for(n.min(1024), 256),
            256,
            &[
                Arg::Buf(vec![0; n * 2]),
                Arg::I64(n as i64),
                Arg::U64(seed),
                Arg::F32(amp),
            ],
        );
        to_f32(&bf16s(&out[0]))
    };
    let a = fill(7);
    assert_eq!(fill(7), a, "same seed, same values");
    assert_ne!(fill(8), a, "another seed, other values");
    // bf16 rounding may land one step past amp.
    assert!(a.iter().all(|v| v.abs() <= amp * (1.0 + 1.0 / 128.0)));
    let mean = a.iter().sum::<f32>() / n as f32;
    let var = a.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / n as f32;
    // Uniform on [-amp, amp]: mean 0 (standard error amp/√(3n) ≈ 2e-4), variance amp²/3.
    assert!(mean.abs() < 1e-3, "mean {mean}");
    let ratio = var / (amp * amp / 3.0);
    assert!((0.95..1.05).contains(&ratio), "variance ratio {ratio}");
}

#[test]
fn a_mistyped_argument_is_refused_not_misread() {
    // fill_uniform_bf16(bf16*, long long, unsigned long long, float): a 32-bit count, or a
    // float buffer where a bf16 one belongs, would be misread on the device.
    let refused = |args: &[Arg]| -> String {
        try_launch("fill_uniform_bf16", 1, 32, args)
            .expect_err("a mistyped argument must be refused")
    };
    let err = refused(&[
        Arg::Bf16s(vec![0; 8]),
        Arg::I32(4),
        Arg::U64(7),
        Arg::F32(1.0),
    ]);
    assert!(err.contains("argument 1"), "{err}");
    let err = refused(&[
        Arg::F32s(f32_bytes(&[0.0; 4])),
        Arg::I64(4),
        Arg::U64(7),
        Arg::F32(1.0),
    ]);
    assert!(err.contains("argument 0"), "{err}");
    // The same call, typed right, runs.
    let ok = try_launch(
        "fill_uniform_bf16",
        1,
        32,
        &[
            Arg::Bf16s(vec![0; 8]),
            Arg::I64(4),
            Arg::U64(7),
            Arg::F32(1.0),
        ],
    )
    .expect("typed right");
    assert!(
        bf16s(&ok[0])
            .iter()
            .all(|v| v.to_f32().abs() <= 1.0 && *v != bf16::ZERO)
    );
}

#[test]
fn kv_blocks_gather_and_scatter_move_exactly_the_listed_blocks() {
    let mut rng = StdRng::seed_from_u64(6);
    // Llama-3.1-8B's block: 8 KV heads of 128, K and V, 16 slots.
    let (layers, num_blocks, block_elems) = (2usize, 6usize, 2 * 8 * BLOCK_SIZE * 128);
    let cache: Vec<bf16> = random(&mut rng, layers * num_blocks * block_elems, 1.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let blocks = [4i32, 0, 5];
    let layer = 1usize;
    let layer_offset = (layer * num_blocks * block_elems) as i64;
    let block_at = |c: &[bf16], b: i32| {
        let off = layer_offset as usize + b as usize * block_elems;
        c[off..off + block_elems].to_vec()
    };
    let out = launch(
        "gather_kv_blocks",
        blocks.len() as u32,
        256,
        &[
            Arg::Buf(bf16_bytes(&cache)),
            Arg::I64(layer_offset),
            Arg::Buf(i32_bytes(&blocks)),
            Arg::I32(blocks.len() as i32),
            Arg::I32(block_elems as i32),
            Arg::Buf(vec![0; blocks.len() * block_elems * 2]),
        ],
    );
    let packed = bf16s(&out[2]);
    for (i, &b) in blocks.iter().enumerate() {
        assert_eq!(
            packed[i * block_elems..(i + 1) * block_elems],
            block_at(&cache, b)[..],
            "gathered block {b}"
        );
    }
    // Scatter the packed blocks back into a zeroed pool, at other ids.
    let targets = [1i32, 3, 2];
    let out = launch(
        "scatter_kv_blocks",
        targets.len() as u32,
        256,
        &[
            Arg::Buf(bf16_bytes(&packed)),
            Arg::Buf(i32_bytes(&targets)),
            Arg::I32(targets.len() as i32),
            Arg::I32(block_elems as i32),
            Arg::Buf(vec![0; cache.len() * 2]),
            Arg::I64(layer_offset),
        ],
    );
    let pool = bf16s(&out[2]);
    let mut expected = vec![bf16::ZERO; cache.len()];
    for (&src, &dst) in blocks.iter().zip(&targets) {
        let off = layer_offset as usize + dst as usize * block_elems;
        expected[off..off + block_elems].copy_from_slice(&block_at(&cache, src));
    }
    assert!(
        pool == expected,
        "scatter wrote outside the listed blocks or misplaced one"
    );
}
