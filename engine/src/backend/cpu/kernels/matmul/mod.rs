//! `linear`: `out[m×n] = x[m×k] · Wᵀ` for a weight matrix W of `n` output features by `k`
//! input features (every Llama projection), f32 activations, f32/f16/bf16 weights or GGML
//! formats (`quant`: in `exact` mode through the same f32 tiles, in `fast` mode as integer
//! dot products over the activations quantized once per call).
//!
//! W is repacked at load into panels of 16 output features: panel `p` holds, for every input
//! feature `i`, the 16 weights `W[16p..16p+16][i]` side by side (zero-padded past `n`). The
//! kernel then broadcasts one activation and multiplies it into 16 outputs at once, the
//! classic BLIS micro-kernel shape, with no horizontal sums.
//!
//! Batch invariance is the point: every output element is one accumulator lane that runs
//! over `i = 0..k` in order with fused multiply-adds, on every tile shape and on the scalar
//! path. Tiles differ only in how many rows and panels share the loads; columns are split
//! across threads, never `k`. So a row's result never depends on the batch around it.

use half::{bf16, f16};

use super::quant::{Arrangement, QuantPanels, QuantizedActs, dequant_panel};
use super::quant::{IntOut, IntTile, int_block};
use super::{Isa, SharedMut, isa};
use tile::{PREFETCH_LINE, Tile};

pub use tile::PANEL;

mod tile;

/// Rows of x per micro-tile.
const MR: usize = 6;
/// Panels per micro-tile (64 outputs).
const NP: usize = 4;
/// Rows of x per cache block.
const ROW_BLOCK: usize = 96;

/// Weight storage in panel order (see the module docs).
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

    fn zeros_like(&self, n: usize) -> WeightData {
        match self {
            WeightData::F32(_) => WeightData::F32(vec![0.0; n]),
            WeightData::F16(_) => WeightData::F16(vec![f16::ZERO; n]),
            WeightData::Bf16(_) => WeightData::Bf16(vec![bf16::ZERO; n]),
        }
    }

    fn copy_from(&mut self, dst: usize, src: &WeightData, i: usize) {
        match (self, src) {
            (WeightData::F32(d), WeightData::F32(s)) => d[dst] = s[i],
            (WeightData::F16(d), WeightData::F16(s)) => d[dst] = s[i],
            (WeightData::Bf16(d), WeightData::Bf16(s)) => d[dst] = s[i],
            (WeightData::F32(d), s) => d[dst] = s.get(i),
            (WeightData::F16(d), s) => d[dst] = f16::from_f32(s.get(i)),
            (WeightData::Bf16(d), s) => d[dst] = bf16::from_f32(s.get(i)),
        }
    }
}

/// A weight matrix of `rows` output features by `cols` input features, stored in panels.
///
/// Usually one block of storage; a fused projection whose parts came in different formats
/// (a GGUF's Q4_K query rows and Q6_K value rows) keeps one block per part, stacked by rows.
#[derive(Debug, Clone)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    parts: Vec<Part>,
}

/// Rows `first_row..first_row + rows` of a matrix, in one storage format.
#[derive(Debug, Clone)]
struct Part {
    first_row: usize,
    rows: usize,
    storage: Storage,
}

#[derive(Debug, Clone)]
enum Storage {
    Dense(WeightData),
    Quant(QuantPanels),
}

impl Matrix {
    /// Packs a row-major `rows × cols` matrix into panels.
    pub fn new(rows: usize, cols: usize, row_major: WeightData) -> Self {
        assert_eq!(
            row_major.len(),
            rows * cols,
            "matrix data does not match its shape"
        );
        let panels = rows.div_ceil(PANEL);
        let mut data = row_major.zeros_like(panels * PANEL * cols);
        for r in 0..rows {
            let (p, lane) = (r / PANEL, r % PANEL);
            for c in 0..cols {
                data.copy_from((p * cols + c) * PANEL + lane, &row_major, r * cols + c);
            }
        }
        Self::single(rows, cols, Storage::Dense(data))
    }

