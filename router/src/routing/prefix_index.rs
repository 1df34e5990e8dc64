//! The router's picture of each worker's prefix cache: the names of the blocks it holds
//! (tandem-kv's prefix hashes), followed from the block events on its load reports, plus the
//! prompts this router sent it since (so a conversation's next turn finds its worker before
//! the worker's next report says what it cached).
//!
//! It is a hint for routing, never trusted for correctness: the workers look prompts up in
//! their own caches. So it may lag or miss, and it is bounded whatever a worker reports: at
//! most the worker's block count (itself capped) of names, and as many recent ones.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use tandem_kv::BlockHash;
use tandem_kv::prefix::names_from_bytes;
use tandem_proto::v1::BlockEvents;

/// The most names kept for one worker, whatever its reported pool size (16 MiB of names).
const MAX_NAMES: usize = 1 << 20;

/// How long a dispatched prompt's names count as cached there without the worker saying so
/// (a few load reports; a request that failed is forgotten after it).
const RECENT_TTL: Duration = Duration::from_secs(10);

/// A prompt's block names, computed once per salt (workers of one layout share a salt).
#[derive(Debug)]
pub struct PromptNames<'a> {
    tokens: &'a [u32],
    by_salt: Vec<(BlockHash, Vec<BlockHash>)>,
}

impl<'a> PromptNames<'a> {
    pub fn new(tokens: &'a [u32]) -> Self {
        Self {
            tokens,
            by_salt: Vec::new(),
        }
    }

    /// The names of the prompt's full blocks under `salt`.
    pub fn under(&mut self, salt: BlockHash) -> &[BlockHash] {
        let i = match self.by_salt.iter().position(|(s, _)| *s == salt) {
            Some(i) => i,
            None => {
                let names = tandem_kv::prefix::hashes(salt, self.tokens);
                self.by_salt.push((salt, names));
                self.by_salt.len() - 1
            }
        };
        &self.by_salt[i].1
    }
}

/// Why a report's block events were not applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    #[error("a block name list is not a whole number of 16-byte names")]
    TornNames,
}

/// One worker's cached block names as the router knows them.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    names: HashSet<BlockHash>,
    /// The instance whose events were applied, and the cursor for its next report.
    instance: Vec<u8>,
    cursor: Option<u64>,
    /// A snapshot under way goes on from this block (0: none).
    snapshot_block: u32,
    /// Names of prompts dispatched to the worker, by when.
    recent: HashMap<BlockHash, Instant>,
    /// Its last report came without block events, which every report asks for: the worker
    /// caches no prefixes, and what is sent to it is not noted.
    caches_nothing: bool,
}

impl PrefixIndex {
    /// The cursor to ask the next report's events after (`u64::MAX`, which no worker has
    /// reached, asks for a snapshot).
    pub fn cursor(&self) -> u64 {
        self.cursor.unwrap_or(u64::MAX)
    }

    /// Where the snapshot under way goes on (0: none).
    pub fn snapshot_block(&self) -> u32 {
        self.snapshot_block
    }

    /// Names known cached (the worker's own, not the recent dispatches).
    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// Applies a report from `instance` of a worker with `total_blocks` blocks. A report of
    /// another instance (the worker restarted) starts over: only a snapshot is applied then.
    pub fn apply(
        &mut self,
        instance: &[u8],
        total_blocks: u32,
        events: Option<&BlockEvents>,
        now: Instant,
    ) -> Result<(), IndexError> {
        self.recent
            .retain(|_, at| now.duration_since(*at) < RECENT_TTL);
        if self.instance != instance {
            self.names.clear();
            self.recent.clear();
            self.cursor = None;
            self.snapshot_block = 0;
            self.instance = instance.to_vec();
        }
        let Some(events) = events else {
            self.caches_nothing = true;
            self.names.clear();
            self.recent.clear();
            return Ok(());
        };
        self.caches_nothing = false;
        if self.cursor.is_none() && !events.snapshot {
            return Ok(());
        }
        let stored = names_from_bytes(&events.stored).ok_or(IndexError::TornNames)?;
        let removed = names_from_bytes(&events.removed).ok_or(IndexError::TornNames)?;
        if events.snapshot {
            self.names.clear();
        }
        for name in &removed {
            self.names.remove(name);
        }
        let cap = (total_blocks as usize).min(MAX_NAMES);
        for name in stored {
            if self.names.len() >= cap {
                break;
            }
            self.recent.remove(&name);
            self.names.insert(name);
        }
        self.cursor = Some(events.next);
        self.snapshot_block = events.next_block;
        Ok(())
    }

    /// Notes that a prompt with these block names was just sent to the worker.
    pub fn note_dispatched(&mut self, names: &[BlockHash], now: Instant) {
        if self.caches_nothing {
            return;
        }
        if self.recent.len() + names.len() > MAX_NAMES {
            self.recent.clear();
        }
        for &name in names.iter().take(MAX_NAMES) {
            if !self.names.contains(&name) {
                self.recent.insert(name, now);
            }
        }
    }

