//! The packed storage of a quantized matrix (see the parent's docs for the byte layout):
//! [`QuantPanels`] built from a GGML tensor, the offsets of a panel's scales and integers
//! (`Layout`), and one panel read back element by element (`PanelView`), which the
//! per-instruction-set dequantizers and fused tiles read.

use half::f16;
use rayon::prelude::*;

use super::arena::PanelBytes;
use super::ggml::{DecodedRow, QuantKind, SUPER_BLOCK, decode_row};
use crate::backend::cpu::kernels::matmul::PANEL;

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

/// How a panel's integers are ordered: for the f32 tiles, or for integer dot products.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arrangement {
    /// Input-major (the module docs): what the dequantizers and the `exact` tiles read.
    InputMajor,
    /// Each lane's consecutive inputs side by side, for the integer tiles of `fast` mode
    /// (`int8`): byte formats (Q8_0, and Q5_K and Q6_K, whose high bits are joined to the
    /// nibble, a byte per weight) hold input `4t + j` of lane `l` at byte `64t + 4l + j` of
    /// their group's integers; the 4-bit formats hold, per 8 inputs `8t..8t + 8`, lane `l`'s
    /// inputs `8t + j` (low nibble) and `8t + 4 + j` (high) at byte `64t + 4l + j`. So 32
    /// bytes are four consecutive inputs of 8 lanes: one operand of `vpmaddubsw`.
    Quads,
}

/// A `rows × cols` matrix in a GGML format, packed in panels (see the module docs).
#[derive(Debug, Clone)]
pub struct QuantPanels {
    pub(super) kind: QuantKind,
    pub(super) arrangement: Arrangement,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) layout: Layout,
    pub(super) data: PanelBytes,
}

/// Where things lie inside one panel's bytes, for a format and row length.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Layout {
    pub arrangement: Arrangement,
    /// Whether the integers are nibbles (else one byte each).
    pub nibbles: bool,
    /// Groups per scale block: 1, or a K format's groups per super-block.
    pub(super) groups_per_block: usize,
    /// Bytes of a scale block's `d` and `m`.
    pub(super) block_header: usize,
    /// Bytes of a group's `sc` and `−m`.
    pub group_header: usize,
    /// Bytes of a group's integers (nibbles and high-bit words).
    pub group_q: usize,
    /// Bytes of a group's nibbles (its high-bit words follow them).
    pub group_nibbles: usize,
    /// Bits of each integer above its nibble (see `QuantKind::high_bits`).
    pub high_bits: usize,
    /// Bytes of a scale block, its groups included.
    pub(super) block_bytes: usize,
    /// Bytes of a panel.
    pub panel_bytes: usize,
}

/// One group's offsets in its panel (see [`Layout::walk`]; the portable tile reads `q` only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct GroupOffsets {
    /// Its scale block's `d`.
    pub block: usize,
    /// Its own header (`sc`, `−m`).
    pub head: usize,
    /// Its integers.
    pub q: usize,
    /// `start..end`: the bytes it brings with it (its block's header when it is the first).
    pub start: usize,
    pub end: usize,
}

impl Layout {
    pub(super) fn new(kind: QuantKind, cols: usize, arrangement: Arrangement) -> Self {
        let lanes16 = |bytes_per_lane: usize| PANEL * bytes_per_lane;
        // Quads join a K format's high bits to its nibble (see `Arrangement::Quads`).
        let (nibbles, high_bits) = match arrangement {
            Arrangement::InputMajor => (kind.nibbles(), kind.high_bits()),
            Arrangement::Quads => (kind.nibbles() && kind.high_bits() == 0, 0),
        };
        let group = kind.group();
        let groups_per_block = if kind.super_blocks() {
            SUPER_BLOCK / group
        } else {
            1
        };
        let asym = usize::from(kind.asymmetric());
        let block_header = lanes16(2) * (1 + asym);
        let group_header = if kind.super_blocks() {
            lanes16(1) * (1 + asym)
        } else {
            0
        };
        let group_nibbles = if nibbles { lanes16(group) / 2 } else { 0 };
        let group_q = if nibbles {
            group_nibbles + high_bits * 2 * group
        } else {
            lanes16(group)
        };
        let block_bytes = block_header + groups_per_block * (group_header + group_q);
        let blocks = cols / (group * groups_per_block);
        Layout {
            arrangement,
            nibbles,
            groups_per_block,
            block_header,
            group_header,
            group_q,
            group_nibbles,
            high_bits,
            block_bytes,
            panel_bytes: blocks * block_bytes,
        }
    }

    /// Offset in a panel of the scale block holding group `g` (its `d`; `m` follows 32 bytes on).
    #[inline(always)]
    pub fn block_at(&self, g: usize) -> usize {
        (g / self.groups_per_block) * self.block_bytes
    }

    /// Offset in a panel of group `g`'s header (its integers follow `group_header` on).
    #[inline(always)]
    pub fn group_at(&self, g: usize) -> usize {
        self.block_at(g)
            + self.block_header
            + (g % self.groups_per_block) * (self.group_header + self.group_q)
    }

