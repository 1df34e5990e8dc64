//! `BlockPool`: O(1) allocation and release of physical KV blocks from a free stack, with a
//! reference count per block (the sequences of an `n > 1` request share their prompt's full
//! blocks, as do requests with a common prefix) so a double free or a foreign id is an error,
//! not corruption; the prefix cache's bookkeeping (full blocks named by [`BlockHash`], kept
//! when their last holder lets go and evicted least recently used only when blocks are
//! needed); and [`SharedPool`], the same behind a mutex for an engine and the threads that
//! reserve blocks for incoming KV.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::blocks_for;
use crate::error::{KvError, Result};
use crate::prefix::BlockHash;

/// The blocks of a KV cache: free, held, or cached (named, held by nobody, evictable).
#[derive(Debug, Clone)]
pub struct BlockPool {
    /// Blocks with no name and no holder.
    free: Vec<u32>,
    /// Holders of each block (0: free or cached).
    refs: Vec<u32>,
    /// The name of each block whose KV is a known prefix block.
    names: Vec<Option<BlockHash>>,
    by_name: HashMap<BlockHash, u32>,
    /// Named blocks nobody holds, by when their last holder let go (oldest evicted first).
    idle: BTreeMap<u64, u32>,
    idle_since: Vec<u64>,
    clock: u64,
    evictions: u64,
    /// What happened to names lately (`true`: stored, `false`: removed), for a router that
    /// follows this cache from a cursor (see [`BlockPool::events_since`]).
    log: VecDeque<(BlockHash, bool)>,
    /// The sequence number of `log[0]`: events before it were dropped.
    log_start: u64,
}

/// The most events a pool keeps for its followers (a follower further behind gets a
/// snapshot).
const EVENT_LOG_MIN: usize = 4096;

