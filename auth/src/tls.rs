//! Optional mutual TLS for internal traffic that crosses hosts: one CA, and a certificate
//! and key per process (the same files may serve every process). Servers require a client
//! certificate signed by the CA; clients verify the server's certificate against the CA and
//! the name in the worker's URL (or `server_name`, for certificates issued to one shared
//! name). With TLS on, worker URLs are dialled as `https`.

use std::path::{Path, PathBuf};

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

/// The loaded PEM material.
#[derive(Clone)]
pub struct Tls {
    ca: Vec<u8>,
    cert: Vec<u8>,
    key: Vec<u8>,
    server_name: Option<String>,
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

impl Tls {
    pub fn load(files: &TlsFiles) -> Result<Self, AuthError> {
        Ok(Self {
            ca: read(&files.ca, "CA certificate")?,
            cert: read(&files.cert, "certificate")?,
            key: read(&files.key, "key")?,
            server_name: files.server_name.clone(),
        })
    }

    /// From PEM text directly (tests and embedders).
    pub fn from_pem(ca: &str, cert: &str, key: &str, server_name: Option<&str>) -> Self {
        Self {
            ca: ca.as_bytes().to_vec(),
            cert: cert.as_bytes().to_vec(),
            key: key.as_bytes().to_vec(),
            server_name: server_name.map(str::to_string),
        }
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
