//! `fast` mode's integer tiles: against an f64 evaluation of the same quantized arithmetic
//! (exact integer sums), bit for bit across instruction sets and batches, near `exact` mode,
//! and at the largest integers each format holds (no i16 saturation).

use half::f16;

use super::ggml::decode_row;
use super::int8::ACT_BLOCK;
use super::tests::{every_isa_gives, quantized, random};
use super::*;
use crate::backend::cpu::kernels::matmul::{Matrix, PANEL, linear_on};

fn quad_panels(kind: QuantKind, n: usize, k: usize, bytes: &[u8]) -> QuantPanels {
    QuantPanels::from_ggml_in(Arrangement::Quads, kind, n, k, bytes).unwrap()
}

fn quads(kind: QuantKind, n: usize, k: usize, bytes: &[u8]) -> Matrix {
    Matrix::quantized(quad_panels(kind, n, k, bytes))
}

/// `m` rows of `x` against `w` on `tile`, one output element past the end left NaN (to
/// catch a tile writing past its columns).
fn on_tile(tile: IntTile, w: &QuantPanels, x: &[f32], m: usize) -> Vec<f32> {
    let (n, k) = (w.rows, w.cols());
    let mut acts = QuantizedActs::default();
    acts.quantize(x, m, k);
    let mut out = vec![f32::NAN; m * n + 1];
    let to = IntOut {
        out: crate::backend::cpu::kernels::SharedMut(out.as_mut_ptr()),
        ldo: n,
        count: n,
    };
    // SAFETY: the tile is supported (callers check); the output holds `m` rows of `n`.
    unsafe { int_block(tile, &acts, w, 0, n.div_ceil(PANEL), to) };
    assert!(
        out.pop().is_some_and(f32::is_nan),
        "{tile}: wrote past the output"
    );
    out
}

