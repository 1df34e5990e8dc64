//! `linear`: `out[m×n] = x[m×k] · Wᵀ` with W stored row-major as `n×k` (the layout of every
//! Llama projection), f32 activations and f32/f16/bf16 weights.
//!
//! Batch invariance is the point: each output element is one accumulator vector running over
//! k in a fixed order, then one horizontal sum, in every tile shape. Tiles of up to 4 rows of
//! x by 4 rows of W share loads; columns are split across threads (never k), so threading
//! does not change the order of a sum either.

use half::{bf16, f16};

use super::{Isa, SharedMut, isa};

/// Weight storage of one matrix.
#[derive(Debug, Clone)]
pub enum WeightData {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
}

impl WeightData {
    pub fn len(&self) -> usize {
        match self {
            WeightData::F32(v) => v.len(),
            WeightData::F16(v) => v.len(),
            WeightData::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn size_in_bytes(&self) -> usize {
        match self {
            WeightData::F32(v) => v.len() * 4,
            WeightData::F16(v) => v.len() * 2,
            WeightData::Bf16(v) => v.len() * 2,
        }
    }

    /// Element `i` widened to f32.
    pub fn get(&self, i: usize) -> f32 {
        match self {
            WeightData::F32(v) => v[i],
            WeightData::F16(v) => v[i].to_f32(),
            WeightData::Bf16(v) => v[i].to_f32(),
        }
    }

    /// Copies row `r` (of `cols` elements) into `out` as f32.
    pub fn row_into(&self, r: usize, cols: usize, out: &mut [f32]) {
        let range = r * cols..(r + 1) * cols;
        match self {
            WeightData::F32(v) => out.copy_from_slice(&v[range]),
            WeightData::F16(v) => {
                half::slice::HalfFloatSliceExt::convert_to_f32_slice(&v[range], out)
            }
            WeightData::Bf16(v) => {
                half::slice::HalfFloatSliceExt::convert_to_f32_slice(&v[range], out)
            }
        }
    }
}

/// A weight matrix of `rows` output features by `cols` input features.
#[derive(Debug, Clone)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: WeightData,
}

impl Matrix {
    pub fn new(rows: usize, cols: usize, data: WeightData) -> Self {
        debug_assert_eq!(rows * cols, data.len());
        Self { rows, cols, data }
    }

