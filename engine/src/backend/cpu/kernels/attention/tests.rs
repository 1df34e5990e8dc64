//! The attention kernel against plain attention, across instruction sets and options.

use tandem_kv::KvDtype;

use super::per_lane::exp16;
use super::*;

#[test]
fn exp16_is_accurate() {
    let mut x = [0f32; 16];
    for (i, v) in x.iter_mut().enumerate() {
        *v = -80.0 + i as f32 * 10.3;
    }
    let want: Vec<f32> = x.iter().map(|v| v.exp()).collect();
    exp16(&mut x);
    for (a, b) in x.iter().zip(&want) {
        assert!((a - b).abs() <= 2e-7 * b.abs(), "{a} vs {b}");
    }
    let mut neg = [f32::NEG_INFINITY; 16];
    exp16(&mut neg);
    assert!(neg.iter().all(|&v| (0.0..1e-37).contains(&v)));
}

#[test]
fn every_instruction_set_gives_the_same_bits() {
    use rand::{Rng, SeedableRng, rngs::StdRng};
    use tandem_kv::{KvCache, KvDtype, KvLayout};
    let mut rng = StdRng::seed_from_u64(11);
    // GQA (4 query heads over 2 KV heads), head_dim 64 (the AVX-512 P·V path) and 40
    // (the one-lane path); a decode row beside a prefill chunk that ends mid-block; plain,
    // soft-capped, and windowed (wider and narrower than a block).
    for (d, params) in [64, 40].into_iter().flat_map(|d| {
        [None, Some(20.0)].into_iter().flat_map(move |softcap| {
            [None, Some(5), Some(21)].map(move |window| {
                (
                    d,
                    AttnParams {
                        scale: 0.3,
                        softcap,
                        window,
                    },
                )
            })
        })
    }) {
        let layout = KvLayout {
            num_layers: 1,
            num_kv_heads: 2,
            head_dim: d,
            block_size: BLOCK_SIZE,
            dtype: KvDtype::F32,
            model_fingerprint: "test".into(),
        };
        let mut cache = KvCache::with_budget(layout.clone(), 8 * layout.block_bytes()).unwrap();
        for b in 0..8 {
            for v in cache.block_layer_mut(0, b).unwrap() {
                *v = rng.random_range(-1.0f32..1.0);
            }
        }
        let (decode, chunk) = ([5u32, 1, 7], [2u32, 0, 6]);
        let seqs = [
            AttnSeq {
                q_row: 0,
                q_len: 1,
                start_pos: 40,
                block_table: &decode,
            },
            AttnSeq {
                q_row: 1,
                q_len: 21,
                start_pos: 8,
                block_table: &chunk,
            },
        ];
        let width = 4 * d;
        let q: Vec<f32> = (0..22 * width)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let mut scalar = vec![0f32; 22 * width];
        paged_attention_on(Isa::Scalar, &cache, 0, &q, &seqs, 4, params, &mut scalar);
        for isa in Isa::available() {
            let mut out = vec![f32::NAN; 22 * width];
            paged_attention_on(isa, &cache, 0, &q, &seqs, 4, params, &mut out);
            let same = out
                .iter()
                .zip(&scalar)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "{isa} differs from scalar at head_dim {d}, {params:?}"
            );
        }
    }
}

