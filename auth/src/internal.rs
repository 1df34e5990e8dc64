//! [`InternalAuth`]: this process's internal credentials (the keys derived from the
//! deployment secret, and TLS when on) and what they sign and check: call tokens, worker
//! info proofs, KV hellos, whether a worker may listen beyond loopback.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use http::HeaderValue;
use tandem_proto::v1::WorkerInfo;
use tonic::transport::{Endpoint, ServerTlsConfig};

use crate::error::AuthError;
use crate::proof;
use crate::secret::{Key, Secret, random_bytes};
use crate::tls::Tls;
use crate::token::{self, Verifier};

/// The keys of one secret.
#[derive(Debug)]
struct Keys {
    info: Key,
    kv: Key,
    calls: Key,
    verifier: Verifier,
}

#[derive(Debug)]
struct Inner {
    keys: Option<Keys>,
    tls: Option<Tls>,
    insecure: bool,
}

/// This process's internal credentials: cheap to clone, shared by every server and client.
#[derive(Debug, Clone)]
pub struct InternalAuth(Arc<Inner>);

impl InternalAuth {
    /// Credentials from their parts; `insecure` allows listening beyond loopback without a
    /// secret.
    pub fn new(secret: Option<&Secret>, tls: Option<Tls>, insecure: bool) -> Self {
        let keys = secret.map(|secret| {
            let calls = secret.derive("calls");
            Keys {
                info: secret.derive("worker-info"),
                kv: secret.derive("kv-hello"),
                verifier: Verifier::new(calls.clone()),
                calls,
            }
        });
        Self(Arc::new(Inner {
            keys,
            tls,
            insecure,
        }))
    }

    /// No secret and no TLS: nothing is signed or checked (loopback development and tests).
    pub fn none() -> Self {
        Self::new(None, None, false)
    }

    /// Signs and checks with `secret`, without TLS.
    pub fn with_secret(secret: &Secret) -> Self {
        Self::new(Some(secret), None, false)
    }

    /// Whether this process holds a secret (calls are signed and checked).
    pub fn has_secret(&self) -> bool {
        self.0.keys.is_some()
    }

    /// Whether internal gRPC runs over mutual TLS.
    pub fn has_tls(&self) -> bool {
        self.0.tls.is_some()
    }

    /// Refuses to serve on a non-loopback `host` without a secret, unless insecure mode was
    /// asked for (then it says so, loudly).
    pub fn check_listen(&self, host: &str) -> Result<(), AuthError> {
        if self.has_secret() {
            return Ok(());
        }
        if is_loopback(host) {
            tracing::warn!(
                host,
                "no internal secret: any local user can call this process's internal services \
                 (set TANDEM_INTERNAL_SECRET or TANDEM_INTERNAL_SECRET_FILE; `tandem up` does)"
            );
            return Ok(());
        }
        if self.0.insecure {
            tracing::error!(
                host,
                "INSECURE: serving internal services on a non-loopback address WITHOUT \
                 authentication (--insecure-no-internal-auth): anyone who reaches these ports \
                 can run requests, reserve every KV block and write KV"
            );
            return Ok(());
        }
        Err(AuthError::Config(format!(
            "refusing to listen on {host} without an internal secret: anyone who reaches the \
             port could use this worker. Set TANDEM_INTERNAL_SECRET (or \
             TANDEM_INTERNAL_SECRET_FILE), listen on 127.0.0.1, or pass \
             --insecure-no-internal-auth on an isolated network"
        )))
    }

    /// The `authorization` value for one call of `path`, if this process signs calls.
    pub fn call_token(&self, path: &str) -> Option<HeaderValue> {
        let keys = self.0.keys.as_ref()?;
        match token::mint(&keys.calls, path, SystemTime::now()) {
            Ok(t) => HeaderValue::from_str(&t).ok(),
            Err(e) => {
                tracing::error!(error = %e, "cannot sign an internal call");
                None
            }
        }
    }

    /// Checks the `authorization` header of a call of `path`. Without a secret every call
    /// passes.
    pub fn verify_call(
        &self,
        path: &str,
        header: Option<&[u8]>,
        now: SystemTime,
        clock: Instant,
    ) -> Result<(), AuthError> {
        match &self.0.keys {
            None => Ok(()),
            Some(keys) => keys.verifier.verify(path, header, now, clock),
        }
    }

