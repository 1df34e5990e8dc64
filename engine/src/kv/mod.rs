//! The paged KV cache: fixed-size blocks of 16 token slots, a pool that hands them out in
//! O(1), and the memory region that holds them (private memory, or a shared-memory file that a
//! prefill worker on the same host writes into directly).
//!
//! Follows vLLM's PagedAttention design (Kwon et al., SOSP'23): a sequence owns a block table
//! (logical block i → physical block id); attention reads blocks in place.

mod cache;
pub mod device;
mod layout;
mod pool;
pub mod staging;

pub use cache::{KvBlockWriter, KvCache, KvStorage};
pub use device::{CopyRun, DeviceKv, ExportedKv, plan_layer_copy};
pub use layout::{KvDtype, KvLayout};
pub use pool::BlockPool;

/// Token slots per block.
pub const BLOCK_SIZE: usize = 16;

/// Blocks needed to hold `tokens` tokens.
pub fn blocks_for(tokens: usize) -> usize {
    tokens.div_ceil(BLOCK_SIZE)
}