/// Every integer tile this CPU runs (not only each instruction set's best) gives `want`.
fn every_tile_gives(want: &[f32], w: &QuantPanels, x: &[f32], m: usize, what: &str) {
    for tile in IntTile::ALL.into_iter().filter(|t| t.supported()) {
        let got = on_tile(tile, w, x, m);
        let same = got
            .iter()
            .zip(want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{what} on the {tile} tile: differs");
    }
}

/// The module docs' formula in f64 from the GGML bytes (decoded independently of the
/// panels), for `m` rows of x: the terms' f32 factors as the kernels round them, their sum
/// exact, and the sum of the terms' magnitudes (the bound of f32 accumulation's error).
fn reference(
    kind: QuantKind,
    n: usize,
    k: usize,
    bytes: &[u8],
    x: &[f32],
    m: usize,
) -> Vec<(f64, f64)> {
    let mut acts = QuantizedActs::default();
    acts.quantize(x, m, k);
    let row_bytes = bytes.len() / n;
    let group = kind.group();
    let per_block = if kind.super_blocks() {
        SUPER_BLOCK / group
    } else {
        1
    };
    let mut out = Vec::new();
    let mut row = DecodedRow::default();
    for r in 0..m {
        let qx = acts.row(r);
        for j in 0..n {
            decode_row(
                kind,
                &bytes[j * row_bytes..(j + 1) * row_bytes],
                k,
                &mut row,
            );
            let (mut sum, mut magnitude) = (0f64, 0f64);
            for g in 0..k / group {
                let first = g * group;
                let dot: i64 = (first..first + group)
                    .map(|i| i64::from(row.q[i]) * i64::from(qx[i]))
                    .sum();
                let d = row.d[g / per_block].to_f32();
                let m_ = row.m.get(g / per_block).map_or(0.0, |v| v.to_f32());
                let (scale, offset) = if kind.super_blocks() {
                    let neg_min = row.neg_min.get(g).copied().unwrap_or(0);
                    (d * f32::from(row.sc[g]), m_ * f32::from(neg_min))
                } else {
                    (d, m_)
                };
                let block = (r * k + first) / ACT_BLOCK;
                let term = f64::from(scale * acts.scale[block]) * dot as f64;
                let offset_term = if kind.asymmetric() {
                    f64::from(offset) * f64::from(acts.x_sum[block])
                } else {
                    0.0
                };
                sum += term + offset_term;
                magnitude += term.abs() + offset_term.abs();
            }
            out.push((sum, magnitude));
        }
    }
    out
}

#[test]
fn quads_hold_the_values_of_the_input_major_panels() {
    let (rows, cols) = (37, 512);
    for kind in QuantKind::ALL {
        let (bytes, _) = quantized(kind, rows, cols, 11);
        let a = QuantPanels::from_ggml(kind, rows, cols, &bytes).unwrap();
        let b = QuantPanels::from_ggml_in(Arrangement::Quads, kind, rows, cols, &bytes).unwrap();
        for r in 0..rows {
            for c in 0..cols {
                assert_eq!(
                    a.get(r, c).to_bits(),
                    b.get(r, c).to_bits(),
                    "{kind} ({r}, {c})"
                );
            }
        }
    }
}

#[test]
fn integer_tiles_compute_the_quantized_arithmetic_on_every_instruction_set() {
    for (n, k) in [(70, 512), (21, 256)] {
        for kind in QuantKind::ALL {
            let (bytes, _) = quantized(kind, n, k, 12);
            let w = quads(kind, n, k, &bytes);
            for m in [1, 2, 3, 4, 5, 9, 70] {
                let x = random(m * k, 13);
                let want = reference(kind, n, k, &bytes, &x, m);
                let mut scalar = vec![f32::NAN; m * n];
                linear_on(Isa::Scalar, &x, m, &w, &mut scalar);
                for (i, (&got, &(sum, magnitude))) in scalar.iter().zip(&want).enumerate() {
                    let bound = 1e-6 * magnitude + 1e-30;
                    assert!(
                        (f64::from(got) - sum).abs() <= bound,
                        "{kind} {m}x{n}x{k} [{i}]: {got} vs {sum}"
                    );
                }
                let what = format!("{kind}, {m}x{n}x{k}, scalar");
                every_isa_gives(&scalar, &x, m, &w, &what);
                every_tile_gives(&scalar, &quad_panels(kind, n, k, &bytes), &x, m, &what);
            }
        }
    }
}

#[test]
fn each_instruction_set_runs_its_best_tile_the_cpu_has() {
    for isa in Isa::available() {
        let tile = IntTile::for_isa(isa);
        assert!(
            tile.supported(),
            "{isa} picked {tile}, which this CPU cannot run"
        );
        // The tile a dot-product CPU should run is the one chosen (so the bit checks above
        // cover it).
        let best = match isa {
            Isa::Avx512 => [IntTile::Avx512Vnni, IntTile::AvxVnni, IntTile::Avx2].as_slice(),
            Isa::Avx2 => &[IntTile::AvxVnni, IntTile::Avx2],
            Isa::Neon => &[IntTile::NeonDot],
            Isa::Scalar => &[],
        };
        let want = best.iter().copied().find(|t| t.supported());
        assert_eq!(tile, want.unwrap_or(IntTile::Portable), "{isa}");
    }
}

#[test]
fn a_row_computes_the_same_bits_alone_and_in_any_batch() {
    let (n, k, m) = (50, 256, 23);
    for kind in QuantKind::ALL {
        let (bytes, _) = quantized(kind, n, k, 14);
        let w = quads(kind, n, k, &bytes);
        let x = random(m * k, 15);
        let mut full = vec![0f32; m * n];
        linear_on(crate::backend::cpu::kernels::isa(), &x, m, &w, &mut full);
        for (start, len) in [(0, 1), (5, 1), (3, 3), (7, 16), (22, 1)] {
            let mut part = vec![0f32; len * n];
            let rows = &x[start * k..(start + len) * k];
            linear_on(
                crate::backend::cpu::kernels::isa(),
                rows,
                len,
                &w,
                &mut part,
            );
            assert_eq!(
                part,
                full[start * n..(start + len) * n],
                "{kind} rows {start}..+{len}"
            );
        }
    }
}

#[test]
fn fast_mode_stays_near_exact_mode() {
    let (n, k, m) = (64, 1024, 3);
    for kind in QuantKind::ALL {
        let (bytes, _) = quantized(kind, n, k, 16);
        let exact = Matrix::quantized(QuantPanels::from_ggml(kind, n, k, &bytes).unwrap());
        let fast = quads(kind, n, k, &bytes);
        let x = random(m * k, 17);
        let (mut a, mut b) = (vec![0f32; m * n], vec![0f32; m * n]);
        linear_on(Isa::best(), &x, m, &exact, &mut a);
        linear_on(Isa::best(), &x, m, &fast, &mut b);
        let err: f64 = a
            .iter()
            .zip(&b)
            .map(|(a, b)| f64::from(a - b).powi(2))
            .sum();
        let norm: f64 = a.iter().map(|a| f64::from(*a).powi(2)).sum();
        // 8-bit activations of uniform values: about 0.5 % relative error.
        assert!(
            (err / norm).sqrt() < 0.02,
            "{kind}: relative error {}",
            (err / norm).sqrt()
        );
    }
}

/// GGML blocks whose integers are all at a format's extreme, for one row of `k`.
fn extreme_row(kind: QuantKind, k: usize) -> Vec<u8> {
    let block: Vec<u8> = match kind {
        // q = −128, the one value whose magnitude needs the unsigned operand's full range.
        QuantKind::Q8_0 => [f16::from_f32(0.01).to_le_bytes().to_vec(), vec![0x80; 32]].concat(),
        // Every nibble 15.
        QuantKind::Q4_1 => [
            f16::from_f32(0.01).to_le_bytes().to_vec(),
            f16::from_f32(0.5).to_le_bytes().to_vec(),
            vec![0xFF; 16],
        ]
        .concat(),
        // ql and qh all ones: q = 63 − 32 under the largest scale, 127.
        QuantKind::Q6K => [
            vec![0xFF; 128],
            vec![0xFF; 64],
            vec![127; 16],
            f16::from_f32(0.001).to_le_bytes().to_vec(),
        ]
        .concat(),
        _ => unreachable!("only the formats with the largest pair sums"),
    };
    block.repeat(k / kind.block_elems())
}

#[test]
fn the_largest_integers_do_not_saturate() {
    let k = 512;
    for kind in [QuantKind::Q8_0, QuantKind::Q4_1, QuantKind::Q6K] {
        let bytes = extreme_row(kind, k).repeat(16);
        let w = quad_panels(kind, 16, k, &bytes);
        // Full-scale activations of both signs: every x quantizes to ±127.
        let x: Vec<f32> = (0..2 * k)
            .map(|i| if i % 3 == 0 { -1.0 } else { 1.0 })
            .collect();
        let want = reference(kind, 16, k, &bytes, &x, 2);
        for tile in IntTile::ALL.into_iter().filter(|t| t.supported()) {
            let got = on_tile(tile, &w, &x, 2);
            for (&g, &(sum, magnitude)) in got.iter().zip(&want) {
                assert!(
                    (f64::from(g) - sum).abs() <= 1e-6 * magnitude,
                    "{kind} on the {tile} tile: {g} vs {sum}"
                );
            }
        }
    }
}