    /// A tonic endpoint for a worker URL: `https` with the client side of mutual TLS when TLS
    /// is on.
    pub fn endpoint(&self, url: &str) -> Result<Endpoint, AuthError> {
        let bad = |e: tonic::transport::Error| AuthError::Config(format!("URL `{url}`: {e}"));
        match &self.0.tls {
            None => Endpoint::from_shared(url.to_string()).map_err(bad),
            Some(tls) => {
                let url = match url.strip_prefix("http://") {
                    Some(rest) => format!("https://{rest}"),
                    None => url.to_string(),
                };
                Endpoint::from_shared(url.clone())
                    .and_then(|e| e.tls_config(tls.client()))
                    .map_err(bad)
            }
        }
    }

    /// The server side of mutual TLS, when on.
    pub fn server_tls(&self) -> Option<ServerTlsConfig> {
        self.0.tls.as_ref().map(Tls::server)
    }

    /// For the raw TCP KV listener: the TLS acceptor, when internal TLS is on.
    pub fn kv_acceptor(&self) -> Option<tokio_rustls::TlsAcceptor> {
        self.0.tls.as_ref().map(Tls::kv_acceptor)
    }

    /// For a raw TCP KV connection to `host`: the TLS connector and the name to verify, when
    /// internal TLS is on.
    pub fn kv_connector(
        &self,
        host: &str,
    ) -> Result<
        Option<(
            tokio_rustls::TlsConnector,
            tokio_rustls::rustls::pki_types::ServerName<'static>,
        )>,
        AuthError,
    > {
        self.0
            .tls
            .as_ref()
            .map(|t| t.kv_connector(host))
            .transpose()
    }

    /// A worker's proof for `GetInfo`: over the caller's challenge and `info`'s fields (empty
    /// without a secret).
    pub fn worker_info_proof(&self, challenge: &[u8], info: &WorkerInfo) -> Vec<u8> {
        let Some(keys) = &self.0.keys else {
            return Vec::new();
        };
        let fields = proof::info_fields(info);
        let mut parts: Vec<&[u8]> = vec![challenge];
        parts.extend(fields.iter().map(Vec::as_slice));
        keys.info.mac(&parts).to_vec()
    }

    /// Sets `info.proof` for a `GetInfo` that sent `challenge`.
    pub fn sign_worker_info(&self, info: &mut WorkerInfo, challenge: &[u8]) {
        info.proof = Vec::new();
        info.proof = self.worker_info_proof(challenge, info);
    }

    /// Checks a worker's `GetInfo` answer to our `challenge`. Without a secret there is
    /// nothing to check.
    pub fn verify_worker_info(&self, challenge: &[u8], info: &WorkerInfo) -> Result<(), AuthError> {
        let Some(keys) = &self.0.keys else {
            return Ok(());
        };
        let fields = proof::info_fields(info);
        let mut parts: Vec<&[u8]> = vec![challenge];
        parts.extend(fields.iter().map(Vec::as_slice));
        if keys.info.verify(&parts, &info.proof) {
            Ok(())
        } else {
            Err(AuthError::BadProof)
        }
    }

    /// The sender's answer to a KV listener's `challenge` for a transfer into `lease`.
    pub fn kv_hello_proof(&self, challenge: &[u8], lease: &[u8]) -> Vec<u8> {
        match &self.0.keys {
            None => Vec::new(),
            Some(keys) => keys.kv.mac(&[challenge, lease]).to_vec(),
        }
    }

    /// Checks a KV hello. Without a secret there is nothing to check.
    pub fn verify_kv_hello(
        &self,
        challenge: &[u8],
        lease: &[u8],
        proof: &[u8],
    ) -> Result<(), AuthError> {
        match &self.0.keys {
            None => Ok(()),
            Some(keys) if keys.kv.verify(&[challenge, lease], proof) => Ok(()),
            Some(_) => Err(AuthError::BadProof),
        }
    }
}

/// A fresh 32-byte challenge from the OS random source.
pub fn challenge() -> Result<[u8; 32], AuthError> {
    random_bytes::<32>()
}

