//! Per-row operations of the decoder blocks: RMSNorm, rotary embeddings (HF rotate-half
//! layout, with Llama 3 or linear frequency scaling), SwiGLU and GeGLU, soft-capping and
//! residual adds. Each row is computed on its own, in a fixed order, so these are
//! batch-invariant by construction.

use crate::config::{ModelConfig, RopeScaling};

/// Runs a body compiled for the given instruction set: the same Rust, in AVX-512 or AVX2
/// code on x86-64 (where the compiler may vectorize it), portable code elsewhere. A body's
/// arithmetic is element-wise or in an explicit order, never contracted into fused
/// multiply-adds (Rust does not do that), so every set computes the same bits.
macro_rules! on_isa {
    ($isa:expr, fn($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {{
        #[inline(always)]
        fn body($($arg: $ty),*) $(-> $ret)? $body
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
        unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
            body($($arg),*)
        }
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
            body($($arg),*)
        }
        let isa: super::Isa = $isa;
        assert!(isa.supported(), "this CPU cannot run the {isa} kernels");
        match isa {
            // SAFETY: the CPU runs this instruction set (asserted above).
            #[cfg(target_arch = "x86_64")]
            super::Isa::Avx512 => unsafe { avx512($($arg),*) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            super::Isa::Avx2 => unsafe { avx2($($arg),*) },
            _ => body($($arg),*),
        }
    }};
}

/// `1 / rms(row)`: the sum of squares in eight interleaved lanes, then a fixed tree.
#[inline(always)]
fn inv_rms(row: &[f32], eps: f32) -> f32 {
    let mut sum = [0f32; 8];
    for (i, &v) in row.iter().enumerate() {
        sum[i % 8] += v * v;
    }
    let ss = ((sum[0] + sum[1]) + (sum[2] + sum[3])) + ((sum[4] + sum[5]) + (sum[6] + sum[7]));
    1.0 / (ss / row.len() as f32 + eps).sqrt()
}

/// `out[t] = x[t] / rms(x[t]) * weight`, for each row `t` of width `weight.len()`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    on_isa!(super::isa(), fn(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
        let h = weight.len();
        for (row, o) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
            let scale = inv_rms(row, eps);
            for ((o, &v), &w) in o.iter_mut().zip(row).zip(weight) {
                *o = v * scale * w;
            }
        }
    })
}

/// RMSNorm of each of `heads` heads (`weight.len()` wide) in place, in every row of `x` (rows
/// `row_stride` apart, heads from `col_offset`): Qwen3's norm of Q and K before RoPE.
pub fn rms_norm_heads(
    x: &mut [f32],
    row_stride: usize,
    col_offset: usize,
    heads: usize,
    weight: &[f32],
    eps: f32,
) {
    on_isa!(super::isa(), fn(
        x: &mut [f32],
        row_stride: usize,
        col_offset: usize,
        heads: usize,
        weight: &[f32],
        eps: f32,
    ) {
        let d = weight.len();
        for row in x.chunks_exact_mut(row_stride) {
            for head in row[col_offset..col_offset + heads * d].chunks_exact_mut(d) {
                let scale = inv_rms(head, eps);
                for (v, &w) in head.iter_mut().zip(weight) {
                    *v = *v * scale * w;
                }
            }
        }
    })
}

/// SwiGLU on a fused gate/up projection: each input row is `[gate(f), up(f)]`, each output
/// row `silu(gate) * up`. Compiled per instruction set so the exponential vectorizes (a libm
/// `expf` per element was 3 % of a decode step).
pub fn silu_mul(gate_up: &[f32], f: usize, out: &mut [f32]) {
    silu_mul_on(super::isa(), gate_up, f, out)
}

/// [`silu_mul`] on a given instruction set (one this CPU runs).
pub(crate) fn silu_mul_on(isa: super::Isa, gate_up: &[f32], f: usize, out: &mut [f32]) {
    on_isa!(isa, fn(gate_up: &[f32], f: usize, out: &mut [f32]) {
        for (row, o) in gate_up.chunks_exact(2 * f).zip(out.chunks_exact_mut(f)) {
            let (gate, up) = row.split_at(f);
            for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
                *o = g / (1.0 + exp_poly(-g)) * u;
            }
        }
    })
}

/// GeGLU on a fused gate/up projection: `gelu_tanh(gate) * up` per row (Gemma's
/// `gelu_pytorch_tanh`: `x/2 · (1 + tanh(√(2/π)·(x + 0.044715·x³)))`).
pub fn gelu_tanh_mul(gate_up: &[f32], f: usize, out: &mut [f32]) {
    gelu_tanh_mul_on(super::isa(), gate_up, f, out)
}