    /// Offset in a panel of group `g`'s integers.
    #[inline(always)]
    pub fn q_at(&self, g: usize) -> usize {
        self.group_at(g) + self.group_header
    }

    /// Offset in a panel of the high-bit word (`2·high_bits` bytes) of group `g`'s input
    /// `within` (counted from the group's first input).
    #[inline(always)]
    pub fn high_at(&self, g: usize, within: usize) -> usize {
        self.q_at(g) + self.group_nibbles + 2 * self.high_bits * within
    }

    /// Every group's offsets in input order, with no division per group (a tile visiting
    /// groups in turn would otherwise spend more on `g / groups_per_block` than on a group).
    pub fn walk(&self) -> impl Iterator<Item = GroupOffsets> + use<> {
        let layout = *self;
        let mut block = 0;
        let mut within = 0;
        std::iter::from_fn(move || {
            let head =
                block + layout.block_header + within * (layout.group_header + layout.group_q);
            let offsets = GroupOffsets {
                block,
                head,
                q: head + layout.group_header,
                start: if within == 0 { block } else { head },
                end: head + layout.group_header + layout.group_q,
            };
            within += 1;
            if within == layout.groups_per_block {
                within = 0;
                block += layout.block_bytes;
            }
            Some(offsets)
        })
    }

    /// The bytes group `g` brings with it: from its scale block's start when it is the
    /// block's first group, else from its own header, to the end of its integers (what the
    /// x86-64 kernels prefetch).
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub fn record(&self, g: usize) -> std::ops::Range<usize> {
        let start = if g.is_multiple_of(self.groups_per_block) {
            self.block_at(g)
        } else {
            self.group_at(g)
        };
        start..self.q_at(g) + self.group_q
    }
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

    /// Packs a row-major tensor given as its GGML blocks, input-major (`exact` mode).
    pub fn from_ggml(
        kind: QuantKind,
        rows: usize,
        cols: usize,
        bytes: &[u8],
    ) -> Result<Self, QuantError> {
        Self::from_ggml_in(Arrangement::InputMajor, kind, rows, cols, bytes)
    }

    /// Packs a row-major tensor given as its GGML blocks, its integers in `arrangement`.
    pub fn from_ggml_in(
        arrangement: Arrangement,
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
        let layout = Layout::new(kind, cols, arrangement);
        let mut data = vec![0u8; rows.div_ceil(PANEL) * layout.panel_bytes];
        let shape = Shape {
            kind,
            rows,
            cols,
            row_bytes,
            layout,
        };
        data.par_chunks_mut(layout.panel_bytes.max(1))
            .enumerate()
            .for_each(|(p, panel)| pack_panel(&shape, bytes, p, panel));
        Ok(QuantPanels {
            kind,
            arrangement,
            rows,
            cols,
            layout,
            data: PanelBytes::Owned(data),
        })
    }

    pub fn kind(&self) -> QuantKind {
        self.kind
    }

    pub fn arrangement(&self) -> Arrangement {
        self.arrangement
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes of storage (panel padding included).
    pub fn size_in_bytes(&self) -> usize {
        self.data.len()
    }

    /// Element `(r, c)` dequantized, as ggml dequantizes it.
    pub fn get(&self, r: usize, c: usize) -> f32 {
        let view = PanelView::new(self, r / PANEL);
        let lane = r % PANEL;
        let (scale, offset) = view.scale_offset(c / self.kind.group(), lane);
        view.weight(view.q(c, lane), scale, offset)
    }

    /// The panels' layout, for the tiles that read them in place.
    pub(crate) fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The first byte of panel `p` (panels follow each other `layout().panel_bytes` apart).
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    pub(crate) fn panel_ptr(&self, p: usize) -> *const u8 {
        self.data.as_ptr().wrapping_add(p * self.layout.panel_bytes)
    }
}

/// What `pack_panel` needs to know of the whole tensor.
struct Shape {
    kind: QuantKind,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    layout: Layout,
}

/// Where input `within` (counted from its group's first) of `lane` sits among a group's
/// integers in quads, and whether it is the high nibble of its byte.
#[inline(always)]
pub(super) fn quad_at(nibbles: bool, within: usize, lane: usize) -> (usize, bool) {
    if nibbles {
        let (t, j) = (within / 8, within % 8);
        (64 * t + 4 * lane + j % 4, j >= 4)
    } else {
        (64 * (within / 4) + 4 * lane + within % 4, false)
    }
}

/// Writes panel `p` of a row-major GGML tensor into `out` (one panel's bytes, zeroed).
fn pack_panel(shape: &Shape, bytes: &[u8], p: usize, out: &mut [u8]) {
    let Shape {
        kind,
        rows,
        cols,
        row_bytes,
        layout,
    } = *shape;
    let group = kind.group();
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
        let bias = kind.nibble_bias();
        for (i, &q) in row.q.iter().enumerate() {
            let (g, within) = (i / group, i % group);
            let base = layout.q_at(g);
            let stored = (q as i32 + bias) as u8;
            if layout.arrangement == Arrangement::Quads {
                let (at, high) = quad_at(layout.nibbles, within, lane);
                out[base + at] |= if high { stored << 4 } else { stored };
            } else if kind.nibbles() {
                let nibble = stored & 0xF;
                let at = base + (within / 2) * PANEL + lane;
                out[at] |= if within.is_multiple_of(2) {
                    nibble
                } else {
                    nibble << 4
                };
                let high = kind.high_bits();
                for b in 0..high {
                    if stored >> (4 + b) & 1 != 0 {
                        let bit = high * lane + b;
                        out[layout.high_at(g, within) + bit / 8] |= 1 << (bit % 8);
                    }
                }
            } else {
                out[base + within * PANEL + lane] = q as u8;
            }
        }
        // `d` and `m` hold one value per scale block, `sc` and `−m` one per group.
        let f16_lane = |out: &mut [u8], at: usize, v: f16| {
            out[at + 2 * lane..at + 2 * lane + 2].copy_from_slice(&v.to_le_bytes());
        };
        let first_group = |b: usize| b * layout.groups_per_block;
        for (b, &d) in row.d.iter().enumerate() {
            f16_lane(out, layout.block_at(first_group(b)), d);
        }
        for (b, &m) in row.m.iter().enumerate() {
            f16_lane(out, layout.block_at(first_group(b)) + 2 * PANEL, m);
        }
        for (g, &sc) in row.sc.iter().enumerate() {
            out[layout.group_at(g) + lane] = sc as u8;
        }
        for (g, &v) in row.neg_min.iter().enumerate() {
            out[layout.group_at(g) + PANEL + lane] = v as u8;
        }
    }
}

