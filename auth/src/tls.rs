//! Optional mutual TLS for internal traffic that crosses hosts: one CA, and a certificate
//! and key per process (the same files may serve every process). Servers require a client
//! certificate signed by the CA; clients verify the server's certificate against the CA and
//! the name in the worker's URL (or `server_name`, for certificates issued to one shared
//! name). With TLS on, worker URLs are dialled as `https`, and raw TCP KV connections run
//! inside the same mutual TLS (rustls, as tonic uses).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

use crate::AuthError;

/// Where the PEM files are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The name server certificates are checked against instead of each URL's host.
    pub server_name: Option<String>,
}

/// The loaded PEM material, and the rustls configurations of the raw TCP KV transport.
#[derive(Clone)]
pub struct Tls {
    ca: Vec<u8>,
    cert: Vec<u8>,
    key: Vec<u8>,
    server_name: Option<String>,
    kv_server: Arc<rustls::ServerConfig>,
    kv_client: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

fn read(path: &Path, what: &str) -> Result<Vec<u8>, AuthError> {
    let bytes = std::fs::read(path).map_err(|e| {
        AuthError::Config(format!(
            "cannot read the TLS {what} {}: {e}",
            path.display()
        ))
    })?;
    if !bytes.windows(11).any(|w| w == b"-----BEGIN ") {
        return Err(AuthError::Config(format!(
            "the TLS {what} {} is not PEM",
            path.display()
        )));
    }
    Ok(bytes)
}

fn tls_error(what: &str, e: impl std::fmt::Display) -> AuthError {
    AuthError::Config(format!("internal TLS {what}: {e}"))
}

impl Tls {
    pub fn load(files: &TlsFiles) -> Result<Self, AuthError> {
        Self::new(
            read(&files.ca, "CA certificate")?,
            read(&files.cert, "certificate")?,
            read(&files.key, "key")?,
            files.server_name.clone(),
        )
    }

    /// From PEM text directly (tests and embedders).
    pub fn from_pem(
        ca: &str,
        cert: &str,
        key: &str,
        server_name: Option<&str>,
    ) -> Result<Self, AuthError> {
        Self::new(
            ca.as_bytes().to_vec(),
            cert.as_bytes().to_vec(),
            key.as_bytes().to_vec(),
            server_name.map(str::to_string),
        )
    }

    fn new(
        ca: Vec<u8>,
        cert: Vec<u8>,
        key: Vec<u8>,
        server_name: Option<String>,
    ) -> Result<Self, AuthError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(&ca) {
            roots
                .add(c.map_err(|e| tls_error("CA certificate", e))?)
                .map_err(|e| tls_error("CA certificate", e))?;
        }
        if roots.is_empty() {
            return Err(tls_error("CA certificate", "no certificate in the file"));
        }
        let roots = Arc::new(roots);
        let chain = || -> Result<Vec<CertificateDer<'static>>, AuthError> {
            CertificateDer::pem_slice_iter(&cert)
                .collect::<Result<_, _>>()
                .map_err(|e| tls_error("certificate", e))
        };
        let private = || PrivateKeyDer::from_pem_slice(&key).map_err(|e| tls_error("key", e));
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            roots.clone(),
            provider.clone(),
        )
        .build()
        .map_err(|e| tls_error("client verifier", e))?;
        let kv_server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_error("server", e))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain()?, private()?)
            .map_err(|e| tls_error("server certificate", e))?;
        let kv_client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_error("client", e))?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain()?, private()?)
            .map_err(|e| tls_error("client certificate", e))?;
        Ok(Self {
            ca,
            cert,
            key,
            server_name,
            kv_server: Arc::new(kv_server),
            kv_client: Arc::new(kv_client),
        })
    }

    /// The raw TCP KV listener's side.
    pub(crate) fn kv_acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.kv_server.clone())
    }

    /// The sender's side toward `host` (an address or a name): the connector and the name
    /// the listener's certificate must carry.
    pub(crate) fn kv_connector(
        &self,
        host: &str,
    ) -> Result<(tokio_rustls::TlsConnector, ServerName<'static>), AuthError> {
        let name = self.server_name.as_deref().unwrap_or(host);
        let name = name.trim_start_matches('[').trim_end_matches(']');
        let name = ServerName::try_from(name.to_string())
            .map_err(|e| tls_error("server name", format!("`{name}`: {e}")))?;
        Ok((
            tokio_rustls::TlsConnector::from(self.kv_client.clone()),
            name,
        ))
    }

    pub(crate) fn server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(Identity::from_pem(&self.cert, &self.key))
            .client_ca_root(Certificate::from_pem(&self.ca))
    }

    pub(crate) fn client(&self) -> ClientTlsConfig {
        let config = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca))
            .identity(Identity::from_pem(&self.cert, &self.key));
        match &self.server_name {
            Some(name) => config.domain_name(name.clone()),
            None => config,
        }
    }
}
