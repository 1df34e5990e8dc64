//! The KV layout: everything two peers must agree on before one writes KV into the other's
//! blocks, and a hash of it that they compare at handshake.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Element type of the cache. The CPU engine keeps f32 unless asked for bf16 or f16 (it
/// computes in f32, widening each block as it reads it); a GPU engine keeps bf16 on the
/// device. The dtype is part of the layout hash, so workers whose caches differ refuse each
/// other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    #[default]
    F32,
    Bf16,
    F16,
}

impl KvDtype {
    pub fn size_in_bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16 | KvDtype::F16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::Bf16 => "bf16",
            KvDtype::F16 => "f16",
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = crate::KvError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [KvDtype::F32, KvDtype::Bf16, KvDtype::F16]
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| {
                crate::KvError::Config(format!("unknown KV dtype `{s}`: f32, bf16 or f16"))
            })
    }
}

/// Shape and identity of one engine's KV cache.
///
/// Memory order: `[layer][block][K | V]`; within a block's K part `[kv_head][head_dim][slot]`
/// (transposed, so 16 slots of one dimension are one SIMD vector for the score dot products),
/// within its V part `[kv_head][slot][head_dim]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub dtype: KvDtype,
    /// Identifies the model weights: KV from another model must never be accepted.
    pub model_fingerprint: String,
}

/// Bumped whenever the memory order above changes.
const LAYOUT_VERSION: u32 = 1;

impl KvLayout {
    /// Elements of one block of one layer (K and V together).
    pub fn block_layer_elems(&self) -> usize {
        2 * self.block_size * self.num_kv_heads * self.head_dim
    }

    /// Bytes of one block of one layer.
    pub fn block_layer_bytes(&self) -> usize {
        self.block_layer_elems() * self.dtype.size_in_bytes()
    }

    /// Bytes of one block over all layers.
    pub fn block_bytes(&self) -> usize {
        self.block_layer_bytes() * self.num_layers
    }

    /// Bytes of KV for one token over all layers.
    pub fn token_bytes(&self) -> usize {
        self.block_bytes() / self.block_size
    }

    /// A hex SHA-256 over every field and the layout version.
    pub fn hash(&self) -> String {
        let canonical = format!(
            "tandem-kv-layout-v{LAYOUT_VERSION};model={};dtype={};block={};layers={};kv_heads={};head_dim={}",
            self.model_fingerprint,
            self.dtype.name(),
            self.block_size,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim
        );
        let digest = Sha256::digest(canonical.as_bytes());
        digest.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Explains how `other` differs, or `None` when the two are compatible.
    pub fn mismatch(&self, other: &KvLayout) -> Option<String> {
        let mut diffs = Vec::new();
        if self.model_fingerprint != other.model_fingerprint {
            diffs.push(format!(
                "model {} vs {}",
                self.model_fingerprint, other.model_fingerprint
            ));
        }
        if self.dtype != other.dtype {
            diffs.push(format!(
                "dtype {} vs {}",
                self.dtype.name(),
                other.dtype.name()
            ));
        }
        for (name, a, b) in [
            ("block size", self.block_size, other.block_size),
            ("layers", self.num_layers, other.num_layers),
            ("KV heads", self.num_kv_heads, other.num_kv_heads),
            ("head dim", self.head_dim, other.head_dim),
        ] {
            if a != b {
                diffs.push(format!("{name} {a} vs {b}"));
            }
        }
        (!diffs.is_empty()).then(|| diffs.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout {
            num_layers: 30,
            num_kv_heads: 3,
            head_dim: 64,
            block_size: 16,
            dtype: KvDtype::F32,
            model_fingerprint: "abc".into(),
        }
    }

    #[test]
    fn dtypes_size_parse_and_change_the_hash() {
        for (dtype, bytes) in [(KvDtype::F32, 4), (KvDtype::Bf16, 2), (KvDtype::F16, 2)] {
            assert_eq!(dtype.size_in_bytes(), bytes);
            assert_eq!(dtype.name().parse::<KvDtype>().unwrap(), dtype);
        }
        assert!("f8".parse::<KvDtype>().is_err());
        let bf16 = KvLayout {
            dtype: KvDtype::Bf16,
            ..layout()
        };
        assert_eq!(bf16.block_layer_bytes(), layout().block_layer_bytes() / 2);
        assert_ne!(bf16.hash(), layout().hash());
        assert!(
            bf16.mismatch(&layout())
                .unwrap()
                .contains("dtype bf16 vs f32")
        );
    }

    #[test]
    fn sizes_and_hash() {
        let l = layout();
        assert_eq!(l.block_layer_bytes(), 2 * 16 * 3 * 64 * 4);
        assert_eq!(l.token_bytes(), 30 * 2 * 3 * 64 * 4);
        assert_eq!(l.hash(), layout().hash());
        assert_eq!(l.hash().len(), 64);
        assert!(l.mismatch(&layout()).is_none());
        let other = KvLayout {
            num_layers: 29,
            model_fingerprint: "xyz".into(),
            ..layout()
        };
        assert_ne!(l.hash(), other.hash());
        let why = l.mismatch(&other).unwrap();
        assert!(
            why.contains("layers 30 vs 29") && why.contains("model abc vs xyz"),
            "{why}"
        );
    }
}