/// Whether `host` (an address or `localhost`) is a loopback address.
pub fn is_loopback(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(c: &str) -> Secret {
        Secret::new(&c.repeat(32)).unwrap()
    }

    #[test]
    fn listening_beyond_loopback_needs_a_secret_or_the_insecure_flag() {
        let none = InternalAuth::none();
        assert!(none.check_listen("127.0.0.1").is_ok());
        assert!(none.check_listen("::1").is_ok());
        assert!(none.check_listen("localhost").is_ok());
        let err = none.check_listen("0.0.0.0").unwrap_err().to_string();
        assert!(err.contains("TANDEM_INTERNAL_SECRET"), "{err}");
        assert!(none.check_listen("10.1.2.3").is_err());
        assert!(
            InternalAuth::new(None, None, true)
                .check_listen("0.0.0.0")
                .is_ok()
        );
        assert!(
            InternalAuth::with_secret(&secret("a"))
                .check_listen("0.0.0.0")
                .is_ok()
        );
    }

    #[test]
    fn worker_info_proofs_bind_the_challenge_the_fields_and_the_secret() {
        let auth = InternalAuth::with_secret(&secret("a"));
        let mut info = WorkerInfo {
            worker_id: "decode-0".into(),
            shm_path: "/dev/shm/tandem-kv-decode-0-1".into(),
            kv_tcp_port: 7202,
            ..Default::default()
        };
        let challenge = [7u8; 32];
        info.proof = auth.worker_info_proof(&challenge, &info);
        assert!(auth.verify_worker_info(&challenge, &info).is_ok());
        assert!(auth.verify_worker_info(&[8u8; 32], &info).is_err());
        let other = InternalAuth::with_secret(&secret("b"));
        assert!(other.verify_worker_info(&challenge, &info).is_err());
        for tamper in [
            |i: &mut WorkerInfo| i.shm_path = "/etc/passwd".into(),
            |i: &mut WorkerInfo| i.kv_tcp_port = 22,
            |i: &mut WorkerInfo| i.advertise_host = "evil.example".into(),
            |i: &mut WorkerInfo| i.shm_inode = 42,
        ] {
            let mut forged = info.clone();
            tamper(&mut forged);
            assert!(auth.verify_worker_info(&challenge, &forged).is_err());
        }
        // Without a secret there is no proof, and nothing to check.
        assert!(
            InternalAuth::none()
                .worker_info_proof(&challenge, &info)
                .is_empty()
        );
        assert!(
            InternalAuth::none()
                .verify_worker_info(&challenge, &info)
                .is_ok()
        );
    }

    #[test]
    fn kv_hellos() {
        let auth = InternalAuth::with_secret(&secret("a"));
        let proof = auth.kv_hello_proof(b"nonce", b"lease");
        assert!(auth.verify_kv_hello(b"nonce", b"lease", &proof).is_ok());
        assert!(auth.verify_kv_hello(b"nonce", b"other", &proof).is_err());
        assert!(auth.verify_kv_hello(b"nonce2", b"lease", &proof).is_err());
        assert!(auth.verify_kv_hello(b"nonce", b"lease", &[]).is_err());
    }

    #[test]
    fn calls_signed_by_one_process_pass_another_of_the_same_deployment() {
        let client = InternalAuth::with_secret(&secret("a"));
        let server = InternalAuth::with_secret(&secret("a"));
        let token = client.call_token("/x").unwrap();
        let ok = server.verify_call(
            "/x",
            Some(token.as_bytes()),
            SystemTime::now(),
            Instant::now(),
        );
        assert!(ok.is_ok());
        assert!(InternalAuth::none().call_token("/x").is_none());
        let stranger = InternalAuth::with_secret(&secret("b"))
            .call_token("/x")
            .unwrap();
        assert!(
            server
                .verify_call(
                    "/x",
                    Some(stranger.as_bytes()),
                    SystemTime::now(),
                    Instant::now()
                )
                .is_err()
        );
    }

    /// A CA and one leaf certificate for `localhost` and 127.0.0.1, as PEM.
    pub(crate) fn test_pki() -> (String, String, String) {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair, SanType};
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = ca.self_signed(&ca_key).unwrap();
        let key = KeyPair::generate().unwrap();
        let mut leaf = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        leaf.subject_alt_names
            .push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
        let leaf = leaf.signed_by(&key, &ca, &ca_key).unwrap();
        (ca.pem(), leaf.pem(), key.serialize_pem())
    }

    #[test]
    fn tls_dials_https() {
        let (ca, cert, key) = test_pki();
        let tls = Tls::from_pem(&ca, &cert, &key, Some("tandem")).unwrap();
        assert!(Tls::from_pem("-----BEGIN CERTIFICATE-----", &cert, &key, None).is_err());
        let auth = InternalAuth::new(None, Some(tls), false);
        assert!(auth.has_tls());
        let e = auth.endpoint("http://127.0.0.1:7201").unwrap();
        assert_eq!(e.uri().scheme_str(), Some("https"));
        let plain = InternalAuth::none()
            .endpoint("http://127.0.0.1:7201")
            .unwrap();
        assert_eq!(plain.uri().scheme_str(), Some("http"));
    }
}
