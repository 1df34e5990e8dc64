//! Quantized weight matrices kept in their GGML precision: the same 16-row panels as the
//! dense matrices (see `matmul`), holding small integers and their group scales instead of
//! f32, so a decode step reads about the bytes of the GGUF file rather than four per weight.
//!
//! `linear` runs a quantized matrix by dequantizing one column group of panels at a time into
//! a per-thread f32 buffer (vectorized, [`dequant_panel`]) and handing that to the f32 tiles;
//! for the few rows of a decode step on AVX-512, tiles that dequantize in registers
//! (`fused`) skip the buffer.
//! Each dequantized weight is exactly the f32 that ggml's `dequantize_row_*` gives (see
//! [`ggml`]), and the f32 tiles keep their order of summation, so a quantized matrix computes
//! the same bits as its dequantized copy: batch invariance and bit-identity across
//! instruction sets carry over unchanged, and the accuracy cost of a format is only the
//! format's own rounding.
//!
//! Storage, per panel `p` of 16 rows (lane = row mod 16; rows past the end are zero):
//! - `q`: byte formats at `(p·cols + i)·16 + lane`; nibble formats hold inputs `2j` (low
//!   nibble) and `2j + 1` (high) of 16 rows in the 16 bytes at `(p·cols/2 + j)·16`;
//! - `d`, `m`: f16 per block or super-block, at `(p·nd + s)·16 + lane`;
//! - `sc`, `neg_min`: the K formats' per-group integers, at `(p·groups + g)·16 + lane`.

#[cfg(target_arch = "x86_64")]
pub(crate) mod fused;
pub mod ggml;
#[cfg(target_arch = "x86_64")]
mod x86;

use half::f16;
use rayon::prelude::*;

pub use ggml::{DecodedRow, QuantKind, SUPER_BLOCK, decode_row};

use super::Isa;
use super::matmul::PANEL;

/// A tensor that cannot be read as the format it claims.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error("{kind} rows must be a multiple of {block} elements long; these are {cols}")]
    RowLength {
        kind: QuantKind,
        cols: usize,
        block: usize,
    },
    #[error("{kind} tensor of {rows}x{cols} takes {expected} bytes; {got} given")]
    Size {
        kind: QuantKind,
        rows: usize,
        cols: usize,
        expected: usize,
        got: usize,
    },
}

/// A `rows × cols` matrix in a GGML format, packed in panels (see the module docs).
#[derive(Debug, Clone)]
pub struct QuantPanels {
    kind: QuantKind,
    rows: usize,
    cols: usize,
    q: Vec<u8>,
    d: Vec<f16>,
    m: Vec<f16>,
    sc: Vec<i8>,
    neg_min: Vec<i8>,
}

/// What one panel contributes to each array, built in parallel and then concatenated.
struct PanelParts {
    q: Vec<u8>,
    d: Vec<f16>,
    m: Vec<f16>,
    sc: Vec<i8>,
    neg_min: Vec<i8>,
}

impl QuantPanels {
    /// Bytes a `rows × cols` tensor of `kind` takes in GGML blocks.
    pub fn ggml_size(kind: QuantKind, rows: usize, cols: usize) -> Result<usize, QuantError> {
        let block = kind.block_elems();
        if cols == 0 || !cols.is_multiple_of(block) {
            return Err(QuantError::RowLength { kind, cols, block });
        }
        Ok(rows * (cols / block) * kind.block_bytes())
    }

    /// Packs a row-major tensor given as its GGML blocks.
    pub fn from_ggml(
        kind: QuantKind,
        rows: usize,
        cols: usize,
        bytes: &[u8],
    ) -> Result<Self, QuantError> {
        let expected = Self::ggml_size(kind, rows, cols)?;
        if bytes.len() != expected {
            return Err(QuantError::Size {
                kind,
                rows,
                cols,
                expected,
                got: bytes.len(),
            });
        }
        let row_bytes = expected / rows.max(1);
        let parts: Vec<PanelParts> = (0..rows.div_ceil(PANEL))
            .into_par_iter()
            .map(|p| pack_panel(kind, rows, cols, row_bytes, bytes, p))
            .collect();
        let cat = |f: &dyn Fn(&PanelParts) -> usize| parts.iter().map(f).sum::<usize>();
        let mut out = QuantPanels {
            kind,
            rows,
            cols,
            q: Vec::with_capacity(cat(&|p| p.q.len())),
            d: Vec::with_capacity(cat(&|p| p.d.len())),
            m: Vec::with_capacity(cat(&|p| p.m.len())),
            sc: Vec::with_capacity(cat(&|p| p.sc.len())),
            neg_min: Vec::with_capacity(cat(&|p| p.neg_min.len())),
        };
        for p in parts {
            out.q.extend_from_slice(&p.q);
            out.d.extend_from_slice(&p.d);
            out.m.extend_from_slice(&p.m);
            out.sc.extend_from_slice(&p.sc);
            out.neg_min.extend_from_slice(&p.neg_min);
        }
        Ok(out)
    }

