//! CPU compute kernels of the forward pass: the batch-invariant matmul, paged attention, and
//! the small per-row operations (RMSNorm, RoPE, SwiGLU and GeGLU, soft-capping, softmax
//! helpers).
//!
//! Why hand-written rather than candle's ops: every kernel here computes each output row with
//! the same instruction sequence whatever the batch size, the row's position in the batch or
//! the chunking of a prompt. So a sequence's logits are bit-identical whether it ran alone, in
//! a batch of 64, prefilled in one pass or in chunks, or on another worker of the same
//! machine type: disaggregated greedy output equals aggregated output token for token. A BLAS
//! (gemm) picks different kernels and blockings by matrix size, which breaks that.
//! candle stays the reference implementation the tests compare against.
//!
//! The same holds across instruction sets ([`isa`]): the AVX-512, AVX2, NEON and portable
//! paths differ in how many outputs share a load, never in the order of an element's sum, so
//! a prefill host and a decode host with different CPUs still agree bit for bit.

pub mod attention;
pub mod compute;
pub mod isa;
pub mod matmul;
pub(crate) mod ops;
pub mod quant;
pub mod team;

pub use compute::{
    COMPUTE_ENV, ComputeChoice, ComputeDecision, ComputeError, ComputeMode, compute_decision,
    compute_mode, select_compute,
};
pub use isa::{ISA_ENV, Isa, IsaError, isa, isa_from_env, select_isa};
pub use matmul::{Matrix, PANEL, WeightData, linear, linear_on};
pub use ops::{
    RopeTable, add_in_place, gelu_tanh_mul, rms_norm, rms_norm_heads, silu_mul, softcap, sum_exp,
};
pub use quant::{Arrangement, IntTile, QuantError, QuantKind, QuantPanels};

/// A raw output pointer shared by parallel tasks that write disjoint elements.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut(pub *mut f32);
// SAFETY: every user splits the output into disjoint regions, one per task.
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}