/// [`gelu_tanh_mul`] on a given instruction set (one this CPU runs).
pub(crate) fn gelu_tanh_mul_on(isa: super::Isa, gate_up: &[f32], f: usize, out: &mut [f32]) {
    on_isa!(isa, fn(gate_up: &[f32], f: usize, out: &mut [f32]) {
        const SQRT_2_OVER_PI: f32 = 0.797_884_6;
        for (row, o) in gate_up.chunks_exact(2 * f).zip(out.chunks_exact_mut(f)) {
            let (gate, up) = row.split_at(f);
            for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
                let inner = SQRT_2_OVER_PI * (g + 0.044_715 * g * g * g);
                *o = 0.5 * g * (1.0 + tanh_poly(inner)) * u;
            }
        }
    })
}

/// `x ← cap · tanh(x / cap)` over a row (Gemma 2's logit soft-capping).
pub fn softcap(x: &mut [f32], cap: f32) {
    softcap_on(super::isa(), x, cap)
}

/// [`softcap`] on a given instruction set (one this CPU runs).
pub(crate) fn softcap_on(isa: super::Isa, x: &mut [f32], cap: f32) {
    on_isa!(isa, fn(x: &mut [f32], cap: f32) {
        for v in x.iter_mut() {
            *v = cap * tanh_poly(*v / cap);
        }
    })
}

/// `tanh(v)` from [`exp_poly`]: `(1 − e^{−2|v|}) / (1 + e^{−2|v|})` with the sign put back
/// (absolute error ~1e-7; no overflow, since the exponent is never positive).
#[inline(always)]
pub(crate) fn tanh_poly(v: f32) -> f32 {
    let t = exp_poly(-2.0 * v.abs());
    ((1.0 - t) / (1.0 + t)).copysign(v)
}

/// `Σ exp(x - max)` over a row of logits (the log-softmax denominator), vectorized like
/// `silu_mul`.
pub fn sum_exp(x: &[f32], max: f32) -> f32 {
    sum_exp_on(super::isa(), x, max)
}

/// [`sum_exp`] on a given instruction set (one this CPU runs).
pub(crate) fn sum_exp_on(isa: super::Isa, x: &[f32], max: f32) -> f32 {
    on_isa!(isa, fn(x: &[f32], max: f32) -> f32 {
        let mut acc = [0f32; 16];
        let mut chunks = x.chunks_exact(16);
        for c in &mut chunks {
            for (a, &v) in acc.iter_mut().zip(c) {
                *a += exp_poly(v - max);
            }
        }
        let tail: f32 = chunks.remainder().iter().map(|&v| exp_poly(v - max)).sum();
        acc.iter().sum::<f32>() + tail
    })
}

/// [`exp_poly`]'s clamp of its input, `ln 2` in two parts (high, low) and its polynomial's
/// coefficients (the first, then each multiply-add's): shared by the vector copies below.
const EXP_CLAMP: (f32, f32) = (-87.3, 88.3);
const EXP_LN2: (f32, f32) = (0.693_359_4, -2.121_944_4e-4);
const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `e^x`: Cephes' polynomial, written to vectorize inside target-feature code (relative error
/// ~1e-7; inputs below -87 give ~1e-38 rather than 0, which callers mask where it matters).
/// [`exp_poly_avx2`] and [`exp_poly_avx512`] compute it operation for operation.
#[inline(always)]
pub(crate) fn exp_poly(v: f32) -> f32 {
    let xc = v.clamp(EXP_CLAMP.0, EXP_CLAMP.1);
    let fx = (xc * std::f32::consts::LOG2_E + 0.5).floor();
    let r = xc - fx * EXP_LN2.0 - fx * EXP_LN2.1;
    let mut y = EXP_POLY[0];
    for c in &EXP_POLY[1..] {
        y = y.mul_add(r, *c);
    }
    y = y.mul_add(r * r, r + 1.0);
    // 2^fx from its exponent bits. `fx + 127` is an integer in 1..=254 (the clamp), so adding
    // 2^23 puts it exactly in the low mantissa bits: no float-to-int conversion, whose
    // saturating semantics kept this loop from vectorizing (16 scalar conversions per call).
    let biased = (fx + (127.0 + 8_388_608.0))
        .to_bits()
        .wrapping_sub(0x4B00_0000);
    let pow2 = f32::from_bits(biased << 23);
    y * pow2
}