/// One panel's bytes, with the format's shape.
pub(crate) struct PanelView<'a> {
    pub(super) kind: QuantKind,
    pub(super) cols: usize,
    pub(super) layout: Layout,
    pub(super) bytes: &'a [u8],
}

impl<'a> PanelView<'a> {
    pub(super) fn new(w: &'a QuantPanels, p: usize) -> Self {
        let n = w.layout.panel_bytes;
        PanelView {
            kind: w.kind,
            cols: w.cols,
            layout: w.layout,
            bytes: &w.data[p * n..(p + 1) * n],
        }
    }

    /// The stored integer of input `i`, lane `lane`, with the nibble bias taken off.
    pub(super) fn q(&self, i: usize, lane: usize) -> i8 {
        let group = self.kind.group();
        let (base, within) = (self.layout.q_at(i / group), i % group);
        if self.layout.arrangement == Arrangement::Quads {
            let (at, high) = quad_at(self.layout.nibbles, within, lane);
            let byte = self.bytes[base + at];
            let stored = match (self.layout.nibbles, high) {
                (false, _) => i32::from(byte),
                (true, false) => i32::from(byte & 0xF),
                (true, true) => i32::from(byte >> 4),
            };
            // Q8_0's byte is the signed integer itself (its bias is 0).
            return (stored - self.kind.nibble_bias()) as u8 as i8;
        }
        if self.kind.nibbles() {
            let byte = self.bytes[base + (within / 2) * PANEL + lane];
            let mut stored = i32::from(if within.is_multiple_of(2) {
                byte & 0xF
            } else {
                byte >> 4
            });
            let high = self.kind.high_bits();
            for b in 0..high {
                let bit = high * lane + b;
                let byte = self.bytes[self.layout.high_at(i / group, within) + bit / 8];
                stored |= i32::from((byte >> (bit % 8)) & 1) << (4 + b);
            }
            (stored - self.kind.nibble_bias()) as i8
        } else {
            self.bytes[base + within * PANEL + lane] as i8
        }
    }

    pub(super) fn f16_at(&self, at: usize) -> f32 {
        f16::from_le_bytes([self.bytes[at], self.bytes[at + 1]]).to_f32()
    }

    /// Group `g`'s scale and offset in lane `lane`: `d` and `m` of direct formats, the exact
    /// products `d·sc` and `dmin·(−m)` of the K formats (the offset is 0 when symmetric).
    pub(super) fn scale_offset(&self, g: usize, lane: usize) -> (f32, f32) {
        let block = self.layout.block_at(g) + 2 * lane;
        let asym = self.kind.asymmetric();
        let d = self.f16_at(block);
        let m = if asym {
            self.f16_at(block + 2 * PANEL)
        } else {
            0.0
        };
        if self.kind.super_blocks() {
            let at = self.layout.group_at(g) + lane;
            let sc = self.bytes[at] as i8;
            let neg_min = if asym {
                self.bytes[at + PANEL] as i8
            } else {
                0
            };
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
    pub(super) fn weight(&self, q: i8, scale: f32, offset: f32) -> f32 {
        let w = q as f32 * scale;
        if self.kind.asymmetric() {
            w + offset
        } else {
            w
        }
    }
}
