//! tandem's KV cache as both the engine and the KV transports see it, and nothing else: what
//! two peers must agree on before one writes into the other's blocks ([`KvLayout`], its
//! dtypes and hash), the pool of fixed-size blocks ([`BlockPool`], [`SharedPool`]) with the
//! prefix cache's names for them ([`prefix`]), the memory
//! that holds them ([`KvCache`] over private or shared-memory [`KvStorage`], and the
//! shared-memory files' lifecycle in [`shm`]), and the geometry of a GPU engine's device pool
//! ([`device`]) with the conversion between the two cache layouts ([`staging`]).
//!
//! It knows no model and no network: the engine computes into these blocks, the transports
//! move them, and neither has to link the other.
//!
//! Follows vLLM's PagedAttention design (Kwon et al., SOSP'23): a sequence owns a block table
//! (logical block i → physical block id); attention reads blocks in place.

mod cache;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
mod error;
mod layout;
mod pool;
pub mod prefix;
pub mod shm;
pub mod staging;

pub use cache::{KvBlockWriter, KvCache, KvStorage, Parallel, TokenKv};
pub use device::{CopyRun, DeviceKv, DevicePoolLayout, ExportedKv, KvLocation, plan_layer_copy};
pub use error::{KvError, Result};
pub use layout::{KvDtype, KvLayout};
pub use pool::{BlockEvents, BlockPool, SharedPool};
pub use prefix::BlockHash;

/// Token slots per block.
pub const BLOCK_SIZE: usize = 16;

/// A block-table entry whose block was released because every layer's attention window has
/// moved past it (sliding-window models). Tables keep one entry per logical block, so
/// `table[pos / BLOCK_SIZE]` still names the block of `pos`; nothing reads a freed entry.
pub const FREED_BLOCK: u32 = u32::MAX;

/// Blocks needed to hold `tokens` tokens.
pub fn blocks_for(tokens: usize) -> usize {
    tokens.div_ceil(BLOCK_SIZE)
}