    /// A matrix kept in its GGML format.
    pub fn quantized(q: QuantPanels) -> Self {
        Self::single(q.rows(), q.cols(), Storage::Quant(q))
    }

    fn single(rows: usize, cols: usize, storage: Storage) -> Self {
        Self {
            rows,
            cols,
            parts: vec![Part {
                first_row: 0,
                rows,
                storage,
            }],
        }
    }

    /// The quantized parts' panels, to move their bytes (`quant::arena`).
    pub(crate) fn quant_parts_mut(&mut self) -> impl Iterator<Item = &mut QuantPanels> {
        self.parts.iter_mut().filter_map(|p| match &mut p.storage {
            Storage::Quant(q) => Some(q),
            Storage::Dense(_) => None,
        })
    }

    /// Stacks matrices of the same width by rows (`None` if the widths differ).
    pub fn stack(matrices: Vec<Matrix>) -> Option<Matrix> {
        let cols = matrices.first()?.cols;
        let mut parts = Vec::new();
        let mut rows = 0;
        for m in matrices {
            if m.cols != cols {
                return None;
            }
            for mut part in m.parts {
                part.first_row += rows;
                parts.push(part);
            }
            rows += m.rows;
        }
        Some(Matrix { rows, cols, parts })
    }

    /// Element `(r, c)` widened (or dequantized) to f32.
    pub fn get(&self, r: usize, c: usize) -> f32 {
        let part = self
            .parts
            .iter()
            .find(|p| r < p.first_row + p.rows)
            .unwrap_or_else(|| panic!("row {r} of a {}-row matrix", self.rows));
        let r = r - part.first_row;
        match &part.storage {
            Storage::Dense(data) => data.get(((r / PANEL) * self.cols + c) * PANEL + r % PANEL),
            Storage::Quant(q) => q.get(r, c),
        }
    }

    /// Copies row `r` into `out` as f32 (embedding lookups).
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        for (c, o) in out.iter_mut().enumerate().take(self.cols) {
            *o = self.get(r, c);
        }
    }

    /// Bytes of storage (padding included).
    pub fn size_in_bytes(&self) -> usize {
        self.parts
            .iter()
            .map(|p| match &p.storage {
                Storage::Dense(d) => d.size_in_bytes(),
                Storage::Quant(q) => q.size_in_bytes(),
            })
            .sum()
    }

    /// The same values widened to f32 in one dense block (what a quantized matrix computes
    /// as: see `quant`).
    pub fn to_f32(&self) -> Matrix {
        let values = (0..self.rows)
            .flat_map(|r| (0..self.cols).map(move |c| (r, c)))
            .map(|(r, c)| self.get(r, c))
            .collect();
        Matrix::new(self.rows, self.cols, WeightData::F32(values))
    }

    /// How the quantized parts' integers are arranged (`None` when no part is quantized).
    pub fn arrangement(&self) -> Option<Arrangement> {
        self.parts.iter().find_map(|p| match &p.storage {
            Storage::Quant(q) => Some(q.arrangement()),
            Storage::Dense(_) => None,
        })
    }

    /// The storage formats of the parts, top to bottom (`f32`, `q4_k`, ...).
    pub fn formats(&self) -> Vec<&'static str> {
        self.parts
            .iter()
            .map(|p| match &p.storage {
                Storage::Dense(WeightData::F32(_)) => "f32",
                Storage::Dense(WeightData::F16(_)) => "f16",
                Storage::Dense(WeightData::Bf16(_)) => "bf16",
                Storage::Quant(q) => q.kind().name(),
            })
            .collect()
    }
}

/// `out[m×w.rows] = x[m×w.cols] · Wᵀ`, batch-invariant (see the module docs), on the
/// process's instruction set.
pub fn linear(x: &[f32], m: usize, w: &Matrix, out: &mut [f32]) {
    linear_on(isa(), x, m, w, out)
}