    pub fn kind(&self) -> QuantKind {
        self.kind
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes of storage (panel padding included).
    pub fn size_in_bytes(&self) -> usize {
        self.q.len() + 2 * (self.d.len() + self.m.len()) + self.sc.len() + self.neg_min.len()
    }

    /// Element `(r, c)` dequantized, as ggml dequantizes it.
    pub fn get(&self, r: usize, c: usize) -> f32 {
        let view = PanelView::new(self, r / PANEL);
        let lane = r % PANEL;
        let (scale, offset) = view.scale_offset(c / self.kind.group(), lane);
        view.weight(view.q(c, lane), scale, offset)
    }

    /// Bytes of `q` per panel.
    fn q_panel_bytes(&self) -> usize {
        if self.kind.nibbles() {
            self.cols * PANEL / 2
        } else {
            self.cols * PANEL
        }
    }
}

fn pack_panel(
    kind: QuantKind,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    bytes: &[u8],
    p: usize,
) -> PanelParts {
    let nd = kind.scales_per_row(cols);
    let ng = kind.group_scales_per_row(cols);
    let q_len = if kind.nibbles() {
        cols * PANEL / 2
    } else {
        cols * PANEL
    };
    let mut out = PanelParts {
        q: vec![0; q_len],
        d: vec![f16::ZERO; nd * PANEL],
        m: vec![f16::ZERO; if kind.asymmetric() { nd * PANEL } else { 0 }],
        sc: vec![0; ng * PANEL],
        neg_min: vec![0; if kind.asymmetric() { ng * PANEL } else { 0 }],
    };
    let mut row = DecodedRow::default();
    for lane in 0..PANEL {
        let r = p * PANEL + lane;
        if r >= rows {
            break;
        }
        decode_row(
            kind,
            &bytes[r * row_bytes..(r + 1) * row_bytes],
            cols,
            &mut row,
        );
        if kind.nibbles() {
            let bias = kind.nibble_bias();
            for (i, &q) in row.q.iter().enumerate() {
                let nibble = ((q as i32 + bias) as u8) & 0xF;
                let at = (i / 2) * PANEL + lane;
                out.q[at] |= if i.is_multiple_of(2) {
                    nibble
                } else {
                    nibble << 4
                };
            }
        } else {
            for (i, &q) in row.q.iter().enumerate() {
                out.q[i * PANEL + lane] = q as u8;
            }
        }
        for (s, &d) in row.d.iter().enumerate() {
            out.d[s * PANEL + lane] = d;
        }
        for (s, &m) in row.m.iter().enumerate() {
            out.m[s * PANEL + lane] = m;
        }
        for (g, &sc) in row.sc.iter().enumerate() {
            out.sc[g * PANEL + lane] = sc;
        }
        for (g, &v) in row.neg_min.iter().enumerate() {
            out.neg_min[g * PANEL + lane] = v;
        }
    }
    out
}

/// Writes panel `p` of `w` dequantized into `out` in the f32 panel layout (`cols × 16`, input
/// `i` at `16·i`), on `isa` (NEON uses the portable loop; the f32 tiles that follow are
/// NEON's own).
///
/// # Panics
/// If `out` is shorter than `cols × 16` or `p` is past the last panel.
pub fn dequant_panel(isa: Isa, w: &QuantPanels, p: usize, out: &mut [f32]) {
    assert!(out.len() >= w.cols * PANEL, "dequant_panel: output size");
    assert!(p < w.rows.div_ceil(PANEL), "dequant_panel: panel {p}");
    let view = PanelView::new(w, p);
    match isa {
        // SAFETY: the CPU runs `isa` (chosen against it); the view's pointers cover the panel
        // and `out` holds `cols × 16` floats (both checked above).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if isa.supported() => unsafe { x86::dequant_avx512(&view, out.as_mut_ptr()) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if isa.supported() => unsafe { x86::dequant_avx2(&view, out.as_mut_ptr()) },
        _ => dequant_portable(&view, out),
    }
}

/// One panel's slices of the arrays, with the format's shape.
pub(crate) struct PanelView<'a> {
    kind: QuantKind,
    cols: usize,
    q: &'a [u8],
    d: &'a [f16],
    m: &'a [f16],
    sc: &'a [i8],
    neg_min: &'a [i8],
}

