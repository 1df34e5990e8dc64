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
//! The files: `panels` (the packed storage), `arena` (a loaded model's panels in one
//! huge-page mapping), `ggml` (GGML's blocks, decoded), `x86` (the vector dequantizers),
//! `fused` (tiles that dequantize in registers), `int8`, `x86_int`, `x86_zmm` and `neon_int` (the
//! integer tiles); this file picks the dequantizer and the integer tile for an instruction
//! set.

pub(crate) mod arena;
#[cfg(target_arch = "x86_64")]
pub(crate) mod fused;
pub mod ggml;
pub(crate) mod int8;
#[cfg(target_arch = "aarch64")]
mod neon_int;
mod panels;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_int;
#[cfg(target_arch = "x86_64")]
mod x86_zmm;

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

/// Moves the bytes of `panels` into one mapping backed by huge pages where the OS gives them
/// ([`arena::gather`]); returns its size.
pub(crate) fn gather_panels(panels: &mut [&mut QuantPanels]) -> std::io::Result<usize> {
    let mut bytes: Vec<&mut arena::PanelBytes> = panels.iter_mut().map(|p| &mut p.data).collect();
    arena::gather(&mut bytes)
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

/// The integer tile a `fast` matmul runs. Every tile computes the same bits (exact integer
/// sums, then the same f32 operations), so the choice is only about speed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntTile {
    /// `int8::panel_portable`: any CPU.
    Portable,
    /// x86-64 with AVX2: `vpmaddubsw` and `vpmaddwd`.
    Avx2,
    /// x86-64 with AVX-VNNI: `vpdpbusd` on 256-bit vectors.
    AvxVnni,
    /// x86-64 with AVX512_VNNI and AVX512_BW: `vpdpbusd` on 512-bit vectors.
    Avx512Vnni,
    /// aarch64 with the dot-product extension: `sdot` by element.
    NeonDot,
}

impl IntTile {
    /// Every tile, best first.
    pub const ALL: [IntTile; 5] = [
        IntTile::Avx512Vnni,
        IntTile::AvxVnni,
        IntTile::Avx2,
        IntTile::NeonDot,
        IntTile::Portable,
    ];

    pub fn name(self) -> &'static str {
        match self {
            IntTile::Portable => "portable",
            IntTile::Avx2 => "avx2 vpmaddubsw",
            IntTile::AvxVnni => "avx-vnni vpdpbusd",
            IntTile::Avx512Vnni => "avx512-vnni vpdpbusd",
            IntTile::NeonDot => "neon sdot",
        }
    }

    /// Whether this CPU runs the tile.
    pub fn supported(self) -> bool {
        match self {
            IntTile::Portable => true,
            #[cfg(target_arch = "x86_64")]
            IntTile::Avx2 => x86_int::has_avx2(),
            #[cfg(target_arch = "x86_64")]
            IntTile::AvxVnni => x86_int::has_avx_vnni(),
            #[cfg(target_arch = "x86_64")]
            IntTile::Avx512Vnni => x86_zmm::has_avx512_vnni(),
            #[cfg(target_arch = "aarch64")]
            IntTile::NeonDot => neon_int::supported(),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The tile kernels on `isa` run: the best one of that instruction set the CPU has
    /// (an AVX2 run on an AVX-512 machine takes AVX-VNNI where present, never the EVEX
    /// `vpdpbusd`, so `TANDEM_ISA=avx2` still shows what an AVX2-only CPU runs).
    pub fn for_isa(isa: Isa) -> IntTile {
        let candidates: &[IntTile] = match isa {
            Isa::Avx512 => &[IntTile::Avx512Vnni, IntTile::AvxVnni, IntTile::Avx2],
            Isa::Avx2 => &[IntTile::AvxVnni, IntTile::Avx2],
            Isa::Neon => &[IntTile::NeonDot],
            Isa::Scalar => &[],
        };
        candidates
            .iter()
            .copied()
            .find(|tile| tile.supported())
            .unwrap_or(IntTile::Portable)
    }
}

impl std::fmt::Display for IntTile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Panels `p0..p1` of `w` (in quads) against every row of `acts` on `tile`: row blocks
/// outside, so a block's activations stay in cache while the task's panels pass under them.
///
/// # Safety
/// The CPU runs `tile` ([`IntTile::supported`]); `out.out` may be written at `r·ldo + c` for
/// `r < acts.rows` and `c < count`, where `count` counts from panel 0's first column; `p1` is
/// at most the matrix's panel count.
pub(crate) unsafe fn int_block(
    tile: IntTile,
    acts: &QuantizedActs,
    w: &QuantPanels,
    p0: usize,
    p1: usize,
    out: IntOut,
) {
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
                let count = (i1 - r).min(4);
                // SAFETY: rows `r..r + count` and the panel's columns lie inside the output
                // the caller hands over.
                let dst = unsafe { out.out.0.add(r * out.ldo + p * PANEL) };
                let rows = PanelRows {
                    row: r,
                    rows: count,
                    out: dst,
                    ldo: out.ldo,
                    cols,
                    // Not for one or two rows (a batch-1 or -2 decode step): there the
                    // prefetches cost more than they hide (Zen 4, in-process A/B: batch 1
                    // 5-9 % faster without, batch 2 the same, batch 8 8 % slower).
                    prefetch: r == i0 && m > 2,
                };
                // SAFETY: the caller checked the tile against the CPU; the rows lie inside the
                // caller's output.
                unsafe {
                    match tile {
                        #[cfg(target_arch = "x86_64")]
                        IntTile::Avx2 => x86_int::panel_maddubs(acts, w, p, rows),
                        #[cfg(target_arch = "x86_64")]
                        IntTile::AvxVnni => x86_int::panel_avx_vnni(acts, w, p, rows),
                        #[cfg(target_arch = "x86_64")]
                        IntTile::Avx512Vnni => x86_zmm::panel_avx512_vnni(acts, w, p, rows),
                        #[cfg(target_arch = "aarch64")]
                        IntTile::NeonDot => neon_int::panel_sdot(acts, w, p, rows),
                        _ => int8::panel_portable(acts, w, p, rows),
                    }
                }
                r += count;
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