/// [`exp_poly`] for 8 lanes, operation for operation (the same bits): the clamp as
/// `max(lo, v)` then `min(hi, ·)` (`(a > b) ? a : b` and `(a < b) ? a : b`, the second
/// operand when either is NaN, so a NaN passes through as `f32::clamp` lets it), products
/// and sums rounded where the scalar code rounds them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) fn exp_poly_avx2(v: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let set = _mm256_set1_ps;
    let xc = _mm256_min_ps(set(EXP_CLAMP.1), _mm256_max_ps(set(EXP_CLAMP.0), v));
    let fx = _mm256_floor_ps(_mm256_add_ps(
        _mm256_mul_ps(xc, set(std::f32::consts::LOG2_E)),
        set(0.5),
    ));
    let r = _mm256_sub_ps(
        _mm256_sub_ps(xc, _mm256_mul_ps(fx, set(EXP_LN2.0))),
        _mm256_mul_ps(fx, set(EXP_LN2.1)),
    );
    let mut y = set(EXP_POLY[0]);
    for c in &EXP_POLY[1..] {
        y = _mm256_fmadd_ps(y, r, set(*c));
    }
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, set(1.0)));
    let biased = _mm256_sub_epi32(
        _mm256_castps_si256(_mm256_add_ps(fx, set(127.0 + 8_388_608.0))),
        _mm256_set1_epi32(0x4B00_0000),
    );
    _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32::<23>(biased)))
}

/// [`exp_poly`] for 16 lanes, as [`exp_poly_avx2`] for 8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn exp_poly_avx512(v: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let set = _mm512_set1_ps;
    let xc = _mm512_min_ps(set(EXP_CLAMP.1), _mm512_max_ps(set(EXP_CLAMP.0), v));
    let fx = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(_mm512_add_ps(
        _mm512_mul_ps(xc, set(std::f32::consts::LOG2_E)),
        set(0.5),
    ));
    let r = _mm512_sub_ps(
        _mm512_sub_ps(xc, _mm512_mul_ps(fx, set(EXP_LN2.0))),
        _mm512_mul_ps(fx, set(EXP_LN2.1)),
    );
    let mut y = set(EXP_POLY[0]);
    for c in &EXP_POLY[1..] {
        y = _mm512_fmadd_ps(y, r, set(*c));
    }
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, set(1.0)));
    let biased = _mm512_sub_epi32(
        _mm512_castps_si512(_mm512_add_ps(fx, set(127.0 + 8_388_608.0))),
        _mm512_set1_epi32(0x4B00_0000),
    );
    _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32::<23>(biased)))
}

/// `x += y`.
pub fn add_in_place(x: &mut [f32], y: &[f32]) {
    on_isa!(super::isa(), fn(x: &mut [f32], y: &[f32]) {
        for (a, b) in x.iter_mut().zip(y) {
            *a += b;
        }
    })
}

/// Rotary position embeddings: the inverse frequencies of a model, applied to Q and K rows.
#[derive(Debug, Clone)]
pub struct RopeTable {
    inv_freq: Vec<f32>,
    head_dim: usize,
}

impl RopeTable {
    /// The table of the model's global layers: `rope_theta` with its scaling.
    pub fn new(cfg: &ModelConfig) -> Self {
        Self::with_base(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling.as_ref())
    }

    /// The table of the windowed layers when they have a base of their own (Gemma 3's local
    /// layers: no scaling there, as in its reference).
    pub fn local(cfg: &ModelConfig) -> Option<Self> {
        cfg.rope_local_theta
            .map(|theta| Self::with_base(cfg.head_dim, theta, None))
    }

