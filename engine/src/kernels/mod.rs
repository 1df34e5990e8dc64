//! CPU compute kernels of the forward pass: the batch-invariant matmul, paged attention, and
//! the small per-row operations (RMSNorm, RoPE, SwiGLU, softmax helpers).
//!
//! Why hand-written rather than candle's ops: every kernel here computes each output row with
//! the same instruction sequence whatever the batch size, the row's position in the batch or
//! the chunking of a prompt. So a sequence's logits are bit-identical whether it ran alone, in
//! a batch of 64, prefilled in one pass or in chunks, or on another worker of the same
//! machine type: disaggregated greedy output equals aggregated output token for token. A BLAS
//! (gemm) picks different kernels and blockings by matrix size, which breaks that.
//! candle stays the reference implementation the tests compare against.

pub mod attention;
pub mod matmul;
pub(crate) mod ops;
pub mod team;

pub use matmul::{Matrix, PANEL, WeightData, linear};
pub use ops::{RopeTable, add_in_place, rms_norm, silu_mul, sum_exp};

use std::sync::OnceLock;

/// The instruction set the kernels dispatch to, detected once per process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Avx512,
    Avx2,
    Scalar,
}

/// The best instruction set this CPU supports (`TANDEM_FORCE_SCALAR_KERNELS` is not read
/// here on purpose: libraries take no env vars; tests call the scalar paths directly).
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("f16c")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Isa::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("f16c")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    })
}

/// A raw output pointer shared by parallel tasks that write disjoint elements.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut(pub *mut f32);
// SAFETY: every user splits the output into disjoint regions, one per task.
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}