/// [`linear`] on a given instruction set, which must be one this CPU runs
/// ([`Isa::supported`]); every set gives the same bits.
///
/// # Panics
/// If the buffers are shorter than the shapes say, or the CPU cannot run `isa`.
pub fn linear_on(isa: Isa, x: &[f32], m: usize, w: &Matrix, out: &mut [f32]) {
    assert!(
        isa.supported(),
        "linear: this CPU cannot run the {isa} kernels"
    );
    let (n, k) = (w.rows, w.cols);
    assert!(
        x.len() >= m * k && out.len() >= m * n,
        "linear: buffer sizes"
    );
    if m == 0 || n == 0 {
        return;
    }
    let integer = w
        .parts
        .iter()
        .any(|p| matches!(&p.storage, Storage::Quant(q) if q.arrangement() == Arrangement::Quads));
    ACTIVATIONS.with_borrow_mut(|acts| {
        if integer {
            acts.quantize(x, m, k);
        }
        for part in &w.parts {
            let cols = Columns {
                first: part.first_row,
                count: part.rows,
                ldo: n,
            };
            linear_part(isa, x, m, k, &part.storage, cols, out, acts);
        }
    });
}

thread_local! {
    /// The activations of the current call quantized for the integer tiles (`fast` mode).
    static ACTIVATIONS: std::cell::RefCell<QuantizedActs> =
        std::cell::RefCell::new(QuantizedActs::default());
}

/// The output columns one part writes: `first..first + count` of rows `ldo` apart.
#[derive(Clone, Copy)]
struct Columns {
    first: usize,
    count: usize,
    ldo: usize,
}

#[allow(clippy::too_many_arguments)]
fn linear_part(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    storage: &Storage,
    cols: Columns,
    out: &mut [f32],
    acts: &QuantizedActs,
) {
    let panels = cols.count.div_ceil(PANEL);
    let threads = super::team::threads();
    let per_task = match storage {
        // A decode step's few rows through the integer tiles stream each weight once: one
        // run of panels a thread keeps every stream long (a task's first weights miss the
        // prefetchers), 1.5-4 % faster at 1-4 rows than four tasks a thread on Zen 4.
        Storage::Quant(w) if m <= 4 && w.arrangement() == Arrangement::Quads => {
            panels.div_ceil(threads)
        }
        // Enough tasks to balance, each a whole number of micro-tile column groups.
        _ => panels.div_ceil(threads * 4).next_multiple_of(NP).max(NP),
    };
    let tasks = panels.div_ceil(per_task);
    let tile = IntTile::for_isa(isa);
    // SAFETY: `first` lies inside every output row (parts stack inside the matrix's rows).
    let out_ptr = SharedMut(unsafe { out.as_mut_ptr().add(cols.first) });
    let run = |t: usize| {
        let p0 = t * per_task;
        let p1 = (p0 + per_task).min(panels);
        // SAFETY: tasks own disjoint panel ranges, i.e. disjoint output columns; every
        // offset stays inside the buffers checked by `linear_on` and the packed weights.
        unsafe {
            match storage {
                Storage::Dense(w) => panel_block(isa, x, m, k, cols, w, p0, p1, out_ptr),
                Storage::Quant(w) if w.arrangement() == Arrangement::Quads => {
                    let to = IntOut {
                        out: out_ptr,
                        ldo: cols.ldo,
                        count: cols.count,
                    };
                    int_block(tile, acts, w, p0, p1, to)
                }
                Storage::Quant(w) => quant_block(isa, x, m, k, cols, w, p0, p1, out_ptr),
            }
        }
    };
    super::team::parallel_for(tasks, &run);
}

/// Rows up to which AVX-512 dequantizes in registers rather than into the buffer.
#[cfg(target_arch = "x86_64")]
const FUSED_ROWS: usize = 4;

