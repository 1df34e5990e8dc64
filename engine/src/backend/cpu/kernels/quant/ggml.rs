//! The GGML block formats the engine runs without widening (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K,
//! Q6_K), decoded row by row into one canonical form the panels store.
//!
//! Every format's dequantized value is `q·S` or `q·S + O` for a small integer `q`, a group
//! scale `S` and (asymmetric formats) a group offset `O`, with `S` and `O` either stored f16
//! values (`d`, `m` per 32-element block) or exact f32 products of an f16 and a 6-bit integer
//! (the K formats: `d·sc` and `dmin·(−m)` per 16- or 32-element group of a 256-element
//! super-block). The kernels evaluate exactly those f32 operations in that order, which are
//! the operations of ggml's and candle's `dequantize_row_*`, so a native matrix computes the
//! same bits as its dequantized f32 copy.

use half::f16;

/// Elements of a K-format super-block.
pub const SUPER_BLOCK: usize = 256;

/// A GGML block format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum QuantKind {
    Q8_0,
    Q4_0,
    Q4_1,
    Q4K,
    Q5K,
    Q6K,
}

impl QuantKind {
    pub const ALL: [QuantKind; 6] = [
        QuantKind::Q8_0,
        QuantKind::Q4_0,
        QuantKind::Q4_1,
        QuantKind::Q4K,
        QuantKind::Q5K,
        QuantKind::Q6K,
    ];

    /// The name llama.cpp gives the type (`q4_k`, not `Q4_K`, in flags).
    pub fn name(self) -> &'static str {
        match self {
            QuantKind::Q8_0 => "q8_0",
            QuantKind::Q4_0 => "q4_0",
            QuantKind::Q4_1 => "q4_1",
            QuantKind::Q4K => "q4_k",
            QuantKind::Q5K => "q5_k",
            QuantKind::Q6K => "q6_k",
        }
    }

    pub fn parse(name: &str) -> Option<QuantKind> {
        QuantKind::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(name.trim()))
    }

    /// Elements per GGML block (a row's length must be a multiple of it).
    pub fn block_elems(self) -> usize {
        match self {
            QuantKind::Q8_0 | QuantKind::Q4_0 | QuantKind::Q4_1 => 32,
            QuantKind::Q4K | QuantKind::Q5K | QuantKind::Q6K => SUPER_BLOCK,
        }
    }

    /// Bytes per GGML block.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantKind::Q8_0 => 34,
            QuantKind::Q4_0 => 18,
            QuantKind::Q4_1 => 20,
            QuantKind::Q4K => 144,
            QuantKind::Q5K => 176,
            QuantKind::Q6K => 210,
        }
    }

    /// Elements sharing one scale (and offset).
    pub fn group(self) -> usize {
        match self {
            QuantKind::Q6K => 16,
            _ => 32,
        }
    }

    /// Whether `q`'s low four bits are stored as nibbles (two per byte), its bits above them
    /// (see [`Self::high_bits`]) in bit planes; else `q` is a byte.
    pub fn nibbles(self) -> bool {
        self != QuantKind::Q8_0
    }

    /// Bits of `q` above its nibble: 1 for Q5_K, 2 for Q6_K, 0 for the others.
    pub fn high_bits(self) -> usize {
        match self {
            QuantKind::Q5K => 1,
            QuantKind::Q6K => 2,
            _ => 0,
        }
    }

    /// What the stored unsigned integer has added to `q` (Q4_0 stores `q + 8`, Q6_K `q + 32`).
    pub fn nibble_bias(self) -> i32 {
        match self {
            QuantKind::Q4_0 => 8,
            QuantKind::Q6K => 32,
            _ => 0,
        }
    }

    /// Whether values carry an offset (`q·S + O`).
    pub fn asymmetric(self) -> bool {
        matches!(self, QuantKind::Q4_1 | QuantKind::Q4K | QuantKind::Q5K)
    }

    /// Whether the scale is `d·sc` with `d` per super-block and `sc` per group.
    pub fn super_blocks(self) -> bool {
        matches!(self, QuantKind::Q4K | QuantKind::Q5K | QuantKind::Q6K)
    }
}

impl QuantKind {
    /// candle's name for the format (its quantizer and GGUF reader).
    pub fn to_ggml(self) -> candle_core::quantized::GgmlDType {
        use candle_core::quantized::GgmlDType;
        match self {
            QuantKind::Q8_0 => GgmlDType::Q8_0,
            QuantKind::Q4_0 => GgmlDType::Q4_0,
            QuantKind::Q4_1 => GgmlDType::Q4_1,
            QuantKind::Q4K => GgmlDType::Q4K,
            QuantKind::Q5K => GgmlDType::Q5K,
            QuantKind::Q6K => GgmlDType::Q6K,
        }
    }

