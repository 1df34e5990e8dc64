//! `KvCache`: the memory that holds every KV block of one engine, addressed by
//! `(layer, block)`. The memory is an anonymous mapping, or a file in shared memory that the
//! prefill worker on the same host maps too and writes reserved blocks into (the `shm`
//! transport: one copy, no serialization).
//!
//! Blocks move as bytes of the layout's dtype (transports, staging). Tokens are written and
//! read in any dtype (rounded to it on the way in); the whole-block f32 accessors refuse a
//! cache of another dtype.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::MmapMut;

use crate::error::{KvError, Result};
use crate::layout::{KvDtype, KvLayout};

/// The backing memory of a KV cache.
///
/// Accessed only through raw pointers to one block at a time: the engine's thread, transport
/// threads writing reserved blocks, and (for shared files) another process may all touch the
/// region at once, each in blocks it owns, so no reference ever spans the whole region.
#[derive(Debug)]
pub struct KvStorage {
    map: MmapMut,
    base: *mut u8,
    shared_path: Option<PathBuf>,
    /// Whether the memory is a file's (shared with other processes).
    shared: bool,
}

// SAFETY: the mapping lives as long as the storage; concurrent access is per block, and a
// block has one owner at a time (the engine's pool and the decode worker's leases decide).
unsafe impl Send for KvStorage {}
unsafe impl Sync for KvStorage {}

impl KvStorage {
    /// Private memory of `bytes` (zero pages, committed lazily by the OS).
    pub fn anonymous(bytes: usize) -> Result<Self> {
        let map =
            MmapMut::map_anon(bytes.max(1)).map_err(|e| KvError::io("anonymous KV memory", e))?;
        Ok(Self::from_map(map, None, false))
    }

    /// Creates a shared-memory file of `bytes` at `path` and maps it. The file must not exist
    /// yet (no symlink or stale file is ever followed or reused) and is created readable and
    /// writable by this user only: it will hold every prompt's KV. It is removed when the
    /// storage is dropped.
    pub fn create_shared(path: &Path, bytes: usize) -> Result<Self> {
        let mut options = OpenOptions::new();
        options.read(true).write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let file = options.open(path).map_err(|e| KvError::io(path, e))?;
        let storage = (|| {
            file.set_len(bytes as u64)?;
            // SAFETY: the file was just created by us; other processes only write blocks that
            // this process reserved for them (see `KvCache`).
            unsafe { MmapMut::map_mut(&file) }
        })();
        match storage {
            Ok(map) => Ok(Self::from_map(map, Some(path.to_owned()), true)),
            Err(e) => {
                let _ = std::fs::remove_file(path);
                Err(KvError::io(path, e))
            }
        }
    }

    /// Maps an existing shared-memory file, which must be exactly `bytes` long. The caller
    /// opened it (and checked it is the file it expects: see the `shm` transport).
    pub fn open_shared_file(file: &std::fs::File, bytes: usize, name: &Path) -> Result<Self> {
        let len = file.metadata().map_err(|e| KvError::io(name, e))?.len();
        if len != bytes as u64 {
            return Err(KvError::LayoutMismatch(format!(
                "shared KV file {} holds {len} bytes, the layout needs {bytes}",
                name.display()
            )));
        }
        // SAFETY: the owner keeps the file alive while peers hold leases on its blocks.
        let map = unsafe { MmapMut::map_mut(file) }.map_err(|e| KvError::io(name, e))?;
        Ok(Self::from_map(map, None, true))
    }

