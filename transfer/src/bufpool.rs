//! A process-wide pool of transfer buffers. Frames of a few megabytes are built for every
//! layer of every request; fresh allocations that size come straight from mmap and cost a
//! page fault per 4 KiB on first touch (and an munmap when dropped), which measured as a
//! large share of loopback transfer time. Reusing buffers keeps their pages resident.

use std::sync::Mutex;

/// Buffers kept for reuse, and the largest one worth keeping.
const MAX_POOLED: usize = 64;
const MAX_BUFFER: usize = 32 << 20;

static POOL: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

/// An empty buffer, with at least `capacity` bytes reserved when one is at hand.
pub(crate) fn take(capacity: usize) -> Vec<u8> {
    let mut pool = POOL.lock().unwrap_or_else(|p| p.into_inner());
    let mut buf = match pool.iter().position(|b| b.capacity() >= capacity) {
        Some(i) => pool.swap_remove(i),
        None => pool.pop().unwrap_or_default(),
    };
    drop(pool);
    buf.clear();
    buf.reserve(capacity);
    buf
}

/// Returns a buffer for reuse.
pub(crate) fn give(buf: Vec<u8>) {
    if buf.capacity() == 0 || buf.capacity() > MAX_BUFFER {
        return;
    }
    let mut pool = POOL.lock().unwrap_or_else(|p| p.into_inner());
    if pool.len() < MAX_POOLED {
        pool.push(buf);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reuses_capacity() {
        let mut b = take(1 << 20);
        b.extend_from_slice(&[1, 2, 3]);
        let ptr = b.as_ptr();
        give(b);
        let again = take(1000);
        assert!(again.is_empty());
        assert!(again.capacity() >= 1 << 20);
        assert_eq!(again.as_ptr(), ptr);
    }
}