thread_local! {
    /// Dequantized panels of the column group a thread is working on.
    static DEQUANTIZED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Panels `p0..p1` of a quantized part: each column group is dequantized once into the
/// thread's buffer, then every row of x runs over it on the f32 tiles (the same tiles, so
/// the same bits, as the dequantized matrix would give).
#[allow(clippy::too_many_arguments)]
unsafe fn quant_block(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    cols: Columns,
    w: &QuantPanels,
    p0: usize,
    p1: usize,
    out: SharedMut,
) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && m <= FUSED_ROWS {
        let mut p = p0;
        while p < p1 {
            let np = (p1 - p).min(NP);
            let tile = super::quant::fused::RowTile {
                x: x.as_ptr(),
                k,
                out: unsafe { out.0.add(p * PANEL) },
                ldo: cols.ldo,
                cols: (cols.count - p * PANEL).min(np * PANEL),
            };
            // SAFETY: AVX-512 was checked against the CPU; the tile's rows and columns lie
            // inside x and the part's output columns, its panels inside the matrix.
            unsafe { super::quant::fused::rows_avx512(w, p, np, m, tile) };
            p += np;
        }
        return;
    }
    DEQUANTIZED.with_borrow_mut(|buf| {
        if buf.len() < NP * k * PANEL {
            buf.resize(NP * k * PANEL, 0.0);
        }
        let mut p = p0;
        while p < p1 {
            // Whole column groups: a one-row tile needs its four panels' accumulator chains
            // to keep the FMA units busy.
            let np = (p1 - p).min(NP);
            for c in 0..np {
                dequant_panel(isa, w, p + c, &mut buf[c * k * PANEL..(c + 1) * k * PANEL]);
            }
            let mut i = 0;
            while i < m {
                let mr = (m - i).min(MR);
                let tile = Tile {
                    x: unsafe { x.as_ptr().add(i * k) },
                    k,
                    out: unsafe { out.0.add(i * cols.ldo + p * PANEL) },
                    ldo: cols.ldo,
                    cols: (cols.count - p * PANEL).min(np * PANEL),
                    prefetch: std::ptr::null(),
                };
                // SAFETY: the buffer holds `np` dequantized panels of `k` inputs; the tile's
                // rows and columns lie inside x and the part's output columns.
                unsafe { tile_f32(isa, mr, np, tile, buf.as_ptr()) };
                i += mr;
            }
            p += np;
        }
    });
}

#[allow(clippy::too_many_arguments)]
unsafe fn panel_block(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    cols: Columns,
    w: &WeightData,
    p0: usize,
    p1: usize,
    out: SharedMut,
) {
    let n = cols.count;
    let (w_base, w_size) = match w {
        WeightData::F32(v) => (v.as_ptr() as *const u8, 4),
        WeightData::F16(v) => (v.as_ptr() as *const u8, 2),
        WeightData::Bf16(v) => (v.as_ptr() as *const u8, 2),
    };
    let mut i0 = 0;
    while i0 < m {
        let i1 = (i0 + ROW_BLOCK).min(m);
        let mut p = p0;
        while p < p1 {
            let np = (p1 - p).min(NP);
            // The first row tile of a column group streams its weights from memory; the later
            // ones find them in L2. While those compute, each fetches one `k × 64`-byte slice of
            // the next group into L2, so the next first tile does not wait on memory (decode at
            // batch 8-64 is otherwise memory time plus compute time, not the larger of the two).
            let next_group = (p + np < p1).then(|| {
                let next_np = (p1 - p - np).min(NP);
                let start = (p + np) * k * PANEL * w_size;
                (start, next_np * k * PANEL * w_size)
            });
            let mut i = i0;
            let mut tile_index = 0usize;
            while i < i1 {
                let mr = (i1 - i).min(MR);
                let prefetch = match next_group {
                    Some((start, len)) if tile_index > 0 => {
                        let offset = (tile_index - 1) * k * PREFETCH_LINE;
                        if offset < len {
                            // SAFETY: inside the packed weights (offset < the group's length).
                            unsafe { w_base.add(start + offset) }
                        } else {
                            std::ptr::null()
                        }
                    }
                    _ => std::ptr::null(),
                };
                let tile = Tile {
                    x: unsafe { x.as_ptr().add(i * k) },
                    k,
                    out: unsafe { out.0.add(i * cols.ldo + p * PANEL) },
                    ldo: cols.ldo,
                    // Output columns this tile may write (the last panel can be partial).
                    cols: (n - p * PANEL).min(np * PANEL),
                    prefetch,
                };
                unsafe {
                    match w {
                        WeightData::F32(v) => {
                            tile_f32(isa, mr, np, tile, v.as_ptr().add(p * k * PANEL))
                        }
                        WeightData::F16(v) => {
                            tile_f16(isa, mr, np, tile, v.as_ptr().add(p * k * PANEL))
                        }
                        WeightData::Bf16(v) => {
                            tile_bf16(isa, mr, np, tile, v.as_ptr().add(p * k * PANEL))
                        }
                    }
                }
                i += mr;
                tile_index += 1;
            }
            p += np;
        }
        i0 = i1;
    }
}

