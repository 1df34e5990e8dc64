//! The flags every tandem server shares for its internal credentials (each also a
//! `TANDEM_*` variable). `tandem-auth` loads them into credentials.
//!
//! The secret itself is accepted only from the environment or a file: a command line is
//! visible to every user through `ps`, so the binaries refuse `--internal-secret` on one, and
//! [`crate::to_args`] never writes it.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Internal authentication flags.
#[derive(Clone, Default, PartialEq, Eq, clap::Args, Serialize, Deserialize)]
pub struct InternalAuthArgs {
    /// The deployment secret (at least 32 bytes), from the environment only.
    #[arg(
        long = "internal-secret",
        env = "TANDEM_INTERNAL_SECRET",
        hide_env_values = true,
        hide = true
    )]
    #[serde(skip)]
    pub internal_secret: Option<String>,
    /// A file holding the deployment secret (at least 32 bytes; mode 600).
    #[arg(long, env = "TANDEM_INTERNAL_SECRET_FILE")]
    pub internal_secret_file: Option<PathBuf>,
    /// CA certificate (PEM) for mutual TLS between tandem processes.
    #[arg(long, env = "TANDEM_INTERNAL_TLS_CA")]
    pub internal_tls_ca: Option<PathBuf>,
    /// This process's certificate (PEM) for internal mutual TLS.
    #[arg(long, env = "TANDEM_INTERNAL_TLS_CERT")]
    pub internal_tls_cert: Option<PathBuf>,
    /// This process's private key (PEM) for internal mutual TLS.
    #[arg(long, env = "TANDEM_INTERNAL_TLS_KEY")]
    pub internal_tls_key: Option<PathBuf>,
    /// The name every internal server certificate carries, when it is not each URL's host.
    #[arg(long, env = "TANDEM_INTERNAL_TLS_SERVER_NAME")]
    pub internal_tls_server_name: Option<String>,
    /// Listen beyond loopback without a secret: anyone who reaches the ports can use this
    /// process. Only for isolated test networks; logged loudly.
    #[arg(long, env = "TANDEM_INSECURE_NO_INTERNAL_AUTH")]
    pub insecure_no_internal_auth: bool,
}

impl std::fmt::Debug for InternalAuthArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InternalAuthArgs")
            .field(
                "internal_secret",
                &self.internal_secret.as_ref().map(|_| "<redacted>"),
            )
            .field("internal_secret_file", &self.internal_secret_file)
            .field("internal_tls_ca", &self.internal_tls_ca)
            .field("internal_tls_cert", &self.internal_tls_cert)
            .field("internal_tls_key", &self.internal_tls_key)
            .field("internal_tls_server_name", &self.internal_tls_server_name)
            .field("insecure_no_internal_auth", &self.insecure_no_internal_auth)
            .finish()
    }
}
