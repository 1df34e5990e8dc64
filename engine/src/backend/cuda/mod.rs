//! The device backend: the forward pass as a list of kernel launches and GEMMs, written once
//! over a small device interface ([`launch::LaunchDevice`]) and run by [`DeviceBackend`].
//!
//! Everything here but [`gpu`] compiles without CUDA: the tests run the whole pass, the KV
//! staging and the backend on an emulated device that executes the very kernels of
//! `kernels.cu` on the CPU (`engine/tests/gpu_*_on_cpu.rs`). [`gpu`] (feature `cuda`) is the
//! CUDA device: contexts, green contexts, NVRTC, cuBLAS.
//!
//! - [`launch`]: the device interface and the kernels' names and argument lists.
//! - [`forward`]: the Llama forward pass and its reused step buffers.
//! - [`attention`]: one layer's attention: tiles and context splits of the tensor-core kernel.
//! - [`staging`]: packing the pool's blocks for the host and back.
//! - [`blas`]: how the pass's row-major products map onto cuBLAS's column-major GEMM.

pub mod attention;
pub mod blas;
mod device_backend;
pub mod forward;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod launch;
pub mod staging;

pub use device_backend::{DeviceBackend, written_blocks};

/// The kernels' CUDA C source (compiled at run time by NVRTC; run on the CPU by the tests).
pub const KERNELS_SRC: &str = include_str!("kernels.cu");
