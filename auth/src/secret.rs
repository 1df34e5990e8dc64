//! The deployment secret and the keys derived from it.
//!
//! One secret is shared by every process of a deployment. It is never used directly: each
//! purpose gets its own key, `HMAC-SHA256(secret, "tandem/v1/" + purpose)`, so a value made for
//! one purpose (a call token, a worker's identity proof, a KV hello) can never be replayed as
//! another.

use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

use crate::AuthError;

pub(crate) type HmacSha256 = Hmac<Sha256>;

/// Fewest bytes a secret may have (256 bits).
pub const MIN_SECRET_BYTES: usize = 32;

/// The deployment secret. Its `Debug` never shows it.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl Secret {
    /// A secret from its text (surrounding whitespace, such as a file's last newline, is not
    /// part of it). Refuses one shorter than [`MIN_SECRET_BYTES`].
    pub fn new(text: &str) -> Result<Self, AuthError> {
        let text = text.trim();
        if text.len() < MIN_SECRET_BYTES {
            return Err(AuthError::Config(format!(
                "the internal secret must be at least {MIN_SECRET_BYTES} bytes, got {} \
                 (generate one with `openssl rand -hex 32`)",
                text.len()
            )));
        }
        Ok(Self(text.as_bytes().to_vec()))
    }

    /// Reads a secret from a file, which must not be readable by other users.
    pub fn from_file(path: &Path) -> Result<Self, AuthError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| AuthError::Config(format!("cannot read {}: {e}", path.display())))?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(path)
                .map_err(|e| AuthError::Config(format!("cannot stat {}: {e}", path.display())))?
                .permissions()
                .mode();
            if mode & 0o077 != 0 {
                tracing::warn!(
                    file = %path.display(),
                    mode = format!("{:o}", mode & 0o777),
                    "the internal secret file is readable by other users; chmod 600 it"
                );
            }
        }
        Self::new(&text)
    }

    /// A fresh secret of 32 random bytes from the OS, hex-encoded.
    pub fn generate() -> Result<Self, AuthError> {
        Self::new(&hex(&random_bytes::<32>()?))
    }

    /// The key for one purpose.
    pub(crate) fn derive(&self, purpose: &str) -> Key {
        let mut mac = HmacSha256::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        mac.update(b"tandem/v1/");
        mac.update(purpose.as_bytes());
        Key(mac.finalize().into_bytes().into())
    }
}

/// A derived 256-bit key.
#[derive(Clone)]
pub(crate) struct Key([u8; 32]);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(<redacted>)")
    }
}

impl Key {
    /// HMAC-SHA256 of the parts, each prefixed with its length so that no two different part
    /// lists give the same input.
    pub(crate) fn mac(&self, parts: &[&[u8]]) -> [u8; 32] {
        let mut mac = HmacSha256::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        for part in parts {
            mac.update(&(part.len() as u64).to_le_bytes());
            mac.update(part);
        }
        mac.finalize().into_bytes().into()
    }

    /// Whether `tag` is the MAC of `parts`, compared in constant time.
    pub(crate) fn verify(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        let want = self.mac(parts);
        tag.len() == want.len() && bool::from(want.ct_eq(tag))
    }
}

/// `N` bytes from the operating system's random source.
pub fn random_bytes<const N: usize>() -> Result<[u8; N], AuthError> {
    let mut out = [0u8; N];
    getrandom::fill(&mut out)
        .map_err(|e| AuthError::Config(format!("the OS random source failed: {e}")))?;
    Ok(out)
}

/// Lower-case hex.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 15)] as char);
    }
    s
}

/// Parses lower- or upper-case hex of exactly `N` bytes.
pub fn unhex<const N: usize>(text: &str) -> Option<[u8; N]> {
    let bytes = text.as_bytes();
    if bytes.len() != 2 * N {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = [0u8; N];
    for (i, pair) in bytes.chunks_exact(2).enumerate() {
        out[i] = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_long_enough_and_redacted() {
        assert!(Secret::new("short").is_err());
        let s = Secret::new(&"k".repeat(32)).unwrap();
        assert!(!format!("{s:?}").contains("kkkk"));
        let generated = Secret::generate().unwrap();
        assert_eq!(generated.0.len(), 64);
        assert_ne!(generated.0, Secret::generate().unwrap().0);
        // The trailing newline of a file is not part of the secret.
        let a = Secret::new(&format!("{}\n", "x".repeat(40))).unwrap();
        let b = Secret::new(&"x".repeat(40)).unwrap();
        assert_eq!(a.0, b.0);
    }

    #[test]
    fn purposes_get_different_keys_and_macs_bind_part_boundaries() {
        let s = Secret::new(&"s".repeat(32)).unwrap();
        let (a, b) = (s.derive("calls"), s.derive("info"));
        assert_ne!(a.0, b.0);
        assert_ne!(a.mac(&[b"ab", b"c"]), a.mac(&[b"a", b"bc"]));
        let tag = a.mac(&[b"x"]);
        assert!(a.verify(&[b"x"], &tag));
        assert!(!b.verify(&[b"x"], &tag));
        assert!(!a.verify(&[b"x"], &tag[..31]));
    }

    #[test]
    fn hex_round_trip() {
        let bytes = [0u8, 1, 0xab, 0xff];
        assert_eq!(hex(&bytes), "0001abff");
        assert_eq!(unhex::<4>("0001ABff"), Some(bytes));
        assert_eq!(unhex::<4>("0001abf"), None);
        assert_eq!(unhex::<4>("0001abfg"), None);
    }
}
