//! Loading the internal-credential flags (`tandem_cli::InternalAuthArgs`, shared by every
//! tandem server) into an [`InternalAuth`].
//!
//! The secret itself is accepted only from the environment or a file: a command line is
//! visible to every user through `ps`, so `--internal-secret` on one is refused.

use std::ffi::OsString;

pub use tandem_cli::InternalAuthArgs;

use crate::{AuthError, InternalAuth, Secret, Tls, TlsFiles};

/// Reads the secret and the TLS files the flags name.
pub trait LoadInternalAuth {
    fn load(&self) -> Result<InternalAuth, AuthError>;
}

impl LoadInternalAuth for InternalAuthArgs {
    fn load(&self) -> Result<InternalAuth, AuthError> {
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
