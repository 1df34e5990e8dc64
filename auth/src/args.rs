//! The flags every tandem server shares for its internal credentials (each also a `TANDEM_*`
//! variable), and their loading into an [`InternalAuth`].
//!
//! The secret itself is accepted only from the environment or a file: a command line is
//! visible to every user through `ps`, so `--internal-secret` on one is refused.

use std::ffi::OsString;
use std::path::PathBuf;

use crate::{AuthError, InternalAuth, Secret, Tls, TlsFiles};

/// Internal authentication flags.
#[derive(Clone, Default, clap::Args)]
pub struct InternalAuthArgs {
    /// The deployment secret (at least 32 bytes), from the environment only.
    #[arg(
        long = "internal-secret",
        env = "TANDEM_INTERNAL_SECRET",
        hide_env_values = true,
        hide = true
    )]
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

impl InternalAuthArgs {
    /// Reads the secret and the TLS files.
    pub fn load(&self) -> Result<InternalAuth, AuthError> {
        let secret = match (&self.internal_secret, &self.internal_secret_file) {
            (Some(_), Some(_)) => {
                return Err(AuthError::Config(
                    "give the internal secret once: TANDEM_INTERNAL_SECRET or \
                     TANDEM_INTERNAL_SECRET_FILE, not both"
                        .into(),
                ));
            }
            (Some(text), None) => Some(Secret::new(text)?),
            (None, Some(path)) => Some(Secret::from_file(path)?),
            (None, None) => None,
        };
        let tls = match (
            &self.internal_tls_ca,
            &self.internal_tls_cert,
            &self.internal_tls_key,
        ) {
            (None, None, None) => None,
            (Some(ca), Some(cert), Some(key)) => Some(Tls::load(&TlsFiles {
                ca: ca.clone(),
                cert: cert.clone(),
                key: key.clone(),
                server_name: self.internal_tls_server_name.clone(),
            })?),
            _ => {
                return Err(AuthError::Config(
                    "internal TLS needs all three of --internal-tls-ca, --internal-tls-cert \
                     and --internal-tls-key"
                        .into(),
                ));
            }
        };
        Ok(InternalAuth::new(
            secret.as_ref(),
            tls,
            self.insecure_no_internal_auth,
        ))
    }
}

/// Refuses a secret given on the command line (`args` as the process received them).
pub fn refuse_secret_on_command_line(
    args: impl IntoIterator<Item = OsString>,
) -> Result<(), AuthError> {
    let given = args.into_iter().any(|a| {
        let a = a.to_string_lossy();
        a == "--internal-secret" || a.starts_with("--internal-secret=")
    });
    if given {
        return Err(AuthError::Config(
            "--internal-secret on the command line would show the secret to every user (ps); \
             pass it in TANDEM_INTERNAL_SECRET or a file named by TANDEM_INTERNAL_SECRET_FILE"
                .into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        auth: InternalAuthArgs,
    }

    #[test]
    fn the_secret_never_comes_from_argv_and_never_prints() {
        let argv = ["w", "--internal-secret", "x"].map(OsString::from);
        assert!(refuse_secret_on_command_line(argv).is_err());
        let argv = ["w", "--internal-secret=x"].map(OsString::from);
        assert!(refuse_secret_on_command_line(argv).is_err());
        let argv = ["w", "--internal-secret-file", "/run/s"].map(OsString::from);
        assert!(refuse_secret_on_command_line(argv).is_ok());
        let args = InternalAuthArgs {
            internal_secret: Some("s".repeat(40)),
            ..Default::default()
        };
        assert!(!format!("{args:?}").contains("ssss"));
        assert!(args.load().unwrap().has_secret());
    }

    #[test]
    fn files_and_partial_tls() {
        let dir = std::env::temp_dir().join(format!("tandem-auth-args-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("secret");
        std::fs::write(&path, format!("{}\n", "f".repeat(64))).unwrap();
        let flags =
            Flags::try_parse_from(["w", "--internal-secret-file", path.to_str().unwrap()]).unwrap();
        assert!(flags.auth.load().unwrap().has_secret());
        std::fs::write(&path, "short").unwrap();
        assert!(flags.auth.load().is_err(), "too short");
        let partial = Flags::try_parse_from(["w", "--internal-tls-ca", "/x"]).unwrap();
        assert!(
            partial
                .auth
                .load()
                .unwrap_err()
                .to_string()
                .contains("all three")
        );
        let none = Flags::try_parse_from(["w"]).unwrap();
        assert!(!none.auth.load().unwrap().has_secret());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
