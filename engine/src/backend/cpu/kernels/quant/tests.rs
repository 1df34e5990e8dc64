//! Each format against candle's own quantizer and dequantizer (an independent reading of the
//! GGML blocks), on every instruction set, and through `linear`.

use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng, rngs::StdRng};

use super::*;
use crate::backend::cpu::kernels::matmul::{Matrix, WeightData, linear_on};

pub(super) fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// A random `rows × cols` tensor quantized by candle: its GGML bytes and candle's
/// dequantized values.
pub(super) fn quantized(
    kind: QuantKind,
    rows: usize,
    cols: usize,
    seed: u64,
) -> (Vec<u8>, Vec<f32>) {
    let t = Tensor::from_vec(random(rows * cols, seed), (rows, cols), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&t, kind.to_ggml()).unwrap();
    let bytes = q.data().unwrap().to_vec();
    let values = q
        .dequantize(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    (bytes, values)
}

/// `linear` of `m` rows of `x` by `w` on every instruction set this CPU runs writes exactly
/// `want`'s bits and nothing past them (`what` names the case and what `want` came from).
pub(super) fn every_isa_gives(want: &[f32], x: &[f32], m: usize, w: &Matrix, what: &str) {
    let n = w.rows;
    for isa in Isa::available() {
        let mut got = vec![f32::NAN; m * n + 1];
        linear_on(isa, x, m, w, &mut got);
        assert!(
            got[m * n].is_nan(),
            "{what} on {isa}: wrote past the output"
        );
        let same = got[..m * n]
            .iter()
            .zip(want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{what} on {isa}: differs");
    }
}

#[test]
fn every_format_dequantizes_to_candles_bits() {
    let (rows, cols) = (37, 512);
    for kind in QuantKind::ALL {
        let (bytes, want) = quantized(kind, rows, cols, 1);
        let w = QuantPanels::from_ggml(kind, rows, cols, &bytes).unwrap();
        for r in 0..rows {
            for c in 0..cols {
                let got = w.get(r, c);
                assert_eq!(
                    got.to_bits(),
                    want[r * cols + c].to_bits(),
                    "{kind} ({r}, {c}): {got} vs {}",
                    want[r * cols + c]
                );
            }
        }
        let mut panel = vec![f32::NAN; cols * PANEL];
        for p in 0..rows.div_ceil(PANEL) {
            for isa in Isa::available() {
                dequant_panel(isa, &w, p, &mut panel);
                for i in 0..cols {
                    for lane in 0..PANEL.min(rows - p * PANEL) {
                        let want = want[(p * PANEL + lane) * cols + i];
                        assert_eq!(
                            panel[i * PANEL + lane].to_bits(),
                            want.to_bits(),
                            "{kind} on {isa}: panel {p} input {i} lane {lane}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn a_quantized_matrix_computes_the_bits_of_its_dequantized_copy() {
    // Rows leaving a partial last panel, column groups of 4 + 1 and of 3 panels; batches
    // through the in-register tiles (1-4 rows on AVX-512) and the buffered ones.
    for (n, k) in [(70, 512), (40, 256)] {
        for kind in QuantKind::ALL {
            let (bytes, values) = quantized(kind, n, k, 2);
            let native = Matrix::quantized(QuantPanels::from_ggml(kind, n, k, &bytes).unwrap());
            let dense = Matrix::new(n, k, WeightData::F32(values));
            assert!(native.size_in_bytes() < dense.size_in_bytes() / 3, "{kind}");
            // Every format at its own bits: whole panels take about the file's bytes (only a
            // K format's 6-bit scales and mins widen, to a byte each).
            let whole = QuantPanels::from_ggml(kind, 64, k, &quantized(kind, 64, k, 9).0).unwrap();
            let file = QuantPanels::ggml_size(kind, 64, k).unwrap();
            assert!(
                whole.size_in_bytes() * 100 <= file * 103,
                "{kind}: {} bytes for a file of {file}",
                whole.size_in_bytes()
            );
            for m in [1, 2, 3, 4, 5, 7, 40] {
                let x = random(m * k, 3);
                let mut want = vec![0f32; m * n];
                linear_on(Isa::Scalar, &x, m, &dense, &mut want);
                every_isa_gives(&want, &x, m, &native, &format!("{kind}, {m}x{n}x{k}, f32"));
            }
        }
    }
}

#[test]
fn stacked_parts_of_different_formats_fill_their_own_columns() {
    let k = 256;
    let (q_bytes, q_vals) = quantized(QuantKind::Q4K, 48, k, 4);
    let (v_bytes, v_vals) = quantized(QuantKind::Q6K, 20, k, 5);
    let tail = random(3 * k, 6);
    let stacked = Matrix::stack(vec![
        Matrix::quantized(QuantPanels::from_ggml(QuantKind::Q4K, 48, k, &q_bytes).unwrap()),
        Matrix::quantized(QuantPanels::from_ggml(QuantKind::Q6K, 20, k, &v_bytes).unwrap()),
        Matrix::new(3, k, WeightData::F32(tail.clone())),
    ])
    .unwrap();
    assert_eq!(stacked.rows, 71);
    assert_eq!(stacked.formats(), ["q4_k", "q6_k", "f32"]);
    let dense = Matrix::new(71, k, WeightData::F32([q_vals, v_vals, tail].concat()));
    let x = random(3 * k, 7);
    let (mut got, mut want) = (vec![0f32; 3 * 71], vec![0f32; 3 * 71]);
    for isa in Isa::available() {
        linear_on(isa, &x, 3, &stacked, &mut got);
        linear_on(isa, &x, 3, &dense, &mut want);
        assert_eq!(got, want, "{isa}");
    }
    assert!(
        Matrix::stack(vec![
            dense.clone(),
            Matrix::new(1, 3, WeightData::F32(vec![0.0; 3]))
        ])
        .is_none()
    );
}

#[test]
fn malformed_tensors_are_refused_with_their_shape() {
    assert_eq!(
        QuantPanels::from_ggml(QuantKind::Q4K, 2, 100, &[]).unwrap_err(),
        QuantError::RowLength {
            kind: QuantKind::Q4K,
            cols: 100,
            block: 256
        }
    );
    let err = QuantPanels::from_ggml(QuantKind::Q8_0, 2, 64, &[0; 10]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "q8_0 tensor of 2x64 takes 136 bytes; 10 given"
    );
}

#[test]
fn matrices_gathered_into_one_mapping_compute_the_same_bits() {
    let (n, k, m) = (37, 512, 5);
    let x = random(m * k, 41);
    for arrangement in [Arrangement::InputMajor, Arrangement::Quads] {
        let mut matrices: Vec<Matrix> = QuantKind::ALL
            .iter()
            .enumerate()
            .map(|(i, &kind)| {
                let (bytes, _) = quantized(kind, n, k, 50 + i as u64);
                let q = QuantPanels::from_ggml_in(arrangement, kind, n, k, &bytes).unwrap();
                Matrix::quantized(q)
            })
            .collect();
        let run = |ms: &[Matrix]| -> Vec<Vec<u32>> {
            ms.iter()
                .map(|w| {
                    let mut out = vec![0f32; m * n];
                    linear_on(Isa::Scalar, &x, m, w, &mut out);
                    out.iter().map(|v| v.to_bits()).collect()
                })
                .collect()
        };
        let before = run(&matrices);
        let mut panels: Vec<&mut QuantPanels> = matrices
            .iter_mut()
            .flat_map(Matrix::quant_parts_mut)
            .collect();
        assert!(gather_panels(&mut panels).unwrap() > 0);
        assert_eq!(run(&matrices), before, "{arrangement:?}");
    }
}