    /// The format of a candle tensor type, if it is one of these.
    pub fn from_ggml(dtype: candle_core::quantized::GgmlDType) -> Option<QuantKind> {
        QuantKind::ALL.into_iter().find(|k| k.to_ggml() == dtype)
    }
}

impl std::fmt::Display for QuantKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One row in canonical form: `value[i] = q[i]·S(i) (+ O(i))` (see the module docs).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DecodedRow {
    pub q: Vec<i8>,
    /// Per block (direct formats) or super-block (K formats).
    pub d: Vec<f16>,
    /// Like `d`; empty for symmetric formats.
    pub m: Vec<f16>,
    /// K formats: the 6-bit (Q6_K: signed 8-bit) scale of each group.
    pub sc: Vec<i8>,
    /// Q4_K, Q5_K: the negated 6-bit min of each group.
    pub neg_min: Vec<i8>,
}

fn f16_at(b: &[u8], at: usize) -> f16 {
    f16::from_le_bytes([b[at], b[at + 1]])
}

/// ggml's packing of a Q4_K/Q5_K super-block's eight 6-bit scales and mins into 12 bytes.
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Decodes one row of `cols` elements from its GGML blocks.
///
/// # Panics
/// If `bytes` is not `cols / block_elems` blocks (callers check the tensor's size first).
pub fn decode_row(kind: QuantKind, bytes: &[u8], cols: usize, out: &mut DecodedRow) {
    let blocks = cols / kind.block_elems();
    assert_eq!(bytes.len(), blocks * kind.block_bytes(), "row bytes");
    out.q.clear();
    out.d.clear();
    out.m.clear();
    out.sc.clear();
    out.neg_min.clear();
    for b in bytes.chunks_exact(kind.block_bytes()) {
        match kind {
            QuantKind::Q8_0 => {
                out.d.push(f16_at(b, 0));
                out.q.extend(b[2..34].iter().map(|&v| v as i8));
            }
            QuantKind::Q4_0 | QuantKind::Q4_1 => {
                out.d.push(f16_at(b, 0));
                let qs = if kind == QuantKind::Q4_1 {
                    out.m.push(f16_at(b, 2));
                    &b[4..20]
                } else {
                    &b[2..18]
                };
                let bias = kind.nibble_bias();
                out.q
                    .extend(qs.iter().map(|&v| ((v & 0xF) as i32 - bias) as i8));
                out.q
                    .extend(qs.iter().map(|&v| ((v >> 4) as i32 - bias) as i8));
            }
            QuantKind::Q4K | QuantKind::Q5K => {
                out.d.push(f16_at(b, 0));
                out.m.push(f16_at(b, 2));
                let scales = &b[4..16];
                let (qh, qs) = if kind == QuantKind::Q5K {
                    (Some(&b[16..48]), &b[48..176])
                } else {
                    (None, &b[16..144])
                };
                for j in 0..4 {
                    for half in 0..2 {
                        let (sc, m) = scale_min_k4(2 * j + half, scales);
                        out.sc.push(sc as i8);
                        out.neg_min.push(-(m as i8));
                        let high_bit = 1u8 << (2 * j + half);
                        for l in 0..32 {
                            let byte = qs[32 * j + l];
                            let low = if half == 0 { byte & 0xF } else { byte >> 4 };
                            let high =
                                qh.map_or(0, |qh| if qh[l] & high_bit != 0 { 16 } else { 0 });
                            out.q.push((low + high) as i8);
                        }
                    }
                }
            }
            QuantKind::Q6K => {
                let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
                out.d.push(f16_at(b, 208));
                out.sc.extend(sc.iter().map(|&v| v as i8));
                for half in 0..2 {
                    let (ql, qh) = (&ql[64 * half..], &qh[32 * half..]);
                    // ggml's order: four runs of 32 from the nibbles and 2-bit pairs.
                    for run in 0..4 {
                        for l in 0..32 {
                            let byte = ql[l + 32 * (run % 2)];
                            let low = if run < 2 { byte & 0xF } else { byte >> 4 };
                            let high = (qh[l] >> (2 * run)) & 3;
                            out.q.push((low | (high << 4)) as i8 - 32);
                        }
                    }
                }
            }
        }
    }
}
