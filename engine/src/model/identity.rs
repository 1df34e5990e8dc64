//! What names a loaded model: a cheap identity of each weights file and the fingerprint of a
//! model (its files, shape and weight format), which KV peers compare so that they never mix
//! KV of two different models.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::config::{ModelConfig, WeightFormat};
use crate::error::{EngineError, Result};

/// A cheap identity of a weights file: its name, size, and a hash of its first and last MiB.
pub(super) fn file_identity(path: &Path) -> Result<String> {
    use std::io::{Seek, SeekFrom};
    let mut file = File::open(path).map_err(|e| EngineError::io(path, e))?;
    let len = file.metadata().map_err(|e| EngineError::io(path, e))?.len();
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let n = file.read(&mut buf).map_err(|e| EngineError::io(path, e))?;
    hasher.update(&buf[..n]);
    if len > buf.len() as u64 {
        file.seek(SeekFrom::End(-(buf.len() as i64)))
            .map_err(|e| EngineError::io(path, e))?;
        file.read_exact(&mut buf)
            .map_err(|e| EngineError::io(path, e))?;
        hasher.update(&buf);
    }
    let name = path
        .file_name()
        .and_then(|s| s.to_str())
        .unwrap_or_default();
    Ok(format!("{name}:{len}:{:x}", hasher.finalize()))
}

/// A fingerprint for the same weights computed in `fast` mode (8-bit activations: other
/// logits and other KV than `exact` mode's, so peers in different modes must not mix KV).
pub(super) fn fast_fingerprint(fingerprint: &str) -> String {
    let digest = Sha256::digest(format!("{fingerprint};compute=fast").as_bytes());
    digest.iter().take(12).map(|b| format!("{b:02x}")).collect()
}

/// The fingerprint of a model of `cfg`'s shape in `format`, loaded from `source` (its
/// files' identities, or a dummy model's seed).
pub(super) fn fingerprint(cfg: &ModelConfig, format: WeightFormat, source: &str) -> String {
    let cfg_json = serde_json::to_string(cfg).unwrap_or_default();
    let digest = Sha256::digest(format!("{source};{cfg_json};{}", format.name()).as_bytes());
    digest.iter().take(12).map(|b| format!("{b:02x}")).collect()
}
