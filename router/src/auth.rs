//! The optional API key: `Authorization: Bearer <key>` on `/v1/*` and the TGI routes.
//!
//! Keys are compared as SHA-256 digests with `subtle`'s constant-time equality, so neither the
//! content nor the length of the configured key leaks through response timing (TGI compares
//! lowercased strings, which is neither; vLLM hashes and uses `compare_digest`, as we do).
//! The key itself is never stored or logged, only its digest.

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// A configured API key, kept only as its digest.
#[derive(Clone)]
pub struct ApiKey {
    digest: [u8; 32],
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

impl ApiKey {
    /// Refuses empty keys and keys with surrounding whitespace (a likely copy-paste error
    /// that would make every request fail with 401).
    pub fn new(key: &str) -> Result<Self, String> {
        if key.is_empty() {
            return Err("--api-key must not be empty".into());
        }
        if key.trim() != key {
            return Err("--api-key must not start or end with whitespace".into());
        }
        Ok(Self {
            digest: Sha256::digest(key.as_bytes()).into(),
        })
    }

    /// Whether `candidate` is exactly the key, compared in constant time.
    pub fn matches(&self, candidate: &[u8]) -> bool {
        let digest: [u8; 32] = Sha256::digest(candidate).into();
        bool::from(self.digest.ct_eq(&digest))
    }

    /// Whether an `Authorization` header value carries the key. The scheme name is
    /// case-insensitive (RFC 9110); the token after one space is compared exactly.
    pub fn accepts_authorization(&self, header: Option<&[u8]>) -> bool {
        let Some(value) = header else {
            return false;
        };
        const SCHEME: &[u8] = b"bearer ";
        if value.len() < SCHEME.len() || !value[..SCHEME.len()].eq_ignore_ascii_case(SCHEME) {
            return false;
        }
        self.matches(&value[SCHEME.len()..])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_key_only() {
        let key = ApiKey::new("s3cret-Key").unwrap();
        assert!(key.accepts_authorization(Some(b"Bearer s3cret-Key")));
        assert!(key.accepts_authorization(Some(b"bearer s3cret-Key")));
        for bad in [
            &b"Bearer s3cret-key"[..],
            b"Bearer S3CRET-KEY",
            b"Bearer s3cret-Key ",
            b"Bearer  s3cret-Key",
            b"Bearer s3cret-Ke",
            b"Bearer s3cret-Key2",
            b"Basic s3cret-Key",
            b"s3cret-Key",
            b"Bearer ",
            b"",
        ] {
            assert!(
                !key.accepts_authorization(Some(bad)),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        assert!(!key.accepts_authorization(None));
    }

    #[test]
    fn refuses_unusable_keys_and_redacts() {
        assert!(ApiKey::new("").is_err());
        assert!(ApiKey::new(" k").is_err());
        let key = ApiKey::new("topsecret").unwrap();
        assert!(!format!("{key:?}").contains("topsecret"));
    }
}