    /// Stacks matrices with the same `cols` on top of each other (fused QKV, gate/up).
    pub fn concat_rows(parts: &[Matrix]) -> Matrix {
        let cols = parts[0].cols;
        let rows = parts.iter().map(|p| p.rows).sum();
        let data = match &parts[0].data {
            WeightData::F32(_) => WeightData::F32(
                parts
                    .iter()
                    .flat_map(|p| match &p.data {
                        WeightData::F32(v) => v.clone(),
                        other => (0..other.len()).map(|i| other.get(i)).collect(),
                    })
                    .collect(),
            ),
            WeightData::F16(_) => WeightData::F16(
                parts
                    .iter()
                    .flat_map(|p| (0..p.data.len()).map(|i| f16::from_f32(p.data.get(i))))
                    .collect(),
            ),
            WeightData::Bf16(_) => WeightData::Bf16(
                parts
                    .iter()
                    .flat_map(|p| (0..p.data.len()).map(|i| bf16::from_f32(p.data.get(i))))
                    .collect(),
            ),
        };
        Matrix { rows, cols, data }
    }
}

/// Rows of x per cache block: a block of x stays in L2 while W streams past it.
const ROW_BLOCK: usize = 64;
const MR: usize = 4;
const NR: usize = 4;

/// `out[m×w.rows] = x[m×w.cols] · Wᵀ`, batch-invariant (see the module docs).
pub fn linear(x: &[f32], m: usize, w: &Matrix, out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    assert!(
        x.len() >= m * k && out.len() >= m * n,
        "linear: buffer sizes"
    );
    if m == 0 || n == 0 {
        return;
    }
    let threads = super::team::threads();
    // Enough tasks to balance, each a multiple of NR columns and at least 16 of them.
    let per_task = (n.div_ceil(threads * 4)).next_multiple_of(NR).max(16);
    let tasks = n.div_ceil(per_task);
    let out_ptr = SharedMut(out.as_mut_ptr());
    let isa = isa();
    let run = |t: usize| {
        let j0 = t * per_task;
        let j1 = (j0 + per_task).min(n);
        // SAFETY: tasks own disjoint column ranges [j0, j1) of `out`; all pointer offsets stay
        // within the bounds asserted above.
        unsafe { column_block(isa, x, m, k, &w.data, j0, j1, out_ptr, n) }
    };
    super::team::parallel_for(tasks, &run);
}

#[allow(clippy::too_many_arguments)]
unsafe fn column_block(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    w: &WeightData,
    j0: usize,
    j1: usize,
    out: SharedMut,
    ldo: usize,
) {
    let mut i0 = 0;
    while i0 < m {
        let i1 = (i0 + ROW_BLOCK).min(m);
        let mut j = j0;
        while j < j1 {
            let nr = (j1 - j).min(NR);
            let mut i = i0;
            while i < i1 {
                let mr = (i1 - i).min(MR);
                let xp = unsafe { x.as_ptr().add(i * k) };
                let op = unsafe { out.0.add(i * ldo + j) };
                unsafe {
                    match w {
                        WeightData::F32(v) => {
                            tile_f32(isa, mr, nr, xp, k, v.as_ptr().add(j * k), op, ldo)
                        }
                        WeightData::F16(v) => {
                            tile_f16(isa, mr, nr, xp, k, v.as_ptr().add(j * k), op, ldo)
                        }
                        WeightData::Bf16(v) => {
                            tile_bf16(isa, mr, nr, xp, k, v.as_ptr().add(j * k), op, ldo)
                        }
                    }
                }
                i += mr;
            }
            j += nr;
        }
        i0 = i1;
    }
}

/// Scalar widening used by the k tails and the scalar kernels.
trait Widen: Copy {
    fn widen(self) -> f32;
}
impl Widen for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}
impl Widen for f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}
impl Widen for bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

