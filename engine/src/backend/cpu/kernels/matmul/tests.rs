//! `linear`'s tests: packing, odd shapes and every dtype against a naive product, batch
//! invariance, the same bits on every instruction set, and tiles split to fit the registers.

use super::*;
use rand::{Rng, SeedableRng, rngs::StdRng};

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// `w` in each dense storage.
fn every_dtype(w: &[f32]) -> [WeightData; 3] {
    [
        WeightData::F32(w.to_vec()),
        WeightData::F16(w.iter().map(|&v| f16::from_f32(v)).collect()),
        WeightData::Bf16(w.iter().map(|&v| bf16::from_f32(v)).collect()),
    ]
}

fn naive(x: &[f32], m: usize, w: &Matrix) -> Vec<f32> {
    let mut out = vec![0f32; m * w.rows];
    for i in 0..m {
        for j in 0..w.rows {
            let mut s = 0f64;
            for p in 0..w.cols {
                s += f64::from(x[i * w.cols + p]) * f64::from(w.get(j, p));
            }
            out[i * w.rows + j] = s as f32;
        }
    }
    out
}

#[test]
fn packing_keeps_every_element() {
    let vals = random(37 * 5, 9);
    let w = Matrix::new(37, 5, WeightData::F32(vals.clone()));
    for r in 0..37 {
        for c in 0..5 {
            assert_eq!(w.get(r, c), vals[r * 5 + c]);
        }
    }
    let mut row = vec![0f32; 5];
    w.row_into(20, &mut row);
    assert_eq!(row, vals[100..105]);
}

#[test]
fn matches_naive_for_odd_shapes_and_all_dtypes() {
    for &(m, n, k) in &[
        (1, 1, 1),
        (3, 5, 7),
        (5, 19, 33),
        (70, 37, 100),
        (1, 64, 576),
        (9, 130, 17),
        (13, 200, 64),
        // Several column groups per task and several row tiles: the prefetching path.
        (20, 1100, 40),
    ] {
        let x = random(m * k, 1);
        let wf = random(n * k, 2);
        for data in every_dtype(&wf) {
            let w = Matrix::new(n, k, data);
            let mut out = vec![f32::NAN; m * n + 3];
            linear(&x, m, &w, &mut out);
            let want = naive(&x, m, &w);
            for (a, b) in out.iter().zip(&want) {
                assert!(
                    (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                    "{m}x{n}x{k}: {a} vs {b}"
                );
            }
            assert!(
                out[m * n..].iter().all(|v| v.is_nan()),
                "wrote past the output"
            );
        }
    }
}

#[test]
fn rows_are_bit_identical_whatever_the_batch() {
    let (n, k) = (203, 300);
    let w = Matrix::new(n, k, WeightData::F32(random(n * k, 3)));
    let x = random(130 * k, 4);
    let mut full = vec![0f32; 130 * n];
    linear(&x, 130, &w, &mut full);
    for (start, len) in [(0, 1), (7, 1), (5, 3), (64, 2), (60, 70), (129, 1)] {
        let mut part = vec![0f32; len * n];
        linear(&x[start * k..(start + len) * k], len, &w, &mut part);
        assert_eq!(
            part,
            full[start * n..(start + len) * n],
            "rows {start}..+{len}"
        );
    }
}

#[test]
fn every_instruction_set_gives_the_same_bits() {
    // Shapes that reach every tile shape of every set: 1-6 rows, 1-4 panels, partial
    // last panels, several row blocks.
    for &(m, n, k) in &[
        (1, 64, 96),
        (2, 40, 45),
        (3, 17, 8),
        (6, 203, 70),
        (100, 130, 33),
    ] {
        let x = random(m * k, 5);
        let wf = random(n * k, 6);
        for data in every_dtype(&wf) {
            let w = Matrix::new(n, k, data);
            let mut scalar = vec![0f32; m * n];
            linear_on(Isa::Scalar, &x, m, &w, &mut scalar);
            for isa in Isa::available() {
                let mut out = vec![f32::NAN; m * n];
                linear_on(isa, &x, m, &w, &mut out);
                let same = out
                    .iter()
                    .zip(&scalar)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{isa} differs from scalar at {m}x{n}x{k}");
            }
        }
    }
}

#[test]
fn tiles_are_split_to_fit_the_registers() {
    assert_eq!(panels_per_call(Isa::Avx512, 6), NP);
    for isa in [Isa::Avx2, Isa::Neon] {
        assert_eq!(panels_per_call(isa, 1), NP);
        assert_eq!(panels_per_call(isa, 2), 2);
        assert_eq!(panels_per_call(isa, 6), 1);
    }
}
