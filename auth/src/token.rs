//! Per-call tokens for the workers' gRPC services.
//!
//! Every call carries `authorization: Bearer tandem1.<unix ms>.<nonce>.<mac>`, where the MAC
//! covers the method path, the time and a fresh 128-bit nonce. So the secret never travels, a
//! token works for one method only (one minted for a `GetLoad` poll cannot open a `Generate`),
//! only within [`WINDOW`] of its time, and only once: the verifier remembers the nonces it saw
//! inside the window. A token that leaked to a wrong address (a spoofed DNS answer, a
//! misconfigured URL) is worth one call of that method for a minute at most; mutual TLS
//! (see `tls`) closes even that.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::AuthError;
use crate::secret::{Key, hex, random_bytes, unhex};

/// How far a token's time may be from the verifier's clock, either way.
pub const WINDOW: Duration = Duration::from_secs(60);
/// Nonces remembered per generation of the replay cache; beyond it calls are refused rather
/// than forgetting nonces that are still inside the window.
const MAX_REMEMBERED: usize = 2 << 20;
const PREFIX: &str = "tandem1";

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The `authorization` value for one call of `path`.
pub(crate) fn mint(key: &Key, path: &str, now: SystemTime) -> Result<String, AuthError> {
    let ms = unix_ms(now);
    let nonce = random_bytes::<16>()?;
    let mac = key.mac(&[path.as_bytes(), &ms.to_le_bytes(), &nonce]);
    Ok(format!(
        "Bearer {PREFIX}.{ms}.{}.{}",
        hex(&nonce),
        hex(&mac)
    ))
}

/// Checks tokens and remembers their nonces.
#[derive(Debug)]
pub(crate) struct Verifier {
    key: Key,
    seen: Mutex<Seen>,
}

/// Two generations of nonces, each [`WINDOW`] × 2 long: a nonce stays remembered for at least
/// twice the window after it was seen, by which time its token has expired.
#[derive(Debug)]
struct Seen {
    current: HashSet<u128>,
    previous: HashSet<u128>,
    rotated: Instant,
}

impl Verifier {
    pub(crate) fn new(key: Key) -> Self {
        Self {
            key,
            seen: Mutex::new(Seen {
                current: HashSet::new(),
                previous: HashSet::new(),
                rotated: Instant::now(),
            }),
        }
    }

    /// Accepts `header` (the whole `authorization` value) for a call of `path` at `now`.
    pub(crate) fn verify(
        &self,
        path: &str,
        header: Option<&[u8]>,
        now: SystemTime,
        clock: Instant,
    ) -> Result<(), AuthError> {
        let header = header.ok_or(AuthError::Missing)?;
        let text = std::str::from_utf8(header).map_err(|_| AuthError::Malformed)?;
        let token = text
            .strip_prefix("Bearer ")
            .or_else(|| text.strip_prefix("bearer "))
            .ok_or(AuthError::Malformed)?;
        let mut parts = token.split('.');
        let (Some(PREFIX), Some(ms), Some(nonce), Some(mac), None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return Err(AuthError::Malformed);
        };
        let ms: u64 = ms.parse().map_err(|_| AuthError::Malformed)?;
        let nonce = unhex::<16>(nonce).ok_or(AuthError::Malformed)?;
        let mac = unhex::<32>(mac).ok_or(AuthError::Malformed)?;
        if !self
            .key
            .verify(&[path.as_bytes(), &ms.to_le_bytes(), &nonce], &mac)
        {
            return Err(AuthError::BadProof);
        }
        let skew_ms = unix_ms(now).abs_diff(ms);
        if u128::from(skew_ms) >= WINDOW.as_millis() {
            return Err(AuthError::Expired {
                skew_ms,
                limit_s: WINDOW.as_secs(),
            });
        }
        self.remember(u128::from_le_bytes(nonce), clock)
    }

    fn remember(&self, nonce: u128, clock: Instant) -> Result<(), AuthError> {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if clock.saturating_duration_since(seen.rotated) >= 2 * WINDOW {
            seen.previous = std::mem::take(&mut seen.current);
            seen.rotated = clock;
        }
        if seen.current.contains(&nonce) || seen.previous.contains(&nonce) {
            return Err(AuthError::Replayed);
        }
        if seen.current.len() >= MAX_REMEMBERED {
            return Err(AuthError::TooManyCalls);
        }
        seen.current.insert(nonce);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::secret::Secret;

    fn key(s: &str) -> Key {
        Secret::new(&s.repeat(32)).unwrap().derive("calls")
    }

    #[test]
    fn a_token_works_once_for_its_method_within_the_window() {
        let k = key("a");
        let v = Verifier::new(k.clone());
        let now = SystemTime::now();
        let clock = Instant::now();
        let t = mint(&k, "/tandem.v1.DecodeService/GetLoad", now).unwrap();
        let path = "/tandem.v1.DecodeService/GetLoad";
        assert!(v.verify(path, Some(t.as_bytes()), now, clock).is_ok());
        assert!(matches!(
            v.verify(path, Some(t.as_bytes()), now, clock),
            Err(AuthError::Replayed)
        ));
        let t = mint(&k, path, now).unwrap();
        assert!(matches!(
            v.verify(
                "/tandem.v1.DecodeService/Generate",
                Some(t.as_bytes()),
                now,
                clock
            ),
            Err(AuthError::BadProof)
        ));
        let old = mint(&k, path, now - WINDOW).unwrap();
        assert!(matches!(
            v.verify(path, Some(old.as_bytes()), now, clock),
            Err(AuthError::Expired { .. })
        ));
        let future = mint(&k, path, now + WINDOW / 2).unwrap();
        assert!(v.verify(path, Some(future.as_bytes()), now, clock).is_ok());
    }

    #[test]
    fn strangers_and_garbage_are_refused() {
        let v = Verifier::new(key("a"));
        let path = "/p";
        let now = SystemTime::now();
        let clock = Instant::now();
        let foreign = mint(&key("b"), path, now).unwrap();
        assert!(matches!(
            v.verify(path, Some(foreign.as_bytes()), now, clock),
            Err(AuthError::BadProof)
        ));
        assert!(matches!(
            v.verify(path, None, now, clock),
            Err(AuthError::Missing)
        ));
        for bad in [
            "Bearer ",
            "Basic x",
            "Bearer tandem1.1.2.3",
            "Bearer tandem1.x.00.00",
            "Bearer tandem2.1.00000000000000000000000000000000.00",
            "Bearer tandem1.1.00000000000000000000000000000000.00.extra",
        ] {
            assert!(
                matches!(
                    v.verify(path, Some(bad.as_bytes()), now, clock),
                    Err(AuthError::Malformed)
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn nonces_are_forgotten_only_after_their_tokens_expired() {
        let k = key("a");
        let v = Verifier::new(k.clone());
        let path = "/p";
        let now = SystemTime::now();
        let clock = Instant::now();
        let t = mint(&k, path, now).unwrap();
        v.verify(path, Some(t.as_bytes()), now, clock).unwrap();
        // One rotation later the nonce is in the previous generation: still refused.
        let later = clock + 2 * WINDOW;
        assert!(matches!(
            v.verify(path, Some(t.as_bytes()), now, later),
            Err(AuthError::Replayed)
        ));
        // Two rotations later it is forgotten, but the token has long expired.
        let much_later = clock + 4 * WINDOW;
        assert!(matches!(
            v.verify(path, Some(t.as_bytes()), now + 4 * WINDOW, much_later),
            Err(AuthError::Expired { .. })
        ));
    }
}