/// The portable kernel: 8 partial sums per element over k, then a fixed-order reduction.
unsafe fn tile_scalar<W: Widen, const R: usize, const C: usize>(
    x: *const f32,
    k: usize,
    w: *const W,
    out: *mut f32,
    ldo: usize,
) {
    for i in 0..R {
        for j in 0..C {
            let mut acc = [0f32; 8];
            for p in 0..k {
                let xv = unsafe { *x.add(i * k + p) };
                let wv = unsafe { (*w.add(j * k + p)).widen() };
                acc[p % 8] = xv.mul_add(wv, acc[p % 8]);
            }
            let s =
                ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
            unsafe { *out.add(i * ldo + j) = s };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Widen;
    use std::arch::x86_64::*;

    macro_rules! load16 {
        (f32, $p:expr) => {
            _mm512_loadu_ps($p as *const f32)
        };
        (f16, $p:expr) => {
            _mm512_cvtph_ps(_mm256_loadu_si256($p as *const __m256i))
        };
        (bf16, $p:expr) => {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256($p as *const __m256i),
            )))
        };
    }

    macro_rules! load8 {
        (f32, $p:expr) => {
            _mm256_loadu_ps($p as *const f32)
        };
        (f16, $p:expr) => {
            _mm256_cvtph_ps(_mm_loadu_si128($p as *const __m128i))
        };
        (bf16, $p:expr) => {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                _mm_loadu_si128($p as *const __m128i),
            )))
        };
    }

    macro_rules! tiles {
        ($avx512:ident, $avx2:ident, $ty:ty, $kind:tt) => {
            /// AVX-512 tile: R×C accumulators of 16 lanes.
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
            pub(super) unsafe fn $avx512<const R: usize, const C: usize>(
                x: *const f32,
                k: usize,
                w: *const $ty,
                out: *mut f32,
                ldo: usize,
            ) {
                let mut acc = [[_mm512_setzero_ps(); C]; R];
                let full = k / 16 * 16;
                let mut p = 0;
                while p < full {
                    let mut wv = [_mm512_setzero_ps(); C];
                    for j in 0..C {
                        wv[j] = unsafe { load16!($kind, w.add(j * k + p)) };
                        // The next tile's rows follow these in memory: fetch them while this
                        // tile computes, so small batches stream weights at full bandwidth.
                        _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add((C + j) * k + p) as *const i8);
                    }
                    for i in 0..R {
                        let xv = unsafe { _mm512_loadu_ps(x.add(i * k + p)) };
                        for j in 0..C {
                            acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
                        }
                    }
                    p += 16;
                }
                if p < k {
                    // The tail goes through zero-padded copies: 0·0 adds nothing, and every
                    // element of every tile takes this same path for a given k.
                    let mut wt = [[0f32; 16]; C];
                    for j in 0..C {
                        for q in p..k {
                            wt[j][q - p] = unsafe { (*w.add(j * k + q)).widen() };
                        }
                    }
                    for i in 0..R {
                        let mut xt = [0f32; 16];
                        for q in p..k {
                            xt[q - p] = unsafe { *x.add(i * k + q) };
                        }
                        let xv = unsafe { _mm512_loadu_ps(xt.as_ptr()) };
                        for j in 0..C {
                            let wv = unsafe { _mm512_loadu_ps(wt[j].as_ptr()) };
                            acc[i][j] = _mm512_fmadd_ps(xv, wv, acc[i][j]);
                        }
                    }
                }
                for i in 0..R {
                    for j in 0..C {
                        unsafe { *out.add(i * ldo + j) = _mm512_reduce_add_ps(acc[i][j]) };
                    }
                }
            }

            /// AVX2 tile: R×C accumulators of 8 lanes.
            #[target_feature(enable = "avx2,f16c,fma")]
            pub(super) unsafe fn $avx2<const R: usize, const C: usize>(
                x: *const f32,
                k: usize,
                w: *const $ty,
                out: *mut f32,
                ldo: usize,
            ) {
                let mut acc = [[_mm256_setzero_ps(); C]; R];
                let full = k / 8 * 8;
                let mut p = 0;
                while p < full {
                    let mut wv = [_mm256_setzero_ps(); C];
                    for j in 0..C {
                        wv[j] = unsafe { load8!($kind, w.add(j * k + p)) };
                        _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add((C + j) * k + p) as *const i8);
                    }
                    for i in 0..R {
                        let xv = unsafe { _mm256_loadu_ps(x.add(i * k + p)) };
                        for j in 0..C {
                            acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
                        }
                    }
                    p += 8;
                }
                if p < k {
                    let mut wt = [[0f32; 8]; C];
                    for j in 0..C {
                        for q in p..k {
                            wt[j][q - p] = unsafe { (*w.add(j * k + q)).widen() };
                        }
                    }
                    for i in 0..R {
                        let mut xt = [0f32; 8];
                        for q in p..k {
                            xt[q - p] = unsafe { *x.add(i * k + q) };
                        }
                        let xv = unsafe { _mm256_loadu_ps(xt.as_ptr()) };
                        for j in 0..C {
                            let wv = unsafe { _mm256_loadu_ps(wt[j].as_ptr()) };
                            acc[i][j] = _mm256_fmadd_ps(xv, wv, acc[i][j]);
                        }
                    }
                }
                for i in 0..R {
                    for j in 0..C {
                        let v = acc[i][j];
                        let hi = _mm256_extractf128_ps::<1>(v);
                        let s4 = _mm_add_ps(_mm256_castps256_ps128(v), hi);
                        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
                        let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
                        unsafe { *out.add(i * ldo + j) = _mm_cvtss_f32(s1) };
                    }
                }
            }
        };
    }

    tiles!(tile_avx512_f32, tile_avx2_f32, f32, f32);
    tiles!(tile_avx512_f16, tile_avx2_f16, half::f16, f16);
    tiles!(tile_avx512_bf16, tile_avx2_bf16, half::bf16, bf16);
}