/// Scalar widening for the portable kernel.
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

/// The portable kernel: the same per-element order (one fused multiply-add per input
/// feature, in order), with the input loop outermost so each weight row is read in sequence.
unsafe fn tile_scalar<W: Widen>(mr: usize, np: usize, t: Tile, w: *const W) {
    let cols = t.cols.min(np * PANEL);
    let mut acc = [[0f32; NP * PANEL]; MR];
    for i in 0..t.k {
        for (r, row) in acc.iter_mut().enumerate().take(mr) {
            // SAFETY: the tile's rows of x hold `k` floats each.
            let xv = unsafe { *t.x.add(r * t.k + i) };
            for (c, a) in row.iter_mut().enumerate().take(cols) {
                // SAFETY: panel c / 16 of the tile holds `k` rows of 16 weights.
                let wv =
                    unsafe { (*w.add((c / PANEL) * t.k * PANEL + i * PANEL + c % PANEL)).widen() };
                *a = xv.mul_add(wv, *a);
            }
        }
    }
    for (r, row) in acc.iter().enumerate().take(mr) {
        // SAFETY: the tile may write `cols` columns of each of its rows.
        unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), t.out.add(r * t.ldo), cols) };
    }
}

#[cfg(target_arch = "aarch64")]
pub(super) mod neon;
#[cfg(target_arch = "x86_64")]
mod x86;

/// Panels one kernel call covers in a tile of `mr` rows: as many as keep the accumulators,
/// the weight vectors and the broadcast in registers. AVX-512 has 32 registers of a whole
/// panel (6 × 4 accumulators + 4 + 1); AVX2 has 16 of half a panel and NEON 32 of a quarter,
/// so wider tiles there spill (the AVX-512 shape on AVX2 ran at half the speed of this one).
/// Splitting a tile into calls changes no element's order of summation.
fn panels_per_call(isa: Isa, mr: usize) -> usize {
    match (isa, mr) {
        (Isa::Avx512 | Isa::Scalar, _) => NP,
        // One row: each weight vector is used once, straight from memory.
        (Isa::Avx2 | Isa::Neon, 1) => NP,
        // AVX2: 8 accumulators + 4 weights + 1; NEON: 16 + 8 + 1.
        (Isa::Avx2 | Isa::Neon, 2) => 2,
        // AVX2: up to 12 accumulators + 2 weights + 1; NEON: up to 24 + 4 + 1.
        (Isa::Avx2 | Isa::Neon, _) => 1,
    }
}

impl Tile {
    /// The part of this tile from its panel `c` on (`c * PANEL < cols`); only the first part
    /// keeps the prefetch.
    fn panels_from(self, c: usize) -> Tile {
        Tile {
            out: self.out.wrapping_add(c * PANEL),
            cols: self.cols - c * PANEL,
            prefetch: if c == 0 {
                self.prefetch
            } else {
                std::ptr::null()
            },
            ..self
        }
    }
}