/// Attention written the plain way: gather the sequence's keys, mask, softmax, sum.
fn naive(
    cache: &KvCache,
    q: &[f32],
    seq: &AttnSeq<'_>,
    n_heads: usize,
    params: AttnParams,
) -> Vec<f32> {
    let layout = cache.layout();
    let (d, kv_heads) = (layout.head_dim, layout.num_kv_heads);
    let width = n_heads * d;
    let mut out = vec![0f32; seq.q_len * width];
    for r in 0..seq.q_len {
        let pos = seq.start_pos + r;
        let first = params.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        for h in 0..n_heads {
            let g = h / (n_heads / kv_heads);
            let qrow = &q[(seq.q_row + r) * width + h * d..][..d];
            let key = |k: usize, part: usize, i: usize| {
                let block = cache
                    .block_layer(0, seq.block_table[k / BLOCK_SIZE])
                    .unwrap();
                let slot = k % BLOCK_SIZE;
                if part == 0 {
                    block[g * d * BLOCK_SIZE + i * BLOCK_SIZE + slot]
                } else {
                    block[kv_heads * d * BLOCK_SIZE + g * BLOCK_SIZE * d + slot * d + i]
                }
            };
            let scores: Vec<f64> = (first..=pos)
                .map(|k| {
                    let dot: f64 = (0..d)
                        .map(|i| f64::from(qrow[i]) * f64::from(key(k, 0, i)))
                        .sum();
                    let s = dot * f64::from(params.scale);
                    params
                        .softcap
                        .map_or(s, |c| f64::from(c) * (s / f64::from(c)).tanh())
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = e.iter().sum();
            for i in 0..d {
                let v: f64 = (first..=pos)
                    .zip(&e)
                    .map(|(k, p)| p * f64::from(key(k, 1, i)))
                    .sum();
                out[r * width + h * d + i] = (v / total) as f32;
            }
        }
    }
    out
}

#[test]
fn windows_and_soft_caps_match_plain_attention() {
    use rand::{Rng, SeedableRng, rngs::StdRng};
    use tandem_kv::{KvCache, KvLayout};
    let mut rng = StdRng::seed_from_u64(5);
    let d = 32;
    let layout = KvLayout {
        num_layers: 1,
        num_kv_heads: 2,
        head_dim: d,
        block_size: BLOCK_SIZE,
        dtype: KvDtype::F32,
        model_fingerprint: "test".into(),
    };
    let mut cache = KvCache::with_budget(layout.clone(), 6 * layout.block_bytes()).unwrap();
    for b in 0..6 {
        for v in cache.block_layer_mut(0, b).unwrap() {
            *v = rng.random_range(-2.0f32..2.0);
        }
    }
    let table = [4u32, 0, 5, 2, 1, 3];
    let width = 4 * d;
    let q: Vec<f32> = (0..70 * width)
        .map(|_| rng.random_range(-2.0f32..2.0))
        .collect();
    // A whole prompt, a later chunk, and decode rows, each alone.
    for (start_pos, q_len) in [(0, 70), (37, 33), (69, 1), (16, 1), (3, 1)] {
        let seq = AttnSeq {
            q_row: 0,
            q_len,
            start_pos,
            block_table: &table,
        };
        for softcap in [None, Some(3.0)] {
            for window in [None, Some(1), Some(7), Some(16), Some(33), Some(100)] {
                let params = AttnParams {
                    scale: 0.25,
                    softcap,
                    window,
                };
                let mut out = vec![f32::NAN; q_len * width];
                paged_attention(&cache, 0, &q, &[seq], 4, params, &mut out);
                let want = naive(&cache, &q, &seq, 4, params);
                let err = out
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(err < 2e-5, "{start_pos}+{q_len} {params:?}: {err}");
            }
        }
    }
}

#[test]
fn a_window_no_shorter_than_the_context_changes_no_bit() {
    use rand::{Rng, SeedableRng, rngs::StdRng};
    use tandem_kv::{KvCache, KvLayout};
    let mut rng = StdRng::seed_from_u64(9);
    let layout = KvLayout {
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 16,
        block_size: BLOCK_SIZE,
        dtype: KvDtype::F32,
        model_fingerprint: "test".into(),
    };
    let mut cache = KvCache::with_budget(layout.clone(), 3 * layout.block_bytes()).unwrap();
    for b in 0..3 {
        for v in cache.block_layer_mut(0, b).unwrap() {
            *v = rng.random_range(-1.0f32..1.0);
        }
    }
    let table = [2u32, 0, 1];
    let q: Vec<f32> = (0..40 * 32)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let seq = AttnSeq {
        q_row: 0,
        q_len: 40,
        start_pos: 0,
        block_table: &table,
    };
    let mut plain = vec![0f32; 40 * 32];
    paged_attention(&cache, 0, &q, &[seq], 2, AttnParams::causal(16), &mut plain);
    let mut windowed = vec![0f32; 40 * 32];
    let params = AttnParams {
        window: Some(40),
        ..AttnParams::causal(16)
    };
    paged_attention(&cache, 0, &q, &[seq], 2, params, &mut windowed);
    assert!(
        plain
            .iter()
            .zip(&windowed)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    );
}

/// A prefill chunk takes the lane-vector path (`lanes`), a decode row the per-lane one: every
/// row must come out of both with the same bits, on every instruction set, whatever the
/// options, head size, cache dtype, and where the chunk starts and ends within blocks.
#[test]
fn a_row_gives_the_same_bits_in_a_prefill_chunk_as_alone() {
    use rand::{Rng, SeedableRng, rngs::StdRng};
    use tandem_kv::{KvCache, KvLayout};
    let mut rng = StdRng::seed_from_u64(17);
    for (d, dtype) in [(64, KvDtype::F32), (40, KvDtype::F32), (32, KvDtype::Bf16)] {
        let layout = KvLayout {
            num_layers: 1,
            num_kv_heads: 2,
            head_dim: d,
            block_size: BLOCK_SIZE,
            dtype,
            model_fingerprint: "test".into(),
        };
        let mut cache = KvCache::with_budget(layout.clone(), 6 * layout.block_bytes()).unwrap();
        let values: Vec<f32> = (0..6 * layout.block_layer_elems())
            .map(|_| rng.random_range(-2.0f32..2.0))
            .collect();
        let n = layout.block_layer_elems();
        for b in 0..6 {
            let bytes: Vec<u8> = values[b * n..(b + 1) * n]
                .iter()
                .flat_map(|&v| match dtype {
                    KvDtype::Bf16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
                    _ => v.to_le_bytes().to_vec(),
                })
                .collect();
            cache.write_block_layer_bytes(0, b as u32, &bytes).unwrap();
        }
        let table = [4u32, 0, 5, 2, 1, 3];
        // 6 query heads over 2 KV heads: 3 lanes a row, so a 21-row chunk has 63 lanes (four
        // groups of 16, the last padded) and a row alone has 3 (the per-lane path).
        let heads = 6;
        let width = heads * d;
        let q: Vec<f32> = (0..90 * width)
            .map(|_| rng.random_range(-2.0f32..2.0))
            .collect();
        for (start_pos, q_len) in [(0, 90), (7, 21), (33, 40)] {
            for softcap in [None, Some(3.0)] {
                for window in [None, Some(5), Some(16), Some(37)] {
                    let params = AttnParams {
                        scale: 0.3,
                        softcap,
                        window,
                    };
                    for isa in Isa::available() {
                        let chunk = AttnSeq {
                            q_row: start_pos,
                            q_len,
                            start_pos,
                            block_table: &table,
                        };
                        let mut together = vec![f32::NAN; 90 * width];
                        paged_attention_on(
                            isa,
                            &cache,
                            0,
                            &q,
                            &[chunk],
                            heads,
                            params,
                            &mut together,
                        );
                        let alone = rows_alone(start_pos, q_len, &table);
                        let mut apart = vec![f32::NAN; 90 * width];
                        paged_attention_on(isa, &cache, 0, &q, &alone, heads, params, &mut apart);
                        let rows = start_pos * width..(start_pos + q_len) * width;
                        let same = together[rows.clone()]
                            .iter()
                            .zip(&apart[rows])
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(
                            same,
                            "{isa}, head_dim {d}, {dtype:?}, rows {start_pos}+{q_len}, {params:?}"
                        );
                    }
                }
            }
        }
    }
}

/// Rows `start_pos..start_pos + q_len` of one sequence, each as a sequence of its own (a
/// decode row), to set against the same rows as one prefill chunk.
fn rows_alone(start_pos: usize, q_len: usize, table: &[u32]) -> Vec<AttnSeq<'_>> {
    (start_pos..start_pos + q_len)
        .map(|pos| AttnSeq {
            q_row: pos,
            q_len: 1,
            start_pos: pos,
            block_table: table,
        })
        .collect()
}

/// Contexts of several key spans: a row's bits are the same whether its spans ran as
/// separate tasks or in turn, alone or in a prefill chunk, on every instruction set; and
/// the folded spans agree with plain attention.
#[test]
fn key_spans_change_no_bit_however_the_work_is_divided() {
    use rand::{Rng, SeedableRng, rngs::StdRng};
    use tandem_kv::{KvCache, KvLayout};
    let mut rng = StdRng::seed_from_u64(23);
    let blocks = 3 * SPAN_BLOCKS + 3;
    let layout = KvLayout {
        num_layers: 1,
        num_kv_heads: 2,
        head_dim: 64,
        block_size: BLOCK_SIZE,
        dtype: KvDtype::F32,
        model_fingerprint: "test".into(),
    };
    let mut cache = KvCache::with_budget(layout.clone(), blocks * layout.block_bytes()).unwrap();
    for b in 0..blocks as u32 {
        for v in cache.block_layer_mut(0, b).unwrap() {
            *v = rng.random_range(-2.0f32..2.0);
        }
    }
    // Blocks scattered over the pool, as a long-lived sequence's are.
    let table: Vec<u32> = (0..blocks as u32)
        .map(|b| (b * 7) % blocks as u32)
        .collect();
    let heads = 6;
    let width = heads * 64;
    let keys = blocks * BLOCK_SIZE;
    let q: Vec<f32> = (0..keys * width)
        .map(|_| rng.random_range(-2.0f32..2.0))
        .collect();
    // The last rows of the context: a chunk crossing a span boundary and ending mid-block.
    let (start_pos, q_len) = (2 * SPAN_BLOCKS * BLOCK_SIZE - 5, 2 * BLOCK_SIZE + 3);
    for window in [None, Some(100), Some(2 * SPAN_BLOCKS * BLOCK_SIZE + 9)] {
        let params = AttnParams {
            scale: 0.2,
            softcap: None,
            window,
        };
        let chunk = AttnSeq {
            q_row: start_pos,
            q_len,
            start_pos,
            block_table: &table,
        };
        let alone = rows_alone(start_pos, q_len, &table);
        let rows = start_pos * width..(start_pos + q_len) * width;
        let want = naive(&cache, &q, &chunk, heads, params);
        let mut first: Option<Vec<f32>> = None;
        for isa in Isa::available() {
            for split in [Split::Never, Split::WhenFewUnits, Split::Always] {
                for seqs in [std::slice::from_ref(&chunk), alone.as_slice()] {
                    let mut out = vec![f32::NAN; keys * width];
                    attend(isa, &cache, 0, &q, seqs, heads, params, &mut out, split);
                    let got = out[rows.clone()].to_vec();
                    match &first {
                        None => {
                            for (a, b) in got.iter().zip(&want) {
                                assert!((a - b).abs() < 1e-4, "{a} vs plain {b}, {params:?}");
                            }
                            first = Some(got);
                        }
                        Some(f) => assert!(
                            f.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{isa}, {split:?}, {} seqs, {params:?}",
                            seqs.len()
                        ),
                    }
                }
            }
        }
    }
}