impl<'a> PanelView<'a> {
    fn new(w: &'a QuantPanels, p: usize) -> Self {
        let kind = w.kind;
        let nd = kind.scales_per_row(w.cols) * PANEL;
        let ng = kind.group_scales_per_row(w.cols) * PANEL;
        let qb = w.q_panel_bytes();
        let slice_or_empty =
            |v: usize, len: usize| if v == 0 { 0..0 } else { p * len..(p + 1) * len };
        PanelView {
            kind,
            cols: w.cols,
            q: &w.q[p * qb..(p + 1) * qb],
            d: &w.d[p * nd..(p + 1) * nd],
            m: &w.m[slice_or_empty(w.m.len(), nd)],
            sc: &w.sc[slice_or_empty(w.sc.len(), ng)],
            neg_min: &w.neg_min[slice_or_empty(w.neg_min.len(), ng)],
        }
    }

    /// Index into `d`/`m` of group `g`'s block or super-block.
    fn scale_index(&self, g: usize) -> usize {
        if self.kind.super_blocks() {
            g * self.kind.group() / SUPER_BLOCK
        } else {
            g
        }
    }

    /// The stored integer of input `i`, lane `lane`, with the nibble bias taken off.
    fn q(&self, i: usize, lane: usize) -> i8 {
        if self.kind.nibbles() {
            let byte = self.q[(i / 2) * PANEL + lane];
            let nibble = if i.is_multiple_of(2) {
                byte & 0xF
            } else {
                byte >> 4
            };
            (nibble as i32 - self.kind.nibble_bias()) as i8
        } else {
            self.q[i * PANEL + lane] as i8
        }
    }

    /// Group `g`'s scale and offset in lane `lane`: `d` and `m` of direct formats, the exact
    /// products `d·sc` and `dmin·(−m)` of the K formats (the offset is 0 when symmetric).
    fn scale_offset(&self, g: usize, lane: usize) -> (f32, f32) {
        let at = self.scale_index(g) * PANEL + lane;
        let d = self.d[at].to_f32();
        let m = self.m.get(at).map_or(0.0, |m| m.to_f32());
        if self.kind.super_blocks() {
            let sc = self.sc[g * PANEL + lane];
            let neg_min = self.neg_min.get(g * PANEL + lane).copied().unwrap_or(0);
            (d * sc as f32, m * neg_min as f32)
        } else {
            (d, m)
        }
    }

    /// `q·scale`, then `+ offset` for asymmetric formats: ggml's operations, in its order.
    ///
    /// The product is exact in f32: `q` has at most 8 significant bits (6 in the K formats)
    /// and `scale` at most 11 (an f16) or 17 (an f16 times a 6-bit K-format scale), so
    /// `q·scale` needs at most 24 bits (7-bit Q6_K scales: 11 + 7 + 5 = 23). Only the addition
    /// rounds, which is why the vector paths may compute the same value as one fused
    /// multiply-add (`q·scale + offset`, rounded once) and still write these bits.
    #[inline(always)]
    fn weight(&self, q: i8, scale: f32, offset: f32) -> f32 {
        let w = q as f32 * scale;
        if self.kind.asymmetric() {
            w + offset
        } else {
            w
        }
    }
}

/// The portable dequantization: [`PanelView::weight`] per element, scales once per group.
fn dequant_portable(v: &PanelView, out: &mut [f32]) {
    let group = v.kind.group();
    for g in 0..v.cols / group {
        let lanes: [(f32, f32); PANEL] = std::array::from_fn(|lane| v.scale_offset(g, lane));
        for i in g * group..(g + 1) * group {
            for (lane, &(scale, offset)) in lanes.iter().enumerate() {
                out[i * PANEL + lane] = v.weight(v.q(i, lane), scale, offset);
            }
        }
    }
}

#[cfg(test)]
mod tests;
