//! Where a quantized matrix's packed bytes live: its own heap buffer while it is built, then
//! (for a loaded model) one mapping shared by every quantized matrix of the model,
//! advised for transparent huge pages ([`gather`]).
//!
//! Why: a batch-1 decode step streams every weight once, about 100 MB for SmolLM2, through
//! 4 KiB pages: a TLB miss and a stop of the hardware prefetchers at every page boundary. Its
//! matrices are 0.2-1.1 MB each, too small for a 2 MiB page of their own, so they share one
//! mapping, 2 MiB-aligned. On Linux with transparent huge pages set to `madvise` (the common
//! default) the advice is what makes the kernel back it with huge pages; where they are off,
//! the mapping is ordinary memory and nothing else changes. Nothing writes it once filled:
//! the matrices only ever hand out shared slices of it.

use std::sync::Arc;

use memmap2::MmapMut;

/// A transparent huge page on x86-64 and most aarch64 kernels.
const HUGE_PAGE: usize = 2 << 20;
/// Each matrix starts on a cache line, as a heap buffer of this size would.
const ALIGN: usize = 64;

/// A quantized matrix's packed bytes.
#[derive(Clone)]
pub(crate) enum PanelBytes {
    Owned(Vec<u8>),
    /// `len` bytes from `start` of a mapping shared with the model's other matrices.
    Mapped {
        map: Arc<MmapMut>,
        start: usize,
        len: usize,
    },
}

impl std::ops::Deref for PanelBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            PanelBytes::Owned(v) => v,
            PanelBytes::Mapped { map, start, len } => &map[*start..*start + *len],
        }
    }
}

impl std::fmt::Debug for PanelBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let place = match self {
            PanelBytes::Owned(_) => "heap",
            PanelBytes::Mapped { .. } => "shared mapping",
        };
        write!(f, "{} bytes ({place})", self.len())
    }
}

/// Moves `buffers` into one new anonymous mapping, 2 MiB-aligned and advised for huge pages;
/// returns its size. Each buffer's own memory is freed as soon as it is copied, so loading
/// never holds the weights twice. On an error (no memory for the mapping, the only step that
/// can fail) every buffer stays as it was.
pub(crate) fn gather(buffers: &mut [&mut PanelBytes]) -> std::io::Result<usize> {
    let total: usize = buffers
        .iter()
        .map(|b| b.len().next_multiple_of(ALIGN))
        .sum();
    if total == 0 {
        return Ok(0);
    }
    let mut map = MmapMut::map_anon(total + HUGE_PAGE)?;
    // Before the first touch, so that the pages come huge from the start. Only a hint: the
    // kernel may refuse (huge pages off), and the memory works the same either way.
    #[cfg(target_os = "linux")]
    let _ = map.advise(memmap2::Advice::HugePage);
    let base = map.as_ptr() as usize;
    let mut at = base.next_multiple_of(HUGE_PAGE) - base;
    let mut places = Vec::with_capacity(buffers.len());
    for b in buffers.iter_mut() {
        let own = std::mem::replace(&mut **b, PanelBytes::Owned(Vec::new()));
        map[at..at + own.len()].copy_from_slice(&own);
        places.push((at, own.len()));
        at += own.len().next_multiple_of(ALIGN);
    }
    let map = Arc::new(map);
    for (b, (start, len)) in buffers.iter_mut().zip(places) {
        **b = PanelBytes::Mapped {
            map: map.clone(),
            start,
            len,
        };
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gathered_buffers_keep_their_bytes_aligned() {
        let lens = [0usize, 1, 63, 64, 65, 5760, 300_001];
        let made: Vec<Vec<u8>> = lens
            .iter()
            .map(|&n| (0..n).map(|i| (i * 31 + n) as u8).collect())
            .collect();
        let mut buffers: Vec<PanelBytes> = made.iter().cloned().map(PanelBytes::Owned).collect();
        let mut refs: Vec<&mut PanelBytes> = buffers.iter_mut().collect();
        let total = gather(&mut refs).unwrap();
        assert!(total >= lens.iter().sum::<usize>());
        for (b, want) in buffers.iter().zip(&made) {
            assert!(matches!(b, PanelBytes::Mapped { .. }));
            assert_eq!(&b[..], &want[..]);
            assert_eq!(b.as_ptr() as usize % ALIGN, 0);
        }
        assert_eq!(gather(&mut []).unwrap(), 0);
    }
}