/// Dispatches one tile of `mr`×`nr` (each 1..=4) to the kernel of the detected ISA.
macro_rules! dispatch_tile {
    ($fn_name:ident, $ty:ty, $avx512:ident, $avx2:ident) => {
        #[allow(clippy::too_many_arguments)]
        unsafe fn $fn_name(
            isa: Isa,
            mr: usize,
            nr: usize,
            x: *const f32,
            k: usize,
            w: *const $ty,
            out: *mut f32,
            ldo: usize,
        ) {
            macro_rules! call {
                ($r:literal, $c:literal) => {
                    match isa {
                        #[cfg(target_arch = "x86_64")]
                        Isa::Avx512 => unsafe { x86::$avx512::<$r, $c>(x, k, w, out, ldo) },
                        #[cfg(target_arch = "x86_64")]
                        Isa::Avx2 => unsafe { x86::$avx2::<$r, $c>(x, k, w, out, ldo) },
                        _ => unsafe { tile_scalar::<$ty, $r, $c>(x, k, w, out, ldo) },
                    }
                };
            }
            match (mr, nr) {
                (4, 4) => call!(4, 4),
                (4, 3) => call!(4, 3),
                (4, 2) => call!(4, 2),
                (4, 1) => call!(4, 1),
                (3, 4) => call!(3, 4),
                (3, 3) => call!(3, 3),
                (3, 2) => call!(3, 2),
                (3, 1) => call!(3, 1),
                (2, 4) => call!(2, 4),
                (2, 3) => call!(2, 3),
                (2, 2) => call!(2, 2),
                (2, 1) => call!(2, 1),
                (1, 4) => call!(1, 4),
                (1, 3) => call!(1, 3),
                (1, 2) => call!(1, 2),
                _ => call!(1, 1),
            }
        }
    };
}

dispatch_tile!(tile_f32, f32, tile_avx512_f32, tile_avx2_f32);
dispatch_tile!(tile_f16, f16, tile_avx512_f16, tile_avx2_f16);
dispatch_tile!(tile_bf16, bf16, tile_avx512_bf16, tile_avx2_bf16);

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng, rngs::StdRng};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    fn naive(x: &[f32], m: usize, w: &Matrix) -> Vec<f32> {
        let mut out = vec![0f32; m * w.rows];
        for i in 0..m {
            for j in 0..w.rows {
                let mut s = 0f64;
                for p in 0..w.cols {
                    s += f64::from(x[i * w.cols + p]) * f64::from(w.data.get(j * w.cols + p));
                }
                out[i * w.rows + j] = s as f32;
            }
        }
        out
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
        ] {
            let x = random(m * k, 1);
            let wf = random(n * k, 2);
            for data in [
                WeightData::F32(wf.clone()),
                WeightData::F16(wf.iter().map(|&v| f16::from_f32(v)).collect()),
                WeightData::Bf16(wf.iter().map(|&v| bf16::from_f32(v)).collect()),
            ] {
                let w = Matrix::new(n, k, data);
                let mut out = vec![0f32; m * n];
                linear(&x, m, &w, &mut out);
                let want = naive(&x, m, &w);
                for (a, b) in out.iter().zip(&want) {
                    assert!(
                        (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                        "{m}x{n}x{k}: {a} vs {b}"
                    );
                }
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
    fn scalar_kernel_agrees() {
        let (m, n, k) = (3, 6, 45);
        let x = random(m * k, 5);
        let w = Matrix::new(n, k, WeightData::F32(random(n * k, 6)));
        let mut out = vec![0f32; m * n];
        let WeightData::F32(wd) = &w.data else {
            unreachable!()
        };
        for i in 0..m {
            for j in 0..n {
                unsafe {
                    tile_scalar::<f32, 1, 1>(
                        x.as_ptr().add(i * k),
                        k,
                        wd.as_ptr().add(j * k),
                        out.as_mut_ptr().add(i * n + j),
                        n,
                    )
                };
            }
        }
        let want = naive(&x, m, &w);
        for (a, b) in out.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()));
        }
    }
}