    /// How many of `names` (a prompt's block names, in order) the worker holds from the
    /// start on: its longest cached prefix, in blocks.
    pub fn overlap(&self, names: &[BlockHash]) -> usize {
        names
            .iter()
            .take_while(|n| self.names.contains(n) || self.recent.contains_key(n))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use tandem_kv::prefix::names_to_bytes;

    use super::*;

    fn events(snapshot: bool, stored: &[u128], removed: &[u128], next: u64) -> BlockEvents {
        BlockEvents {
            snapshot,
            stored: names_to_bytes(stored),
            removed: names_to_bytes(removed),
            next,
            next_block: 0,
        }
    }

    #[test]
    fn a_snapshot_in_pages_adds_up_and_is_asked_for_page_by_page() {
        let now = Instant::now();
        let mut index = PrefixIndex::default();
        let mut first = events(true, &[1, 2], &[], 9);
        first.next_block = 5;
        index.apply(b"a", 100, Some(&first), now).unwrap();
        assert_eq!((index.cursor(), index.snapshot_block()), (9, 5));
        let mut second = events(false, &[3], &[], 9);
        second.next_block = 0;
        index.apply(b"a", 100, Some(&second), now).unwrap();
        assert_eq!((index.len(), index.snapshot_block()), (3, 0));
        assert_eq!(index.overlap(&[1, 2, 3]), 3);
    }

    #[test]
    fn follows_a_worker_from_a_snapshot_through_its_events() {
        let now = Instant::now();
        let mut index = PrefixIndex::default();
        assert_eq!(
            index.cursor(),
            u64::MAX,
            "the first report asks for a snapshot"
        );
        // Events before a snapshot mean nothing: they are ignored.
        index
            .apply(b"a", 100, Some(&events(false, &[1], &[], 1)), now)
            .unwrap();
        assert!(index.is_empty());
        index
            .apply(b"a", 100, Some(&events(true, &[1, 2, 3], &[], 3)), now)
            .unwrap();
        assert_eq!((index.len(), index.cursor()), (3, 3));
        index
            .apply(b"a", 100, Some(&events(false, &[4], &[2], 5)), now)
            .unwrap();
        assert_eq!(index.overlap(&[1, 2, 3]), 1);
        assert_eq!(index.overlap(&[1, 3, 4]), 3);
        assert_eq!(index.overlap(&[9, 1]), 0, "a prefix, from the first block");
        // A restart (another instance) forgets everything until the next snapshot.
        index
            .apply(b"b", 100, Some(&events(false, &[7], &[], 9)), now)
            .unwrap();
        assert!(index.is_empty());
        assert_eq!(index.cursor(), u64::MAX);
    }

    #[test]
    fn bounded_and_torn_lists_refused() {
        let now = Instant::now();
        let mut index = PrefixIndex::default();
        let many: Vec<u128> = (0..50).collect();
        index
            .apply(b"a", 10, Some(&events(true, &many, &[], 50)), now)
            .unwrap();
        assert_eq!(index.len(), 10, "no more names than the worker has blocks");
        let mut torn = events(false, &[1], &[], 51);
        torn.stored.pop();
        assert_eq!(
            index.apply(b"a", 10, Some(&torn), now),
            Err(IndexError::TornNames)
        );
        assert_eq!(index.cursor(), 50, "a refused report moves nothing");
    }

    #[test]
    fn dispatched_prompts_count_until_the_worker_reports_or_they_expire() {
        let now = Instant::now();
        let mut index = PrefixIndex::default();
        let quiet = |next| events(false, &[], &[], next);
        index
            .apply(b"a", 10, Some(&events(true, &[], &[], 0)), now)
            .unwrap();
        index.note_dispatched(&[5, 6], now);
        assert_eq!(index.overlap(&[5, 6, 7]), 2);
        index
            .apply(b"a", 10, Some(&quiet(0)), now + Duration::from_secs(1))
            .unwrap();
        assert_eq!(index.overlap(&[5, 6, 7]), 2, "still recent");
        index
            .apply(
                b"a",
                10,
                Some(&events(false, &[5], &[], 1)),
                now + Duration::from_secs(2),
            )
            .unwrap();
        assert_eq!(index.overlap(&[5, 6, 7]), 2, "5 reported, 6 still recent");
        index
            .apply(b"a", 10, Some(&quiet(1)), now + RECENT_TTL)
            .unwrap();
        assert_eq!(index.overlap(&[5, 6, 7]), 1, "6 expired");
    }

    #[test]
    fn a_worker_that_caches_nothing_is_credited_with_nothing() {
        let now = Instant::now();
        let mut index = PrefixIndex::default();
        index.note_dispatched(&[5, 6], now);
        // Its report has no block events although every report asks for them.
        index.apply(b"a", 10, None, now).unwrap();
        assert_eq!(index.overlap(&[5, 6]), 0);
        index.note_dispatched(&[5, 6], now);
        assert_eq!(index.overlap(&[5, 6]), 0, "not noted");
        // A worker that starts caching (restarted with it on) is followed again.
        index
            .apply(b"b", 10, Some(&events(true, &[5], &[], 1)), now)
            .unwrap();
        index.note_dispatched(&[5, 6], now);
        assert_eq!(index.overlap(&[5, 6]), 2);
    }
}
