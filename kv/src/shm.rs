//! The shared-memory files of a decode worker's KV pool, and their lifecycle.
//!
//! The pool (a [`crate::KvStorage`] created with [`crate::KvStorage::create_shared`]) lives in
//! a file under /dev/shm that prefill workers on the same host map and write into directly.
//! Beside it, an owner-tag file ([`OwnerTags`]) holds one `u64` per block: the fence of the
//! lease that may be written into it, or 0. A prefill worker checks the tag before each block
//! write and the decode worker clears the tags (and waits a short quarantine) before reusing
//! the blocks of a lease that ended early, so a late or stalled writer can never touch another
//! request's KV.
//!
//! Both files are created fresh (never an existing file or a symlink), readable by their
//! owner only, and removed when the decode worker stops; a decode worker that starts removes
//! the files of workers that died without cleaning up ([`sweep_stale`]). A prefill worker opens
//! a pool only inside its shared-memory folder, without following links, and only the very
//! file (device and inode) that the decode worker advertised ([`open_peer_file`]).

use std::fs::{File, OpenOptions};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::MmapMut;

use crate::error::{KvError, Result};

/// Every shared file of a decode worker starts with this.
pub const POOL_PREFIX: &str = "tandem-kv-";

/// `/dev/shm` where it exists (Linux), else no shared-memory folder.
pub fn default_shm_dir() -> Option<PathBuf> {
    let p = Path::new("/dev/shm");
    p.is_dir().then(|| p.to_path_buf())
}

/// The owner-tag file that sits beside a shared KV pool.
#[derive(Debug)]
pub struct OwnerTags {
    map: MmapMut,
    count: usize,
    /// The file this process created (and removes on drop).
    created: Option<PathBuf>,
}

/// Path of the tag file of a pool file.
pub fn tags_path(pool: &Path) -> PathBuf {
    let mut name = pool.as_os_str().to_owned();
    name.push(".tags");
    PathBuf::from(name)
}

/// Device and inode of a file: what a decode worker advertises of its pool.
pub fn file_identity(path: &Path) -> std::io::Result<(u64, u64)> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::symlink_metadata(path)?;
        Ok((m.dev(), m.ino()))
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        Ok((0, 0))
    }
}

fn tags_len(blocks: usize) -> u64 {
    (blocks.max(1) * 8) as u64
}

impl OwnerTags {
    /// Creates the tag file for `blocks` blocks, all unowned: a new file (never an existing
    /// one or a link), readable by this user only, removed on drop.
    pub fn create(path: &Path, blocks: usize) -> Result<Self> {
        let mut options = OpenOptions::new();
        options.read(true).write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let file = options.open(path).map_err(|e| KvError::io(path, e))?;
        let mapped = (|| {
            file.set_len(tags_len(blocks))?;
            // SAFETY: our own fresh file; peers only touch it through atomics.
            unsafe { MmapMut::map_mut(&file) }
        })();
        match mapped {
            Ok(map) => Ok(Self {
                map,
                count: blocks,
                created: Some(path.to_owned()),
            }),
            Err(e) => {
                let _ = std::fs::remove_file(path);
                Err(KvError::io(path, e))
            }
        }
    }

    /// Maps an existing tag file of exactly `blocks` blocks, opened by the caller.
    fn map(file: &File, blocks: usize, name: &Path) -> Result<Self> {
        let len = file.metadata().map_err(|e| KvError::io(name, e))?.len();
        if len != tags_len(blocks) {
            return Err(KvError::LayoutMismatch(format!(
                "{} is not a tag file for {blocks} blocks",
                name.display()
            )));
        }
        // SAFETY: peers only touch the tags through atomics (see `slot`).
        let map = unsafe { MmapMut::map_mut(file) }.map_err(|e| KvError::io(name, e))?;
        Ok(Self {
            map,
            count: blocks,
            created: None,
        })
    }

    /// Maps the tag file beside a decode worker's pool `pool` (in `dir`, not through a link).
    pub fn open_peer(dir: &Path, pool: &Path, blocks: usize) -> Result<Self> {
        let path = tags_path(pool);
        let file = open_peer_file(dir, &path, tags_len(blocks), None)?;
        Self::map(&file, blocks, &path)
    }

    fn slot(&self, block: u32) -> Option<&AtomicU64> {
        if block as usize >= self.count {
            return None;
        }
        // SAFETY: the mapping is page-aligned and holds `count` u64 slots; AtomicU64 has the
        // layout of u64, and every access (in every process) is atomic.
        Some(unsafe { &*(self.map.as_ptr().cast::<AtomicU64>().add(block as usize)) })
    }

    pub fn set(&self, block: u32, fence: u64) {
        if let Some(s) = self.slot(block) {
            s.store(fence, Ordering::Release);
        }
    }

    pub fn get(&self, block: u32) -> u64 {
        self.slot(block).map_or(0, |s| s.load(Ordering::Acquire))
    }
}