    fn with_base(d: usize, theta: f64, scaling: Option<&RopeScaling>) -> Self {
        let mut inv_freq: Vec<f32> = (0..d / 2)
            .map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / d as f32))
            .collect();
        match scaling {
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => llama3_scale(
                &mut inv_freq,
                *factor as f32,
                *low_freq_factor as f32,
                *high_freq_factor as f32,
                *original_max_position_embeddings as f32,
            ),
            Some(RopeScaling::Linear { factor }) => {
                for f in inv_freq.iter_mut() {
                    *f /= *factor as f32;
                }
            }
            Some(RopeScaling::Frequencies { divisors }) => {
                for (f, d) in inv_freq.iter_mut().zip(divisors) {
                    *f /= *d;
                }
            }
            None => {}
        }
        Self {
            inv_freq,
            head_dim: d,
        }
    }

    /// The inverse frequency of each rotated pair (the GPU kernels compute angles from them).
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// `(cos, sin)` tables of `positions.len() × head_dim/2`.
    pub fn cos_sin(&self, positions: &[usize]) -> (Vec<f32>, Vec<f32>) {
        let half = self.head_dim / 2;
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &f in &self.inv_freq {
                let angle = p as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        (cos, sin)
    }

    /// Rotates `heads` heads of every row in place: row `t` starts at `t * row_stride`, its
    /// heads at `col_offset` (so Q and K can be rotated inside a fused QKV row).
    pub fn apply(
        &self,
        x: &mut [f32],
        row_stride: usize,
        col_offset: usize,
        heads: usize,
        cos: &[f32],
        sin: &[f32],
    ) {
        let d = self.head_dim;
        on_isa!(super::isa(), fn(
            x: &mut [f32],
            d: usize,
            row_stride: usize,
            col_offset: usize,
            heads: usize,
            cos: &[f32],
            sin: &[f32],
        ) {
            let half = d / 2;
            for (t, row) in x.chunks_exact_mut(row_stride).enumerate() {
                let c = &cos[t * half..(t + 1) * half];
                let s = &sin[t * half..(t + 1) * half];
                for head in row[col_offset..col_offset + heads * d].chunks_exact_mut(d) {
                    let (a, b) = head.split_at_mut(half);
                    for i in 0..half {
                        let (x1, x2) = (a[i], b[i]);
                        a[i] = x1 * c[i] - x2 * s[i];
                        b[i] = x2 * c[i] + x1 * s[i];
                    }
                }
            }
        })
    }
}