/// Calls the kernel `$k R, C>(t, w)` for the tile shape `(mr, cp)`: `$k` is its path up to
/// and including the `<` of its generic arguments. `all` instantiates every shape of up to
/// 6 rows × 4 panels, `narrow` the shapes `panels_per_call` gives the 16-register sets.
macro_rules! call_shape {
    (all, [$($k:tt)*], $mr:expr, $cp:expr, $t:expr, $w:expr) => {
        match ($mr, $cp) {
            (6, 4) => $($k)* 6, 4>($t, $w),
            (6, 3) => $($k)* 6, 3>($t, $w),
            (6, 2) => $($k)* 6, 2>($t, $w),
            (6, _) => $($k)* 6, 1>($t, $w),
            (5, 4) => $($k)* 5, 4>($t, $w),
            (5, 3) => $($k)* 5, 3>($t, $w),
            (5, 2) => $($k)* 5, 2>($t, $w),
            (5, _) => $($k)* 5, 1>($t, $w),
            (4, 4) => $($k)* 4, 4>($t, $w),
            (4, 3) => $($k)* 4, 3>($t, $w),
            (4, 2) => $($k)* 4, 2>($t, $w),
            (4, _) => $($k)* 4, 1>($t, $w),
            (3, 4) => $($k)* 3, 4>($t, $w),
            (3, 3) => $($k)* 3, 3>($t, $w),
            (3, 2) => $($k)* 3, 2>($t, $w),
            (3, _) => $($k)* 3, 1>($t, $w),
            (2, 4) => $($k)* 2, 4>($t, $w),
            (2, 3) => $($k)* 2, 3>($t, $w),
            (2, 2) => $($k)* 2, 2>($t, $w),
            (2, _) => $($k)* 2, 1>($t, $w),
            (_, 4) => $($k)* 1, 4>($t, $w),
            (_, 3) => $($k)* 1, 3>($t, $w),
            (_, 2) => $($k)* 1, 2>($t, $w),
            (_, _) => $($k)* 1, 1>($t, $w),
        }
    };
    (narrow, [$($k:tt)*], $mr:expr, $cp:expr, $t:expr, $w:expr) => {
        match ($mr, $cp) {
            (1, 4) => $($k)* 1, 4>($t, $w),
            (1, 3) => $($k)* 1, 3>($t, $w),
            (1, 2) => $($k)* 1, 2>($t, $w),
            (2, 2) => $($k)* 2, 2>($t, $w),
            (1, _) => $($k)* 1, 1>($t, $w),
            (2, _) => $($k)* 2, 1>($t, $w),
            (3, _) => $($k)* 3, 1>($t, $w),
            (4, _) => $($k)* 4, 1>($t, $w),
            (5, _) => $($k)* 5, 1>($t, $w),
            (_, _) => $($k)* 6, 1>($t, $w),
        }
    };
}

/// Defines `$fn_name`, which runs a tile of `mr` (1..=6) rows by `np` (1..=4) panels of
/// `$ty` weights on `isa`, in as many kernel calls as `panels_per_call` says.
macro_rules! dispatch_tile {
    ($fn_name:ident, $ty:ty, $avx512:ident, $avx2:ident) => {
        unsafe fn $fn_name(isa: Isa, mr: usize, np: usize, t: Tile, w: *const $ty) {
            let step = panels_per_call(isa, mr);
            let mut c = 0;
            while c < np && c * PANEL < t.cols {
                let cp = (np - c).min(step);
                debug_assert!(cp == 1 || step >= cp);
                let sub = t.panels_from(c);
                // SAFETY: panel c of the tile lies inside the caller's weights.
                let wc = unsafe { w.add(c * t.k * PANEL) };
                // SAFETY: `isa` was checked against the CPU when it was chosen; the tile's
                // pointers and sizes are the caller's, narrowed to panels c.. above.
                unsafe {
                    match isa {
                        #[cfg(target_arch = "x86_64")]
                        Isa::Avx512 => call_shape!(all, [x86::$avx512::<], mr, cp, sub, wc),
                        #[cfg(target_arch = "x86_64")]
                        Isa::Avx2 => call_shape!(narrow, [x86::$avx2::<], mr, cp, sub, wc),
                        #[cfg(target_arch = "aarch64")]
                        Isa::Neon => call_shape!(narrow, [neon::tile_neon::<$ty,], mr, cp, sub, wc),
                        _ => tile_scalar::<$ty>(mr, cp, sub, wc),
                    }
                }
                c += cp;
            }
        }
    };
}

dispatch_tile!(tile_f32, f32, tile_avx512_f32, tile_avx2_f32);
dispatch_tile!(tile_f16, f16, tile_avx512_f16, tile_avx2_f16);
dispatch_tile!(tile_bf16, bf16, tile_avx512_bf16, tile_avx2_bf16);

#[cfg(test)]
mod tests;