impl Drop for OwnerTags {
    fn drop(&mut self) {
        if let Some(path) = &self.created {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Opens a decode worker's shared file for writing, refusing anything but a regular file
/// named `tandem-kv-*` directly inside `dir`, reached without following a link, of exactly
/// `len` bytes and, when `identity` is given, that very file (device, inode).
pub fn open_peer_file(
    dir: &Path,
    path: &Path,
    len: u64,
    identity: Option<(u64, u64)>,
) -> Result<File> {
    let refuse = |why: &str| {
        KvError::ForeignFile(format!(
            "refusing the shared-memory file {}: {why}",
            path.display()
        ))
    };
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| refuse("it has no file name"))?;
    if !name.starts_with(POOL_PREFIX)
        || path.parent() != Some(dir)
        || path.components().any(|c| matches!(c, Component::ParentDir))
    {
        return Err(refuse(&format!(
            "only {POOL_PREFIX}* files directly in {} are KV pools",
            dir.display()
        )));
    }
    let mut options = OpenOptions::new();
    options.read(true).write(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut options, libc::O_NOFOLLOW);
    let file = options
        .open(path)
        .map_err(|e| refuse(&format!("cannot open it without following links: {e}")))?;
    let meta = file.metadata().map_err(|e| KvError::io(path, e))?;
    if !meta.is_file() {
        return Err(refuse("not a regular file"));
    }
    if meta.len() != len {
        return Err(refuse(&format!(
            "{} bytes where the decode worker advertised {len}",
            meta.len()
        )));
    }
    #[cfg(unix)]
    if let Some(expected) = identity {
        use std::os::unix::fs::MetadataExt;
        if (meta.dev(), meta.ino()) != expected {
            return Err(refuse("not the file the decode worker advertised"));
        }
    }
    #[cfg(not(unix))]
    let _ = identity;
    Ok(file)
}

/// Removes the shared files (`tandem-kv-*`, pools and tags) in `dir` left by decode workers
/// that are gone: their name ends with the pid that created them, and no such process runs
/// (or it is this very process, which has not created its files yet). Returns what it removed.
pub fn sweep_stale(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    // Without /proc we cannot tell a live owner from a dead one: keep everything.
    if !Path::new("/proc/self").exists() {
        return Vec::new();
    }
    let me = std::process::id();
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(pid) = owner_pid(name) else { continue };
        let alive = pid != me && Path::new(&format!("/proc/{pid}")).exists();
        if alive {
            continue;
        }
        let path = entry.path();
        if std::fs::remove_file(&path).is_ok() {
            removed.push(path);
        }
    }
    removed
}

/// The pid at the end of a decode worker's shared file name (`tandem-kv-<worker>-<pid>`,
/// optionally `.tags`).
fn owner_pid(name: &str) -> Option<u32> {
    let stem = name.strip_prefix(POOL_PREFIX)?;
    let stem = stem.strip_suffix(".tags").unwrap_or(stem);
    stem.rsplit('-').next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_pids_come_from_the_name() {
        assert_eq!(owner_pid("tandem-kv-decode-0-4242"), Some(4242));
        assert_eq!(owner_pid("tandem-kv-decode-0-4242.tags"), Some(4242));
        assert_eq!(owner_pid("tandem-kv-x"), None);
        assert_eq!(owner_pid("other-1"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn stale_files_of_dead_workers_are_swept_and_live_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        // A pid that surely ran and is gone: a child we started and waited for.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let stale = dir.path().join(format!("{POOL_PREFIX}decode-{dead}"));
        let stale_tags = tags_path(&stale);
        let own = dir
            .path()
            .join(format!("{POOL_PREFIX}decode-{}", std::process::id()));
        let live = dir.path().join(format!("{POOL_PREFIX}decode-1"));
        let other = dir.path().join("unrelated-7");
        for p in [&stale, &stale_tags, &own, &live, &other] {
            std::fs::write(p, b"x").unwrap();
        }
        let mut removed = sweep_stale(dir.path());
        removed.sort();
        let mut want = vec![stale, stale_tags, own];
        want.sort();
        assert_eq!(removed, want);
        assert!(live.exists(), "pid 1 is alive");
        assert!(other.exists(), "not ours");
    }

    #[cfg(unix)]
    #[test]
    fn peer_files_are_opened_only_when_they_are_the_advertised_pool() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let pool = d.join(format!("{POOL_PREFIX}decode-1"));
        std::fs::write(&pool, vec![0u8; 64]).unwrap();
        let id = file_identity(&pool).unwrap();
        assert!(open_peer_file(d, &pool, 64, Some(id)).is_ok());
        assert!(open_peer_file(d, &pool, 65, Some(id)).is_err(), "size");
        assert!(
            open_peer_file(d, &pool, 64, Some((id.0, id.1 + 1))).is_err(),
            "inode"
        );
        // A link in the folder, pointing at a victim, is never followed.
        let victim = d.join("victim");
        std::fs::write(&victim, vec![1u8; 64]).unwrap();
        let link = d.join(format!("{POOL_PREFIX}decode-2"));
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let e = open_peer_file(d, &link, 64, None).unwrap_err();
        assert!(e.to_string().contains("without following links"), "{e}");
        // Outside the folder, or not a pool's name.
        let outside = tempfile::tempdir().unwrap();
        let far = outside.path().join(format!("{POOL_PREFIX}decode-3"));
        std::fs::write(&far, vec![0u8; 64]).unwrap();
        assert!(open_peer_file(d, &far, 64, None).is_err());
        assert!(open_peer_file(d, &victim, 64, None).is_err());
        let dotdot = d.join("..").join(format!("{POOL_PREFIX}decode-1"));
        assert!(open_peer_file(d, &dotdot, 64, None).is_err());
    }

    #[cfg(unix)]
    #[test]
    fn tag_files_are_private_fresh_and_removed() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.tags");
        let tags = OwnerTags::create(&path, 4).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(OwnerTags::create(&path, 4).is_err(), "never reused");
        tags.set(2, 99);
        assert_eq!(tags.get(2), 99);
        drop(tags);
        assert!(!path.exists(), "removed on drop");
    }
}