/// Llama 3.1's frequency-dependent scaling of the inverse frequencies.
fn llama3_scale(inv_freq: &mut [f32], factor: f32, low: f32, high: f32, old_ctx: f32) {
    let low_wavelen = old_ctx / low;
    let high_wavelen = old_ctx / high;
    for f in inv_freq.iter_mut() {
        let wavelen = 2.0 * std::f32::consts::PI / *f;
        *f = if wavelen < high_wavelen {
            *f
        } else if wavelen > low_wavelen {
            *f / factor
        } else {
            let smooth = (old_ctx / wavelen - low) / (high - low);
            (1.0 - smooth) * *f / factor + smooth * *f
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inputs for the exponential: every region of it, the clamp's edges, and the values
    /// whose handling differs between instructions (NaN, infinities, signed zeros).
    fn exp_inputs() -> Vec<f32> {
        let mut x: Vec<f32> = (-2000..2000).map(|i| i as f32 * 0.0471).collect();
        x.extend([
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            -87.3,
            88.3,
            -87.31,
            88.31,
            f32::MAX,
            f32::MIN,
            1e-30,
        ]);
        x.resize(x.len().next_multiple_of(16), 1.0);
        x
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_vector_exponentials_give_the_scalar_bits() {
        use std::arch::x86_64::*;
        let x = exp_inputs();
        let want: Vec<u32> = x.iter().map(|&v| exp_poly(v).to_bits()).collect();
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            for (i, chunk) in x.chunks_exact(8).enumerate() {
                let mut got = [0f32; 8];
                // SAFETY: AVX2 and FMA were detected; 8 floats in and out.
                unsafe {
                    _mm256_storeu_ps(
                        got.as_mut_ptr(),
                        exp_poly_avx2(_mm256_loadu_ps(chunk.as_ptr())),
                    );
                }
                for (j, g) in got.iter().enumerate() {
                    assert_eq!(g.to_bits(), want[8 * i + j], "avx2, exp({})", chunk[j]);
                }
            }
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            for (i, chunk) in x.chunks_exact(16).enumerate() {
                let mut got = [0f32; 16];
                // SAFETY: AVX-512 F was detected; 16 floats in and out.
                unsafe {
                    _mm512_storeu_ps(
                        got.as_mut_ptr(),
                        exp_poly_avx512(_mm512_loadu_ps(chunk.as_ptr())),
                    );
                }
                for (j, g) in got.iter().enumerate() {
                    assert_eq!(g.to_bits(), want[16 * i + j], "avx512, exp({})", chunk[j]);
                }
            }
        }
    }

    #[test]
    fn rms_norm_unit_rows() {
        let x = [3.0, 4.0, 0.0, 0.0];
        let mut out = [0.0; 4];
        rms_norm(&x, &[1.0, 1.0, 2.0, 2.0], 0.0, &mut out);
        let rms = (25.0f32 / 4.0).sqrt();
        assert!((out[0] - 3.0 / rms).abs() < 1e-6 && (out[1] - 4.0 / rms).abs() < 1e-6);
    }

    #[test]
    fn rope_preserves_norm_and_position_zero_is_identity() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let rope = RopeTable::new(&cfg);
        let d = cfg.head_dim;
        let orig: Vec<f32> = (0..2 * d).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut x = orig.clone();
        let (c, s) = rope.cos_sin(&[0]);
        rope.apply(&mut x, 2 * d, 0, 2, &c, &s);
        assert_eq!(x, orig);
        let (c, s) = rope.cos_sin(&[1234]);
        rope.apply(&mut x, 2 * d, 0, 2, &c, &s);
        let n0: f32 = orig.iter().map(|v| v * v).sum();
        let n1: f32 = x.iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-3 * n0);
    }

    #[test]
    fn llama3_scaling_keeps_high_frequencies() {
        let cfg = ModelConfig::preset("llama-3.2-1b").unwrap();
        let scaled = RopeTable::new(&cfg);
        let plain = RopeTable::new(&ModelConfig {
            rope_scaling: None,
            ..cfg
        });
        assert_eq!(scaled.inv_freq[0], plain.inv_freq[0]);
        let last = plain.inv_freq.len() - 1;
        assert!((scaled.inv_freq[last] - plain.inv_freq[last] / 32.0).abs() < 1e-12);
    }

    #[test]
    fn silu_mul_matches_formula() {
        let gu = [1.0, -2.0, 3.0, 0.5];
        let mut out = [0.0; 2];
        silu_mul(&gu, 2, &mut out);
        let silu = |g: f32| g / (1.0 + (-g).exp());
        assert!((out[0] - silu(1.0) * 3.0).abs() < 1e-6);
        assert!((out[1] - silu(-2.0) * 0.5).abs() < 1e-6);
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin() * 5.0).collect();
        let want: f32 = logits.iter().map(|&l| (l - 5.0).exp()).sum();
        assert!((sum_exp(&logits, 5.0) - want).abs() < 1e-5 * want);
    }

    #[test]
    fn gelu_tanh_and_softcap_match_their_formulas() {
        let xs: Vec<f32> = (0..400).map(|i| (i as f32 - 200.0) * 0.07).collect();
        for &x in &xs {
            let want = x.tanh();
            assert!((tanh_poly(x) - want).abs() < 3e-7, "tanh({x})");
        }
        let gu: Vec<f32> = xs.iter().chain(&xs).copied().collect();
        let mut out = vec![0f32; 400];
        gelu_tanh_mul(&gu, 400, &mut out);
        for (&x, &o) in xs.iter().zip(&out) {
            let x64 = f64::from(x);
            let inner = (2.0 / std::f64::consts::PI).sqrt() * (x64 + 0.044715 * x64.powi(3));
            let want = 0.5 * x64 * (1.0 + inner.tanh()) * x64;
            assert!(
                (f64::from(o) - want).abs() < 1e-5 * want.abs().max(1.0),
                "gelu({x})"
            );
        }
        let mut capped = xs.clone();
        softcap(&mut capped, 3.0);
        for (&x, &c) in xs.iter().zip(&capped) {
            let want = 3.0 * (f64::from(x) / 3.0).tanh();
            assert!((f64::from(c) - want).abs() < 1e-6, "softcap({x})");
        }
    }

    #[test]
    fn every_instruction_set_gives_the_same_bits() {
        let gu: Vec<f32> = (0..2 * 3 * 100)
            .map(|i| (i as f32 * 0.731).sin() * 9.0)
            .collect();
        let mut scalar = vec![0f32; 300];
        silu_mul_on(super::super::Isa::Scalar, &gu, 100, &mut scalar);
        let want = sum_exp_on(super::super::Isa::Scalar, &gu, 9.0);
        let mut gelu_scalar = vec![0f32; 300];
        gelu_tanh_mul_on(super::super::Isa::Scalar, &gu, 100, &mut gelu_scalar);
        let mut cap_scalar = gu.clone();
        softcap_on(super::super::Isa::Scalar, &mut cap_scalar, 7.0);
        for isa in super::super::Isa::available() {
            let mut out = vec![0f32; 300];
            silu_mul_on(isa, &gu, 100, &mut out);
            assert!(
                out.iter()
                    .zip(&scalar)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{isa}"
            );
            assert_eq!(sum_exp_on(isa, &gu, 9.0).to_bits(), want.to_bits(), "{isa}");
            let same =
                |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            gelu_tanh_mul_on(isa, &gu, 100, &mut out);
            assert!(same(&out, &gelu_scalar), "gelu on {isa}");
            let mut capped = gu.clone();
            softcap_on(isa, &mut capped, 7.0);
            assert!(same(&capped, &cap_scalar), "softcap on {isa}");
        }
    }
}
