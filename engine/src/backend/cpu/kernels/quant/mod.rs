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
//! Storage: one contiguous run of bytes per panel `p` of 16 rows (lane = row mod 16; rows
//! past the end are zero), laid out like the GGML blocks it came from: a panel's scales sit
//! just before the integers they scale, so a one-row tile reads one stream per panel and one
//! prefetch brings a group's scales with its integers. Per scale block (a block, or a K
//! format's super-block), in input order:
//! - `d`, then `m` when asymmetric: 16 f16 each, one per lane (little-endian);
//! - per group of the block: a K format's `sc`, then `−m` when asymmetric (16 i8 each), then
//!   the integers: byte formats (Q8_0) hold input `i` of 16 rows in the 16 bytes at `16·i`;
//!   the others hold the low four bits of inputs `2j` (low nibble) and `2j + 1` (high) at
//!   `16·j`, counted from the group's first input, then (Q5_K, Q6_K, whose integers have `h`
//!   = 1 or 2 bits above the nibble) one little-endian word of `16·h` bits per input holding
//!   lane `l`'s high bits at bit `h·l`. So every format takes its own bits per weight (Q5_K
//!   5, Q6_K 6), and a vector unit broadcasts an input's word and rotates each lane's bits
//!   into place (`h·l` to 4) in one instruction.

//!
//! That is `exact` mode. In `fast` mode (see `compute`) the panels hold the same bytes with
//! each lane's consecutive inputs side by side ([`Arrangement::Quads`]), and `int8` runs them
//! as integer dot products over 8-bit activations.
//!
//! The files: `panels` (the packed storage), `ggml` (GGML's blocks, decoded), `x86` (the
//! vector dequantizers), `fused` (tiles that dequantize in registers), `int8` and `x86_int`
//! (the integer tiles); this file picks the dequantizer for an instruction set.

#[cfg(target_arch = "x86_64")]
pub(crate) mod fused;
pub mod ggml;
pub(crate) mod int8;
mod panels;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_int;

pub use ggml::{DecodedRow, QuantKind, SUPER_BLOCK, decode_row};
pub use int8::QuantizedActs;
pub(crate) use panels::PanelView;
pub use panels::{Arrangement, QuantError, QuantPanels};

use super::matmul::PANEL;
use super::{Isa, SharedMut};
use int8::PanelRows;

/// Writes panel `p` of `w` dequantized into `out` in the f32 panel layout (`cols × 16`, input
/// `i` at `16·i`), on `isa` (NEON uses the portable loop; the f32 tiles that follow are
/// NEON's own).
///
/// # Panics
/// If `out` is shorter than `cols × 16` or `p` is past the last panel.
pub fn dequant_panel(isa: Isa, w: &QuantPanels, p: usize, out: &mut [f32]) {
    assert!(out.len() >= w.cols * PANEL, "dequant_panel: output size");
    assert!(p < w.rows.div_ceil(PANEL), "dequant_panel: panel {p}");
    assert_eq!(
        w.arrangement,
        Arrangement::InputMajor,
        "dequant_panel reads input-major panels"
    );
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

/// Rows of x per cache block of the integer tiles: the block's activations stay in cache
/// while a task's panels pass under them.
const ROW_BLOCK: usize = 64;

/// Where a block of integer tiles writes: output columns `first..first + count` (of the
/// part's matrix) in rows `ldo` apart, from `out`.
#[derive(Clone, Copy)]
pub(crate) struct IntOut {
    pub out: SharedMut,
    pub ldo: usize,
    pub count: usize,
}

/// Panels `p0..p1` of `w` (in quads) against every row of `acts`: row blocks outside, so a
/// block's activations stay in cache while the task's panels pass under them.
///
/// # Safety
/// `out.out` may be written at `r·ldo + c` for `r < acts.rows` and `c < count`, where `count`
/// counts from panel 0's first column; `p1` is at most the matrix's panel count.
pub(crate) unsafe fn int_block(
    isa: Isa,
    acts: &QuantizedActs,
    w: &QuantPanels,
    p0: usize,
    p1: usize,
    out: IntOut,
) {
    assert_eq!(
        w.arrangement(),
        Arrangement::Quads,
        "integer tiles read quads"
    );
    assert_eq!(
        w.arrangement,
        Arrangement::Quads,
        "integer tiles read quads"
    );
    assert_eq!(acts.k, w.cols(), "activations and weights disagree on k");
    let m = acts.rows;
    let mut i0 = 0;
    while i0 < m {
        let i1 = (i0 + ROW_BLOCK).min(m);
        for p in p0..p1 {
            let cols = (out.count - p * PANEL).min(PANEL);
            let mut r = i0;
            while r < i1 {
                let rows = (i1 - r).min(4);
                // SAFETY: rows `r..r + rows` and the panel's columns lie inside the output
                // the caller hands over.
                let dst = unsafe { out.out.0.add(r * out.ldo + p * PANEL) };
                let tile = PanelRows {
                    row: r,
                    rows,
                    out: dst,
                    ldo: out.ldo,
                    cols,
                    prefetch: r == i0,
                };
                match isa {
                    // SAFETY: AVX2 is part of both sets, checked against the CPU when the
                    // set was chosen; the tile lies inside the caller's output.
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 | Isa::Avx2 => unsafe { x86_int::panel_avx2(acts, w, p, tile) },
                    // SAFETY: as above.
                    _ => unsafe { int8::panel_portable(acts, w, p, tile) },
                }
                r += rows;
            }
        }
        i0 = i1;
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
mod int_tests;
#[cfg(test)]
mod tests;
