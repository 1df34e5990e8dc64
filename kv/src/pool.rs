//! `BlockPool`: O(1) allocation and release of physical KV blocks from a free stack, with an
//! ownership bit per block so a double free or a foreign id is an error, not corruption; and
//! [`SharedPool`], the same behind a mutex for an engine and the threads that reserve blocks
//! for incoming KV.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::blocks_for;
use crate::error::{KvError, Result};

/// The free list of a KV cache's blocks.
#[derive(Debug, Clone)]
pub struct BlockPool {
    free: Vec<u32>,
    in_use: Vec<bool>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        // Reversed so that block 0 is handed out first (easier to read in logs and tests).
        Self {
            free: (0..num_blocks as u32).rev().collect(),
            in_use: vec![false; num_blocks],
        }
    }

    pub fn total(&self) -> usize {
        self.in_use.len()
    }

    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    pub fn used_count(&self) -> usize {
        self.total() - self.free_count()
    }

    /// Takes `n` blocks, or none at all when fewer are free.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<u32>> {
        if n > self.free.len() {
            return Err(KvError::OutOfBlocks {
                needed: n,
                free: self.free.len(),
            });
        }
        let blocks = self.free.split_off(self.free.len() - n);
        for &b in &blocks {
            self.in_use[b as usize] = true;
        }
        Ok(blocks)
    }

    /// One more block, for a sequence that grows during decode.
    pub fn allocate_one(&mut self) -> Result<u32> {
        let b = self
            .free
            .pop()
            .ok_or(KvError::OutOfBlocks { needed: 1, free: 0 })?;
        self.in_use[b as usize] = true;
        Ok(b)
    }

    /// Returns blocks to the pool. Ids that are not currently allocated are rejected as a
    /// whole, before anything is freed.
    pub fn release(&mut self, blocks: &[u32]) -> Result<()> {
        let mut seen = std::collections::HashSet::with_capacity(blocks.len());
        for &b in blocks {
            if !self.in_use.get(b as usize).copied().unwrap_or(false) || !seen.insert(b) {
                return Err(KvError::InvalidKv(format!(
                    "block {b} released but not allocated"
                )));
            }
        }
        for &b in blocks {
            self.in_use[b as usize] = false;
            self.free.push(b);
        }
        Ok(())
    }

    /// Whether `b` is currently allocated.
    pub fn is_allocated(&self, b: u32) -> bool {
        self.in_use.get(b as usize).copied().unwrap_or(false)
    }
}

/// The block pool behind a mutex, shared by an engine and the threads that reserve blocks
/// for incoming KV.
#[derive(Debug, Clone)]
pub struct SharedPool(Arc<Mutex<BlockPool>>);

impl SharedPool {
    pub fn new(blocks: usize) -> Self {
        Self(Arc::new(Mutex::new(BlockPool::new(blocks))))
    }

    /// The pool itself, for the engine's scheduler (which allocates and frees under it).
    pub fn lock(&self) -> MutexGuard<'_, BlockPool> {
        // A panic elsewhere cannot leave the pool half-updated (every method is one step).
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reserves blocks for `tokens` tokens.
    pub fn reserve(&self, tokens: usize) -> Result<Vec<u32>> {
        if tokens == 0 {
            return Err(KvError::EmptyReservation);
        }
        self.reserve_blocks(blocks_for(tokens))
    }

    /// Reserves `needed` blocks (a sliding-window sequence needs only its window's).
    pub fn reserve_blocks(&self, needed: usize) -> Result<Vec<u32>> {
        if needed == 0 {
            return Err(KvError::EmptyReservation);
        }
        let mut pool = self.lock();
        if needed > pool.total() {
            return Err(KvError::TooManyBlocks {
                needed,
                total: pool.total(),
            });
        }
        pool.allocate(needed)
    }

    pub fn release(&self, blocks: &[u32]) -> Result<()> {
        self.lock().release(blocks)
    }

    pub fn total(&self) -> usize {
        self.lock().total()
    }

    pub fn free_count(&self) -> usize {
        self.lock().free_count()
    }

    pub fn used_count(&self) -> usize {
        self.lock().used_count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_release_cycle() {
        let mut pool = BlockPool::new(4);
        let a = pool.allocate(3).unwrap();
        assert_eq!(pool.free_count(), 1);
        assert!(matches!(
            pool.allocate(2),
            Err(KvError::OutOfBlocks { needed: 2, free: 1 })
        ));
        assert_eq!(pool.free_count(), 1, "a failed allocation takes nothing");
        let b = pool.allocate_one().unwrap();
        assert!(pool.allocate_one().is_err());
        pool.release(&a).unwrap();
        pool.release(&[b]).unwrap();
        assert_eq!(pool.free_count(), 4);
    }

    #[test]
    fn double_and_foreign_frees_are_rejected() {
        let mut pool = BlockPool::new(2);
        let a = pool.allocate(1).unwrap();
        pool.release(&a).unwrap();
        assert!(pool.release(&a).is_err());
        assert!(pool.release(&[99]).is_err());
        let b = pool.allocate(2).unwrap();
        assert!(pool.release(&[b[0], b[0]]).is_err());
        assert_eq!(pool.used_count(), 2, "a rejected release frees nothing");
    }
}