/// What changed in a pool's names after a follower's cursor, or a page of a snapshot of them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockEvents {
    /// This is a snapshot's first page: forget everything known before, then take `stored`.
    pub snapshot: bool,
    /// Names now cached (each at most once; none of them also in `removed`).
    pub stored: Vec<BlockHash>,
    /// Names no longer cached.
    pub removed: Vec<BlockHash>,
    /// The cursor for the next call.
    pub next: u64,
    /// A snapshot goes on from this block id in the next call (0: it is complete).
    pub next_block: u32,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        // Reversed so that block 0 is handed out first (easier to read in logs and tests).
        Self {
            free: (0..num_blocks as u32).rev().collect(),
            refs: vec![0; num_blocks],
            names: vec![None; num_blocks],
            by_name: HashMap::new(),
            idle: BTreeMap::new(),
            idle_since: vec![0; num_blocks],
            clock: 0,
            evictions: 0,
            log: VecDeque::new(),
            log_start: 0,
        }
    }

    fn record(&mut self, name: BlockHash, stored: bool) {
        if self.log.len() >= EVENT_LOG_MIN.max(2 * self.refs.len()) {
            self.log.pop_front();
            self.log_start += 1;
        }
        self.log.push_back((name, stored));
    }

    /// What a follower at `cursor` (a value an earlier call returned as `next`) reads next:
    /// the names stored and removed since, at most `limit` events' worth; or, when the
    /// cursor is not one of this pool's (another process's, or too far behind), a snapshot,
    /// in pages of at most `limit` names by block id (`next_block` says where the next page
    /// starts; pass it back as `from_block`). A snapshot's pages keep the cursor of its
    /// start, so the events during it follow once it is complete. Changes of one name within
    /// a page of events cancel out, so the two lists are disjoint.
    pub fn events_since(&self, cursor: u64, from_block: u32, limit: usize) -> BlockEvents {
        let end = self.log_start + self.log.len() as u64;
        let fresh = cursor < self.log_start || cursor > end;
        if fresh || from_block > 0 {
            let start = if fresh { 0 } else { from_block as usize };
            let mut stored = Vec::new();
            let mut next_block = 0;
            for (b, name) in self.names.iter().enumerate().skip(start) {
                let Some(name) = name else { continue };
                if stored.len() == limit.max(1) {
                    next_block = b as u32;
                    break;
                }
                stored.push(*name);
            }
            return BlockEvents {
                snapshot: fresh,
                stored,
                removed: Vec::new(),
                next: if fresh { end } else { cursor },
                next_block,
            };
        }
        let skip = (cursor - self.log_start) as usize;
        let mut last: HashMap<BlockHash, bool> = HashMap::new();
        let mut order = Vec::new();
        let page = self.log.iter().skip(skip).take(limit);
        let taken = page.len();
        for &(name, stored) in page {
            if last.insert(name, stored).is_none() {
                order.push(name);
            }
        }
        let (mut stored, mut removed) = (Vec::new(), Vec::new());
        for name in order {
            if last[&name] {
                stored.push(name);
            } else {
                removed.push(name);
            }
        }
        BlockEvents {
            snapshot: false,
            stored,
            removed,
            next: cursor + taken as u64,
            next_block: 0,
        }
    }

    pub fn total(&self) -> usize {
        self.refs.len()
    }

    /// Blocks an allocation may take: free ones, and cached ones nobody holds (evicted).
    pub fn free_count(&self) -> usize {
        self.free.len() + self.idle.len()
    }

    pub fn used_count(&self) -> usize {
        self.total() - self.free_count()
    }

    /// Cached blocks nobody holds (counted as free).
    pub fn cached_idle_count(&self) -> usize {
        self.idle.len()
    }

    /// Named blocks, held or not.
    pub fn named_count(&self) -> usize {
        self.by_name.len()
    }

    /// Cached blocks evicted so far to make room.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Takes `n` blocks, or none at all when fewer are free: unnamed ones first, then the
    /// least recently used cached ones (which lose their names).
    pub fn allocate(&mut self, n: usize) -> Result<Vec<u32>> {
        if n > self.free_count() {
            return Err(KvError::OutOfBlocks {
                needed: n,
                free: self.free_count(),
            });
        }
        let from_free = n.min(self.free.len());
        let mut blocks = self.free.split_off(self.free.len() - from_free);
        while blocks.len() < n {
            match self.evict_one() {
                Some(b) => blocks.push(b),
                None => break,
            }
        }
        for &b in &blocks {
            self.refs[b as usize] = 1;
        }
        Ok(blocks)
    }

    /// One more block, for a sequence that grows during decode.
    pub fn allocate_one(&mut self) -> Result<u32> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => self
                .evict_one()
                .ok_or(KvError::OutOfBlocks { needed: 1, free: 0 })?,
        };
        self.refs[b as usize] = 1;
        Ok(b)
    }

    /// The least recently released cached block, unnamed.
    fn evict_one(&mut self) -> Option<u32> {
        let (_, b) = self.idle.pop_first()?;
        if let Some(name) = self.names[b as usize].take() {
            self.by_name.remove(&name);
            self.record(name, false);
        }
        self.evictions += 1;
        Some(b)
    }

    /// The longest run of `names` (a prefix's block names, in order) that is cached: each
    /// block found gets one more holder (the caller), and comes out of the eviction order.
    pub fn lookup(&mut self, names: &[BlockHash]) -> Vec<u32> {
        let mut found = Vec::new();
        for name in names {
            let Some(&b) = self.by_name.get(name) else {
                break;
            };
            if self.refs[b as usize] == 0 {
                self.idle.remove(&self.idle_since[b as usize]);
            }
            self.refs[b as usize] += 1;
            found.push(b);
        }
        found
    }

    /// How many of `names` (in order, from the first) are cached, without holding them.
    pub fn cached_run(&self, names: &[BlockHash]) -> usize {
        names
            .iter()
            .take_while(|n| self.by_name.contains_key(n))
            .count()
    }

    /// Names a held block whose KV is now complete and will not change (a full block of a
    /// sequence). A name another block already has, or a block already named, stays as it is.
    pub fn name(&mut self, block: u32, name: BlockHash) -> Result<()> {
        if !self.is_allocated(block) {
            return Err(KvError::InvalidKv(format!(
                "block {block} named but not allocated"
            )));
        }
        if self.names[block as usize].is_none() && !self.by_name.contains_key(&name) {
            self.names[block as usize] = Some(name);
            self.by_name.insert(name, block);
            self.record(name, true);
        }
        Ok(())
    }

    /// Whether a block with this name is cached (held or not).
    pub fn is_cached(&self, name: &BlockHash) -> bool {
        self.by_name.contains_key(name)
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
            if *refs > 0 {
                continue;
            }
            if self.names[b as usize].is_some() {
                // Kept for a later prompt with the same prefix, until the space is needed.
                self.clock += 1;
                self.idle_since[b as usize] = self.clock;
                self.idle.insert(self.clock, b);
            } else {
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

    /// See [`BlockPool::events_since`].
    pub fn events_since(&self, cursor: u64, from_block: u32, limit: usize) -> BlockEvents {
        self.lock().events_since(cursor, from_block, limit)
    }

    /// The prefix cache's `(evictions so far, named blocks now)`.
    pub fn cache_counts(&self) -> (u64, usize) {
        let pool = self.lock();
        (pool.evictions(), pool.named_count())
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
    fn named_blocks_stay_cached_until_their_space_is_needed_oldest_first() {
        let mut pool = BlockPool::new(4);
        let a = pool.allocate(3).unwrap();
        pool.name(a[0], 10).unwrap();
        pool.name(a[1], 11).unwrap();
        pool.name(a[2], 10).unwrap(); // a name already taken stays with its block
        assert!(pool.name(3, 12).is_err(), "block 3 is free");
        pool.release(&[a[1]]).unwrap();
        pool.release(&[a[0]]).unwrap();
        pool.release(&[a[2]]).unwrap();
        assert_eq!((pool.free_count(), pool.cached_idle_count()), (4, 2));
        // A lookup holds the cached run and stops at the first miss.
        assert_eq!(pool.cached_run(&[10, 11, 12]), 2);
        assert_eq!(pool.cached_run(&[11, 10]), 2);
        assert_eq!(pool.cached_run(&[12, 10]), 0);
        assert_eq!(pool.lookup(&[10, 11, 12]), vec![a[0], a[1]]);
        assert_eq!(pool.lookup(&[11]), vec![a[1]], "held twice now");
        assert_eq!(pool.free_count(), 2);
        pool.release(&[a[0], a[1]]).unwrap();
        pool.release(&[a[1]]).unwrap();
        // Needing every block evicts the cached ones, the least recently released first.
        let all = pool.allocate(4).unwrap();
        assert_eq!(all.len(), 4);
        assert_eq!(pool.evictions(), 2);
        assert!(pool.lookup(&[10]).is_empty() && pool.lookup(&[11]).is_empty());
        assert!(pool.allocate_one().is_err());
        pool.release(&all).unwrap();
        let mut pool = BlockPool::new(2);
        let b = pool.allocate(2).unwrap();
        pool.name(b[0], 1).unwrap();
        pool.name(b[1], 2).unwrap();
        pool.release(&[b[1]]).unwrap();
        pool.release(&[b[0]]).unwrap();
        assert_eq!(
            pool.allocate_one().unwrap(),
            b[1],
            "released first, evicted first"
        );
        assert!(pool.is_cached(&1) && !pool.is_cached(&2));
    }

    #[test]
    fn followers_see_names_come_and_go_or_get_a_snapshot() {
        let mut pool = BlockPool::new(2);
        let start = pool.events_since(u64::MAX, 0, 100);
        assert!(start.snapshot && start.stored.is_empty() && start.next == 0);
        let a = pool.allocate(2).unwrap();
        pool.name(a[0], 7).unwrap();
        pool.name(a[1], 8).unwrap();
        let page = pool.events_since(0, 0, 1);
        assert_eq!((page.stored.as_slice(), page.next), (&[7][..], 1));
        let page = pool.events_since(page.next, 0, 100);
        assert_eq!((page.stored.as_slice(), page.next), (&[8][..], 2));
        pool.release(&a).unwrap();
        // Evicting 7 (released first) and naming its block 9 come out as two changes.
        let b = pool.allocate_one().unwrap();
        pool.name(b, 9).unwrap();
        let page = pool.events_since(2, 0, 100);
        assert!(!page.snapshot);
        assert_eq!(
            (page.stored, page.removed, page.next),
            (vec![9], vec![7], 4)
        );
        // A name stored and removed within one page cancels out into `removed`.
        let c = pool.allocate_one().unwrap();
        pool.name(c, 10).unwrap();
        pool.release(&[b, c]).unwrap();
        pool.allocate(2).unwrap();
        let page = pool.events_since(4, 0, 100);
        assert_eq!(page.stored, Vec::<u128>::new());
        assert_eq!(page.removed.len(), 3, "8 is evicted too: {page:?}");
        // A cursor from the future (another process) gets a snapshot.
        let snap = pool.events_since(1_000, 0, 100);
        assert!(snap.snapshot && snap.stored.is_empty());
    }

    #[test]
    fn a_snapshot_comes_in_pages_by_block_and_the_events_during_it_follow() {
        let mut pool = BlockPool::new(8);
        let blocks = pool.allocate(7).unwrap();
        for (i, &b) in blocks.iter().enumerate() {
            pool.name(b, 100 + i as u128).unwrap();
        }
        let first = pool.events_since(u64::MAX, 0, 3);
        assert!(first.snapshot);
        assert_eq!((first.stored.len(), first.next), (3, 7));
        assert_ne!(first.next_block, 0);
        // Meanwhile a name comes and one goes.
        pool.release(&blocks[..1]).unwrap();
        let extra = pool.allocate(1).unwrap()[0];
        pool.name(extra, 200).unwrap();
        let mut all = first.stored.clone();
        let mut page = first;
        while page.next_block != 0 {
            page = pool.events_since(page.next, page.next_block, 3);
            assert!(
                !page.snapshot && page.next == 7,
                "pages keep the start's cursor"
            );
            all.extend(&page.stored);
        }
        let mut got: Vec<u128> = all.clone();
        got.sort_unstable();
        got.dedup();
        assert_eq!(got.len(), all.len(), "each name once");
        assert!(got.len() >= 7);
        // Then the events since the snapshot began: the new name.
        let tail = pool.events_since(page.next, 0, 100);
        assert!(tail.stored.contains(&200));
    }

    #[test]
    fn the_event_log_is_bounded_and_a_follower_left_behind_gets_a_snapshot() {
        let mut pool = BlockPool::new(1);
        for name in 0..(EVENT_LOG_MIN as u128 + 10) {
            let b = pool.allocate_one().unwrap();
            pool.name(b, name).unwrap();
            pool.release(&[b]).unwrap();
        }
        assert!(pool.log.len() <= EVENT_LOG_MIN);
        let snap = pool.events_since(0, 0, 100);
        assert!(snap.snapshot);
        assert_eq!(snap.stored, vec![EVENT_LOG_MIN as u128 + 9]);
        let tail = pool.events_since(snap.next, 0, 100);
        assert!(!tail.snapshot && tail.stored.is_empty() && tail.removed.is_empty());
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
