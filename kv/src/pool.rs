//! `BlockPool`: O(1) allocation and release of physical KV blocks from a free stack, with a
//! reference count per block (the sequences of an `n > 1` request share their prompt's full
//! blocks) so a double free or a foreign id is an error, not corruption; and
//! [`SharedPool`], the same behind a mutex for an engine and the threads that reserve blocks
//! for incoming KV.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::blocks_for;
use crate::error::{KvError, Result};

/// The free list of a KV cache's blocks.
#[derive(Debug, Clone)]
pub struct BlockPool {
    free: Vec<u32>,
    /// Holders of each block (0: free).
    refs: Vec<u32>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        // Reversed so that block 0 is handed out first (easier to read in logs and tests).
        Self {
            free: (0..num_blocks as u32).rev().collect(),
            refs: vec![0; num_blocks],
        }
    }

    pub fn total(&self) -> usize {
        self.refs.len()
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
            self.refs[b as usize] = 1;
        }
        Ok(blocks)
    }

    /// One more block, for a sequence that grows during decode.
    pub fn allocate_one(&mut self) -> Result<u32> {
        let b = self
            .free
            .pop()
            .ok_or(KvError::OutOfBlocks { needed: 1, free: 0 })?;
        self.refs[b as usize] = 1;
        Ok(b)
    }

    /// One more holder for each of `blocks` (all allocated, or nothing changes): a sequence
    /// that shares them with the one that wrote them. Each holder releases them once.
    pub fn share(&mut self, blocks: &[u32]) -> Result<()> {
        if let Some(&b) = blocks.iter().find(|&&b| !self.is_allocated(b)) {
            return Err(KvError::InvalidKv(format!(
                "block {b} shared but not allocated"
            )));
        }
        for &b in blocks {
            self.refs[b as usize] += 1;
        }
        Ok(())
    }

    /// How many holders `b` has (0: free or unknown).
    pub fn holders(&self, b: u32) -> u32 {
        self.refs.get(b as usize).copied().unwrap_or(0)
    }

    /// Drops one holder of each block; a block with none left goes back to the pool. Ids that
    /// are not currently allocated (or repeated: one holder releases a block once) are
    /// rejected as a whole, before anything is released.
    pub fn release(&mut self, blocks: &[u32]) -> Result<()> {
        let mut seen = std::collections::HashSet::with_capacity(blocks.len());
        for &b in blocks {
            if !self.is_allocated(b) || !seen.insert(b) {
                return Err(KvError::InvalidKv(format!(
                    "block {b} released but not allocated"
                )));
            }
        }
        for &b in blocks {
            let refs = &mut self.refs[b as usize];
            *refs -= 1;
            if *refs == 0 {
                self.free.push(b);
            }
        }
        Ok(())
    }

    /// Whether `b` is currently allocated.
    pub fn is_allocated(&self, b: u32) -> bool {
        self.holders(b) > 0
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

    #[test]
    fn shared_blocks_are_free_after_their_last_holder() {
        let mut pool = BlockPool::new(3);
        let a = pool.allocate(2).unwrap();
        pool.share(&a).unwrap();
        pool.share(&a[..1]).unwrap();
        assert_eq!((pool.holders(a[0]), pool.holders(a[1])), (3, 2));
        assert!(pool.share(&[a[0], 2]).is_err(), "block 2 is free");
        assert_eq!(pool.holders(a[0]), 3, "a refused share changes nothing");
        pool.release(&a).unwrap();
        assert_eq!(pool.free_count(), 1, "both still held");
        pool.release(&a).unwrap();
        assert_eq!(pool.free_count(), 2, "a[1] had two holders");
        pool.release(&a[..1]).unwrap();
        assert_eq!(pool.free_count(), 3);
        assert!(
            pool.release(&a[..1]).is_err(),
            "released more often than held"
        );
    }
}