    /// Maps an existing shared-memory file, which must be exactly `bytes` long.
    pub fn open_shared(path: &Path, bytes: usize) -> Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| KvError::io(path, e))?;
        Self::open_shared_file(&file, bytes, path)
    }

    fn from_map(mut map: MmapMut, shared_path: Option<PathBuf>, shared: bool) -> Self {
        let base = map.as_mut_ptr();
        Self {
            map,
            base,
            shared_path,
            shared,
        }
    }

    /// Releases the whole pages inside `start..start + len` (see [`KvCache::discard`]).
    fn discard(&self, start: usize, len: usize) {
        const PAGE: usize = 4096;
        let first = start.next_multiple_of(PAGE);
        let end = (start + len).min(self.map.len()) / PAGE * PAGE;
        if end <= first {
            return;
        }
        #[cfg(target_os = "linux")]
        {
            use memmap2::UncheckedAdvice;
            let advice = if self.shared {
                UncheckedAdvice::Remove
            } else {
                UncheckedAdvice::DontNeed
            };
            // SAFETY: the range lies inside the mapping; its owner (the caller holds the
            // blocks exclusively) no longer needs the contents, which read back as zeros.
            let _ = unsafe { self.map.unchecked_advise_range(advice, first, end - first) };
        }
    }

    /// The shared-memory file this storage created, if any.
    pub fn shared_path(&self) -> Option<&Path> {
        self.shared_path.as_deref()
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

impl Drop for KvStorage {
    fn drop(&mut self) {
        if let Some(path) = &self.shared_path {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// All KV blocks of one engine.
#[derive(Debug)]
pub struct KvCache {
    layout: KvLayout,
    num_blocks: usize,
    storage: Arc<KvStorage>,
}

impl KvCache {
    /// A cache over `storage`, which must hold exactly `num_blocks` blocks of `layout`.
    pub fn new(layout: KvLayout, num_blocks: usize, storage: KvStorage) -> Result<Self> {
        let need = num_blocks * layout.block_bytes();
        if storage.len() < need {
            return Err(KvError::LayoutMismatch(format!(
                "KV storage of {} bytes cannot hold {num_blocks} blocks of {} bytes",
                storage.len(),
                layout.block_bytes()
            )));
        }
        Ok(Self {
            layout,
            num_blocks,
            storage: Arc::new(storage),
        })
    }

    /// A private cache with as many blocks as `budget_bytes` holds.
    pub fn with_budget(layout: KvLayout, budget_bytes: usize) -> Result<Self> {
        let num_blocks = budget_bytes / layout.block_bytes();
        if num_blocks == 0 {
            return Err(KvError::Config(format!(
                "a KV budget of {budget_bytes} bytes holds no block of {} bytes",
                layout.block_bytes()
            )));
        }
        let storage = KvStorage::anonymous(num_blocks * layout.block_bytes())?;
        Self::new(layout, num_blocks, storage)
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn storage(&self) -> &KvStorage {
        &self.storage
    }

    /// A handle that writes whole blocks from other threads (transports receiving KV into
    /// reserved blocks while the engine keeps computing).
    pub fn block_writer(&self) -> KvBlockWriter {
        KvBlockWriter {
            storage: self.storage.clone(),
            layout: self.layout.clone(),
            num_blocks: self.num_blocks,
        }
    }

    /// Element offset of `(layer, block)`.
    fn offset(&self, layer: usize, block: u32) -> Result<usize> {
        block_offset(&self.layout, self.num_blocks, layer, block)
    }

    /// The floats of one block of one layer (K part, then V part) of an f32 cache.
    pub fn block_layer(&self, layer: usize, block: u32) -> Result<&[f32]> {
        self.require_f32()?;
        let off = self.offset(layer, block)?;
        // SAFETY: in bounds (checked offset); only this block is borrowed.
        Ok(unsafe {
            std::slice::from_raw_parts(self.floats_ptr().add(off), self.layout.block_layer_elems())
        })
    }

    /// One block of one layer as raw bytes of the layout's dtype, as transports send them.
    pub fn block_layer_bytes(&self, layer: usize, block: u32) -> Result<&[u8]> {
        let off = self.offset(layer, block)? * self.layout.dtype.size_in_bytes();
        // SAFETY: as in `block_layer`.
        Ok(unsafe {
            std::slice::from_raw_parts(self.storage.base.add(off), self.layout.block_layer_bytes())
        })
    }

    /// Overwrites one block of one layer with received bytes (exactly one block's worth).
    pub fn write_block_layer_bytes(
        &mut self,
        layer: usize,
        block: u32,
        bytes: &[u8],
    ) -> Result<()> {
        let n = self.layout.block_layer_bytes();
        if bytes.len() != n {
            return Err(KvError::InvalidKv(format!(
                "block payload of {} bytes, expected {n}",
                bytes.len()
            )));
        }
        let off = self.offset(layer, block)? * self.layout.dtype.size_in_bytes();
        // SAFETY: in bounds; `&mut self` excludes the engine's own readers.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.storage.base.add(off), n) };
        Ok(())
    }

    /// Copies every layer of block `src` into block `dst` (the copy-on-write of a shared
    /// prompt's last, partly filled block).
    pub fn copy_block(&mut self, src: u32, dst: u32) -> Result<()> {
        let n = self.layout.block_layer_bytes();
        let size = self.layout.dtype.size_in_bytes();
        for layer in 0..self.layout.num_layers {
            let from = self.offset(layer, src)? * size;
            let to = self.offset(layer, dst)? * size;
            if from != to {
                // SAFETY: both in bounds (checked offsets) and distinct blocks, so the
                // ranges do not overlap; `&mut self` excludes the engine's own readers.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        self.storage.base.add(from),
                        self.storage.base.add(to),
                        n,
                    )
                };
            }
        }
        Ok(())
    }

    /// Mutable floats of one block of one layer of an f32 cache.
    pub fn block_layer_mut(&mut self, layer: usize, block: u32) -> Result<&mut [f32]> {
        self.require_f32()?;
        let off = self.offset(layer, block)?;
        let n = self.layout.block_layer_elems();
        // SAFETY: in bounds; only this block is borrowed, exclusively through `&mut self`.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.floats_ptr().add(off), n) })
    }

    /// Writes one token's K and V rows (`kv_heads × head_dim` each) into `slot` of `block`,
    /// rounded to the cache's dtype (to nearest, ties to even: the same bits on every CPU).
    pub fn write_token(
        &mut self,
        layer: usize,
        block: u32,
        slot: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<()> {
        let off = self.offset(layer, block)?;
        let shape = TokenShape::of(&self.layout, slot, k, v)?;
        // SAFETY: `off` is one block of one layer (checked offset); `&mut self` excludes every
        // other reader and writer.
        unsafe { scatter_token(self.storage.base, &self.layout, off, &shape, k, v) };
        Ok(())
    }

    /// [`write_token`](Self::write_token) for many tokens of one layer (a prefill chunk's),
    /// spread over threads by `parallel`. Every token of a block is written by the same task,
    /// so tasks write disjoint memory; every token is checked before any is written.
    pub fn write_tokens(
        &mut self,
        layer: usize,
        tokens: &[TokenKv<'_>],
        parallel: Parallel<'_>,
    ) -> Result<()> {
        let mut checked = Vec::with_capacity(tokens.len());
        for t in tokens {
            let shape = TokenShape::of(&self.layout, t.slot, t.k, t.v)?;
            checked.push((self.offset(layer, t.block)?, shape));
        }
        // Tokens grouped by block (a stable sort keeps each block's writes in their order).
        let mut order: Vec<usize> = (0..tokens.len()).collect();
        order.sort_by_key(|&i| checked[i].0);
        let mut runs = Vec::new();
        let mut start = 0;
        for end in 1..=order.len() {
            if end == order.len() || checked[order[end]].0 != checked[order[start]].0 {
                runs.push(start..end);
                start = end;
            }
        }
        let base = BasePtr(self.storage.base);
        let layout = &self.layout;
        parallel(runs.len(), &|r| {
            let base = &base;
            for &i in &order[runs[r].clone()] {
                let (off, shape) = &checked[i];
                // SAFETY: checked offsets; the runs partition the blocks, so no two tasks
                // write one block, and `&mut self` excludes every other reader and writer.
                unsafe { scatter_token(base.0, layout, *off, shape, tokens[i].k, tokens[i].v) };
            }
        });
        Ok(())
    }

    /// Gives the memory of `blocks` of `layer` back to the OS: a GPU engine's host cache only
    /// stages KV on its way to or from the device, so once a piece has been sent or uploaded
    /// its pages need not stay resident (private memory reads back as zeros, a shared file's
    /// pages are punched out). Only whole pages inside each piece are released. Bounds are
    /// checked; a failed release is not an error (the memory simply stays).
    pub fn discard(&mut self, layer: usize, blocks: &[u32]) -> Result<()> {
        let piece = self.layout.block_layer_bytes();
        for &block in blocks {
            let start = self.offset(layer, block)? * self.layout.dtype.size_in_bytes();
            self.storage.discard(start, piece);
        }
        Ok(())
    }

    /// Reads back one token's K and V rows, widened to f32 (for tests and the reference
    /// comparison).
    pub fn read_token(
        &self,
        layer: usize,
        block: u32,
        slot: usize,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let width = self.layout.num_kv_heads * self.layout.head_dim;
        let (mut k, mut v) = (vec![0f32; width], vec![0f32; width]);
        let off = self.offset(layer, block)?;
        let n = self.layout.block_layer_elems();
        let shape = TokenShape::of(&self.layout, slot, &k, &v)?;
        // SAFETY (each arm): as in `write_token`, reading only.
        match self.layout.dtype {
            KvDtype::F32 => {
                let src = unsafe { std::slice::from_raw_parts(self.floats_ptr().add(off), n) };
                shape.gather(src, &mut k, &mut v, |x| x);
            }
            KvDtype::Bf16 => {
                let base = self.storage.base.cast::<half::bf16>();
                let src = unsafe { std::slice::from_raw_parts(base.add(off), n) };
                shape.gather(src, &mut k, &mut v, half::bf16::to_f32);
            }
            KvDtype::F16 => {
                let base = self.storage.base.cast::<half::f16>();
                let src = unsafe { std::slice::from_raw_parts(base.add(off), n) };
                shape.gather(src, &mut k, &mut v, half::f16::to_f32);
            }
        }
        Ok((k, v))
    }

    /// Base of a layer's blocks, in bytes, for the attention kernels (which read any dtype:
    /// block `b` starts `b × block_layer_bytes` further on).
    ///
    /// # Panics
    /// If the layer is out of range.
    pub fn layer_bytes_ptr(&self, layer: usize) -> *const u8 {
        assert!(
            layer < self.layout.num_layers,
            "layer {layer} of a cache of {} layers",
            self.layout.num_layers
        );
        let off = layer * self.num_blocks * self.layout.block_layer_bytes();
        // SAFETY: `layer` < num_layers (checked), so the offset is in bounds.
        unsafe { self.storage.base.add(off) }
    }

    /// Base pointer of a layer's blocks of an f32 cache, for the attention kernel.
    ///
    /// # Panics
    /// If the layer is out of range or the cache is not f32 (the CPU engine only builds f32
    /// caches; a mistake here would read the wrong bytes).
    pub fn layer_ptr(&self, layer: usize) -> *const f32 {
        assert!(
            layer < self.layout.num_layers && self.layout.dtype == KvDtype::F32,
            "layer {layer} of a {} cache of {} layers",
            self.layout.dtype.name(),
            self.layout.num_layers
        );
        let off = layer * self.num_blocks * self.layout.block_layer_elems();
        // SAFETY: `layer` < num_layers (checked), so the offset is in bounds.
        unsafe { self.floats_ptr().add(off) }
    }

    /// The region as floats: mappings are page-aligned, so the cast is aligned.
    fn floats_ptr(&self) -> *mut f32 {
        self.storage.base.cast::<f32>()
    }

    fn require_f32(&self) -> Result<()> {
        if self.layout.dtype == KvDtype::F32 {
            Ok(())
        } else {
            Err(KvError::InvalidKv(format!(
                "f32 access to a {} cache",
                self.layout.dtype.name()
            )))
        }
    }
}

/// Where one token's K and V elements lie in a block of one layer (see `KvLayout`: K is
/// `[kv_head][head_dim][slot]`, V `[kv_head][slot][head_dim]`).
struct TokenShape {
    heads: usize,
    d: usize,
    bs: usize,
    slot: usize,
}

impl TokenShape {
    fn of(layout: &KvLayout, slot: usize, k: &[f32], v: &[f32]) -> Result<Self> {
        let (heads, d, bs) = (layout.num_kv_heads, layout.head_dim, layout.block_size);
        if slot >= bs || k.len() != heads * d || v.len() != heads * d {
            return Err(KvError::InvalidKv(format!(
                "token of {}+{} values at slot {slot}; a block holds {bs} slots of {}",
                k.len(),
                v.len(),
                heads * d
            )));
        }
        Ok(Self { heads, d, bs, slot })
    }

    fn scatter<T: Copy>(&self, dst: &mut [T], k: &[f32], v: &[f32], to: impl Fn(f32) -> T) {
        let (heads, d, bs, slot) = (self.heads, self.d, self.bs, self.slot);
        let (kpart, vpart) = dst.split_at_mut(heads * d * bs);
        // K is stored transposed (dimension-major, one slot per key), V token-major.
        for (h, (kh, vh)) in k.chunks_exact(d).zip(v.chunks_exact(d)).enumerate() {
            let kdst = kpart[h * d * bs + slot..].iter_mut().step_by(bs);
            for (dst, &x) in kdst.zip(kh) {
                *dst = to(x);
            }
            let vdst = &mut vpart[(h * bs + slot) * d..(h * bs + slot + 1) * d];
            for (dst, &x) in vdst.iter_mut().zip(vh) {
                *dst = to(x);
            }
        }
    }

    fn gather<T: Copy>(&self, src: &[T], k: &mut [f32], v: &mut [f32], from: impl Fn(T) -> f32) {
        let (heads, d, bs, slot) = (self.heads, self.d, self.bs, self.slot);
        let (kpart, vpart) = src.split_at(heads * d * bs);
        for h in 0..heads {
            for i in 0..d {
                k[h * d + i] = from(kpart[(h * d + i) * bs + slot]);
                v[h * d + i] = from(vpart[(h * bs + slot) * d + i]);
            }
        }
    }
}

/// How [`KvCache::write_tokens`] runs its tasks: `parallel(tasks, task)` calls `task(i)` for
/// every `i < tasks`, on any threads, and returns when all have run.
pub type Parallel<'a> = &'a dyn Fn(usize, &(dyn Fn(usize) + Sync));

/// One token's K and V rows (`kv_heads × head_dim` each) for [`KvCache::write_tokens`].
#[derive(Debug, Clone, Copy)]
pub struct TokenKv<'a> {
    pub block: u32,
    pub slot: usize,
    pub k: &'a [f32],
    pub v: &'a [f32],
}

/// The cache's base pointer, shared by the tasks of one `write_tokens` call.
struct BasePtr(*mut u8);
// SAFETY: the tasks write disjoint blocks through it (see `write_tokens`).
unsafe impl Sync for BasePtr {}

/// Writes one token into the block-layer piece at element `off`, in the cache's dtype.
///
/// # Safety
/// `off` is a checked block offset of a storage at `base` laid out by `layout`, and nobody
/// else reads or writes that piece meanwhile.
unsafe fn scatter_token(
    base: *mut u8,
    layout: &KvLayout,
    off: usize,
    shape: &TokenShape,
    k: &[f32],
    v: &[f32],
) {
    let n = layout.block_layer_elems();
    // SAFETY (each arm): `off..off + n` is one block of one layer in elements of the dtype.
    unsafe {
        match layout.dtype {
            KvDtype::F32 => {
                let dst = std::slice::from_raw_parts_mut(base.cast::<f32>().add(off), n);
                shape.scatter(dst, k, v, |x| x);
            }
            KvDtype::Bf16 => {
                let dst = std::slice::from_raw_parts_mut(base.cast::<half::bf16>().add(off), n);
                shape.scatter(dst, k, v, half::bf16::from_f32);
            }
            KvDtype::F16 => {
                let dst = std::slice::from_raw_parts_mut(base.cast::<half::f16>().add(off), n);
                shape.scatter(dst, k, v, half::f16::from_f32);
            }
        }
    }
}

fn block_offset(layout: &KvLayout, num_blocks: usize, layer: usize, block: u32) -> Result<usize> {
    if layer >= layout.num_layers || block as usize >= num_blocks {
        return Err(KvError::InvalidKv(format!(
            "layer {layer} block {block} out of range ({} layers, {num_blocks} blocks)",
            layout.num_layers
        )));
    }
    Ok((layer * num_blocks + block as usize) * layout.block_layer_elems())
}

/// Writes and reads whole blocks of a cache from any thread. Every method is `unsafe`:
/// the caller must hold the block exclusively (a reservation nobody else touches until it is
/// handed to the engine), which the type system cannot see across threads or processes.
#[derive(Debug, Clone)]
pub struct KvBlockWriter {
    storage: Arc<KvStorage>,
    layout: KvLayout,
    num_blocks: usize,
}

impl KvBlockWriter {
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Copies one block's bytes of one layer into the cache.
    ///
    /// # Safety
    /// No one else may read or write `(layer, block)` during the call.
    pub unsafe fn write(&self, layer: usize, block: u32, bytes: &[u8]) -> Result<()> {
        let n = self.layout.block_layer_bytes();
        if bytes.len() != n {
            return Err(KvError::InvalidKv(format!(
                "block payload of {} bytes, expected {n}",
                bytes.len()
            )));
        }
        let off = block_offset(&self.layout, self.num_blocks, layer, block)?
            * self.layout.dtype.size_in_bytes();
        // SAFETY: in bounds; exclusivity is the caller's promise.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.storage.base.add(off), n) };
        Ok(())
    }

    /// Reads one block's bytes of one layer (to verify a checksum after a remote write).
    ///
    /// # Safety
    /// No one may write `(layer, block)` while the returned slice lives.
    pub unsafe fn read(&self, layer: usize, block: u32) -> Result<&[u8]> {
        let off = block_offset(&self.layout, self.num_blocks, layer, block)?
            * self.layout.dtype.size_in_bytes();
        // SAFETY: in bounds; the caller excludes writers.
        Ok(unsafe {
            std::slice::from_raw_parts(self.storage.base.add(off), self.layout.block_layer_bytes())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout {
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 4,
            block_size: 16,
            dtype: KvDtype::F32,
            model_fingerprint: "t".into(),
        }
    }

    #[test]
    fn token_round_trip_and_bounds() {
        let mut cache = KvCache::with_budget(layout(), 3 * layout().block_bytes()).unwrap();
        assert_eq!(cache.num_blocks(), 3);
        let k: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let v: Vec<f32> = (0..8).map(|i| 100.0 + i as f32).collect();
        cache.write_token(1, 2, 5, &k, &v).unwrap();
        assert_eq!(cache.read_token(1, 2, 5).unwrap(), (k, v));
        assert!(cache.block_layer(2, 0).is_err());
        assert!(cache.block_layer(0, 3).is_err());
        assert!(cache.write_block_layer_bytes(0, 0, &[0u8; 3]).is_err());
        assert!(KvCache::with_budget(layout(), 10).is_err());
    }

    #[test]
    fn half_precision_caches_move_bytes_and_refuse_f32_access() {
        let bf16 = KvLayout {
            dtype: KvDtype::Bf16,
            ..layout()
        };
        let mut cache = KvCache::with_budget(bf16.clone(), 2 * bf16.block_bytes()).unwrap();
        assert_eq!(cache.num_blocks(), 2);
        let n = bf16.block_layer_bytes();
        assert_eq!(n, layout().block_layer_bytes() / 2);
        let payload: Vec<u8> = (0..n).map(|i| (i % 253) as u8).collect();
        cache.write_block_layer_bytes(1, 1, &payload).unwrap();
        assert_eq!(cache.block_layer_bytes(1, 1).unwrap(), &payload[..]);
        // The last piece of the pool: offsets count 2-byte elements, not 4.
        assert_eq!(cache.block_layer_bytes(0, 1).unwrap().len(), n);
        assert!(cache.block_layer(0, 0).is_err());
    }

    #[test]
    fn a_copied_block_has_every_layer_of_its_source() {
        for dtype in [KvDtype::F32, KvDtype::Bf16] {
            let l = KvLayout { dtype, ..layout() };
            let mut cache = KvCache::with_budget(l.clone(), 3 * l.block_bytes()).unwrap();
            let n = l.block_layer_bytes();
            for layer in 0..l.num_layers {
                let payload: Vec<u8> = (0..n).map(|i| (i + 7 * layer) as u8).collect();
                cache.write_block_layer_bytes(layer, 2, &payload).unwrap();
            }
            cache.copy_block(2, 0).unwrap();
            for layer in 0..l.num_layers {
                assert_eq!(
                    cache.block_layer_bytes(layer, 0).unwrap(),
                    cache.block_layer_bytes(layer, 2).unwrap()
                );
            }
            assert!(
                cache
                    .block_layer_bytes(0, 1)
                    .unwrap()
                    .iter()
                    .all(|&b| b == 0)
            );
            assert!(cache.copy_block(0, 3).is_err());
        }
    }

    #[test]
    fn tokens_are_rounded_to_the_cache_dtype_and_read_back_widened() {
        let width = layout().num_kv_heads * layout().head_dim;
        let k: Vec<f32> = (0..width).map(|i| 1.0 + i as f32 / 3.0).collect();
        let v: Vec<f32> = (0..width).map(|i| -0.1 * i as f32).collect();
        for dtype in [KvDtype::F32, KvDtype::Bf16, KvDtype::F16] {
            let l = KvLayout { dtype, ..layout() };
            let mut cache = KvCache::with_budget(l.clone(), 2 * l.block_bytes()).unwrap();
            cache.write_token(1, 1, 5, &k, &v).unwrap();
            let (rk, rv) = cache.read_token(1, 1, 5).unwrap();
            let round = |x: f32| match dtype {
                KvDtype::F32 => x,
                KvDtype::Bf16 => half::bf16::from_f32(x).to_f32(),
                KvDtype::F16 => half::f16::from_f32(x).to_f32(),
            };
            assert_eq!(
                rk,
                k.iter().map(|&x| round(x)).collect::<Vec<_>>(),
                "{dtype:?}"
            );
            assert_eq!(
                rv,
                v.iter().map(|&x| round(x)).collect::<Vec<_>>(),
                "{dtype:?}"
            );
            // Other slots stay untouched.
            assert!(
                cache
                    .read_token(1, 1, 4)
                    .unwrap()
                    .0
                    .iter()
                    .all(|&x| x == 0.0)
            );
            assert!(
                cache.write_token(0, 0, 16, &k, &v).is_err(),
                "slot past the block"
            );
            assert!(
                cache.write_token(0, 0, 0, &k[1..], &v).is_err(),
                "short row"
            );
        }
    }

    #[test]
    fn discarded_pieces_read_back_as_zeros_and_the_rest_stays() {
        // A piece of several pages, so whole pages inside it are released.
        let big = KvLayout {
            num_kv_heads: 8,
            head_dim: 64,
            ..layout()
        };
        assert!(big.block_layer_bytes() >= 3 * 4096);
        let mut cache = KvCache::with_budget(big.clone(), 2 * big.block_bytes()).unwrap();
        for (layer, block) in [(0, 0), (0, 1), (1, 0)] {
            cache.block_layer_mut(layer, block).unwrap().fill(1.5);
        }
        cache.discard(0, &[1]).unwrap();
        assert!(cache.block_layer(0, 1).unwrap().iter().all(|&v| v == 0.0));
        assert!(cache.block_layer(0, 0).unwrap().iter().all(|&v| v == 1.5));
        assert!(cache.block_layer(1, 0).unwrap().iter().all(|&v| v == 1.5));
        assert!(cache.discard(0, &[2]).is_err(), "out of range");
    }

    #[test]
    fn shared_file_is_seen_by_a_second_mapping() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kv");
        let bytes = 2 * layout().block_bytes();
        let owner =
            KvCache::new(layout(), 2, KvStorage::create_shared(&path, bytes).unwrap()).unwrap();
        let mut peer =
            KvCache::new(layout(), 2, KvStorage::open_shared(&path, bytes).unwrap()).unwrap();
        let payload: Vec<u8> = (0..layout().block_layer_bytes())
            .map(|i| (i % 251) as u8)
            .collect();
        peer.write_block_layer_bytes(1, 1, &payload).unwrap();
        assert_eq!(owner.block_layer_bytes(1, 1).unwrap(), &payload[..]);
        assert!(KvStorage::open_shared(&path, bytes + 1).is_err());
        drop(peer);
        drop(owner);
        assert!(!path.exists(), "the owner removes its file");
    }

    #[cfg(unix)]
    #[test]
    fn shared_files_are_private_and_never_reused_or_followed() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kv");
        let bytes = layout().block_bytes();
        let storage = KvStorage::create_shared(&path, bytes).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "only this user reads the KV");
        assert!(
            KvStorage::create_shared(&path, bytes).is_err(),
            "an existing file is not taken over"
        );
        drop(storage);
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        assert!(KvStorage::create_shared(&link, bytes).is_err());
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    }
}
