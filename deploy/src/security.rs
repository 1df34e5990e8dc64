//! How the processes of one deployment trust each other: the internal secret every worker and
//! the router share, and the optional internal mTLS files, handed over as environment
//! variables (never flags: any local user can read a process's argv in `ps`).
//!
//! By default `tandem up` draws a fresh 32-byte secret from the OS RNG for each deployment;
//! `[security] secret_file` names a file instead (several machines must then share it), and
//! `[security] insecure = true` passes none. The secret's value is held in [`Secret`], whose
//! `Debug` redacts it, and is only ever written into a child's environment.
//!
//! The deployment file's `[security]` section ([`SecuritySection`]) and its checks live here
//! too ([`check`], [`check_files`], [`file_warnings`]), for `tandem check` and `tandem up`:
//! they read a secret file's length, never show its content.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use rand::TryRngCore;
use rand::rngs::OsRng;
use serde::Deserialize;

/// The deployment file's `[security]` section: how the deployment's processes authenticate
/// each other. It lives here, beside what reads it, so the file's model (`config`) depends on
/// this module and not the other way round.
#[derive(Debug, Clone, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct SecuritySection {
    /// A file holding the internal secret (at least 32 bytes), passed to every process as
    /// `TANDEM_INTERNAL_SECRET_FILE` instead of a secret generated per deployment: for
    /// deployments spread over several machines, which must share one secret.
    pub secret_file: Option<PathBuf>,
    /// Internal mTLS: CA, certificate and key (PEM), all three or none.
    pub tls_ca: Option<PathBuf>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// Pass no secret at all (the workers then accept loopback binds only).
    #[serde(default)]
    pub insecure: bool,
}

/// The shared internal secret itself (at least [`SECRET_MIN_BYTES`] bytes).
pub const SECRET_ENV: &str = "TANDEM_INTERNAL_SECRET";
/// A file holding the shared internal secret.
pub const SECRET_FILE_ENV: &str = "TANDEM_INTERNAL_SECRET_FILE";
/// The CA that internal TLS peers must chain to (PEM).
pub const TLS_CA_ENV: &str = "TANDEM_INTERNAL_TLS_CA";
/// This process's internal TLS certificate (PEM).
pub const TLS_CERT_ENV: &str = "TANDEM_INTERNAL_TLS_CERT";
/// The key of [`TLS_CERT_ENV`] (PEM).
pub const TLS_KEY_ENV: &str = "TANDEM_INTERNAL_TLS_KEY";
/// Every variable this module sets. The launcher clears them all from what children inherit
/// before setting its own, so the deployment file is the only source (a secret left in the
/// launcher's shell must not reach an `insecure` deployment, nor shadow a `secret_file`).
pub const INTERNAL_ENV: [&str; 6] = [
    SECRET_ENV,
    SECRET_FILE_ENV,
    TLS_CA_ENV,
    TLS_CERT_ENV,
    TLS_KEY_ENV,
    INSECURE_ENV,
];
/// Tells a worker it may listen beyond loopback without a secret (it says so loudly).
pub const INSECURE_ENV: &str = "TANDEM_INSECURE_NO_INTERNAL_AUTH";
/// The shortest secret the serving binaries accept.
pub const SECRET_MIN_BYTES: usize = 32;
/// How a generated secret is shown wherever the environment is printed.
pub const SECRET_PLACEHOLDER: &str = "<generated at start>";

/// Why the deployment's security settings cannot be applied.
#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    #[error("reading the OS random number generator: {0}")]
    Rng(String),
    #[error(
        "[security] tls_ca, tls_cert and tls_key go together: give all three or none (missing: {0})"
    )]
    PartialTls(String),
    #[error("[security] insecure = true contradicts {0}: remove one")]
    InsecureWith(&'static str),
    #[error("security.secret_file {}: {source}", .path.display())]
    SecretFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "security.secret_file {}: {len} bytes; the internal secret needs at least {SECRET_MIN_BYTES} (e.g. `openssl rand -hex 32 > FILE`)",
        .path.display()
    )]
    ShortSecret { path: PathBuf, len: usize },
    #[error("security.{key} {}: no such file", .path.display())]
    MissingTlsFile { key: &'static str, path: PathBuf },
}

/// A secret value. `Debug` never shows it; [`Secret::expose`] is the one way to read it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// 32 bytes from the OS RNG, hex-encoded (64 characters).
    pub fn generate() -> Result<Self, SecurityError> {
        let mut bytes = [0u8; 32];
        OsRng
            .try_fill_bytes(&mut bytes)
            .map_err(|e| SecurityError::Rng(e.to_string()))?;
        Ok(Self(bytes.iter().map(|b| format!("{b:02x}")).collect()))
    }

    /// The value, for a child's environment and nothing else.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// The internal mTLS files, all three or none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Where the processes get the internal secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SecretSource {
    /// Drawn by `tandem up` for this deployment alone.
    Generated(Secret),
    /// Read by each process from this file.
    File(PathBuf),
    /// No secret: the workers then accept loopback binds only (unless told otherwise).
    Insecure,
}

/// The resolved security settings of a deployment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InternalSecurity {
    pub secret: SecretSource,
    pub tls: Option<TlsFiles>,
}

/// What one process gets: plain variables (paths) and secret ones.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SecurityEnv {
    pub plain: BTreeMap<String, String>,
    pub secret: BTreeMap<String, Secret>,
}

impl InternalSecurity {
    /// Resolves `section`, generating a fresh secret unless it names a file or is insecure.
    pub fn resolve(section: &SecuritySection) -> Result<Self, SecurityError> {
        let tls = check(section)?;
        let secret = if section.insecure {
            SecretSource::Insecure
        } else if let Some(path) = &section.secret_file {
            SecretSource::File(path.clone())
        } else {
            SecretSource::Generated(Secret::generate()?)
        };
        Ok(Self { secret, tls })
    }

    /// The variables every process of the deployment gets.
    pub fn env(&self) -> SecurityEnv {
        let mut env = SecurityEnv::default();
        match &self.secret {
            SecretSource::Generated(s) => {
                env.secret.insert(SECRET_ENV.into(), s.clone());
            }
            SecretSource::File(p) => {
                env.plain
                    .insert(SECRET_FILE_ENV.into(), p.display().to_string());
            }
            SecretSource::Insecure => {
                env.plain.insert(INSECURE_ENV.into(), "true".into());
            }
        }
        if let Some(tls) = &self.tls {
            for (var, path) in [
                (TLS_CA_ENV, &tls.ca),
                (TLS_CERT_ENV, &tls.cert),
                (TLS_KEY_ENV, &tls.key),
            ] {
                env.plain.insert(var.into(), path.display().to_string());
            }
        }
        env
    }

    /// One line for the launcher's log saying how the processes authenticate each other
    /// (without the secret).
    pub fn describe(&self) -> String {
        let secret = match &self.secret {
            SecretSource::Generated(_) => {
                format!("a secret generated for this deployment, in {SECRET_ENV}")
            }
            SecretSource::File(p) => format!("the secret in {} ({SECRET_FILE_ENV})", p.display()),
            SecretSource::Insecure => {
                "NONE ([security] insecure = true): anyone who reaches a worker port can use it"
                    .into()
            }
        };
        match &self.tls {
            Some(_) => format!("internal authentication: {secret}; internal mTLS on"),
            None => format!("internal authentication: {secret}"),
        }
    }
}

/// Checks that `section` is consistent (files are not looked at): the TLS trio is complete or
/// absent, and `insecure` comes alone. Returns the TLS files.
pub fn check(section: &SecuritySection) -> Result<Option<TlsFiles>, SecurityError> {
    let tls = tls_files(section)?;
    if section.insecure {
        if section.secret_file.is_some() {
            return Err(SecurityError::InsecureWith("secret_file"));
        }
        if tls.is_some() {
            return Err(SecurityError::InsecureWith("tls_ca/tls_cert/tls_key"));
        }
    }
    Ok(tls)
}

/// Checks the files `section` names, on this machine: the secret file holds at least
/// [`SECRET_MIN_BYTES`] (its content is never shown), the TLS files exist.
pub fn check_files(section: &SecuritySection) -> Result<(), SecurityError> {
    if let Some(path) = &section.secret_file {
        // Bounded, in case the path names something endless.
        let read = File::open(path).and_then(|f| {
            let mut bytes = Vec::new();
            f.take(64 * 1024).read_to_end(&mut bytes)?;
            Ok(bytes)
        });
        let len = read
            .map_err(|source| SecurityError::SecretFile {
                path: path.clone(),
                source,
            })?
            .trim_ascii()
            .len();
        if len < SECRET_MIN_BYTES {
            return Err(SecurityError::ShortSecret {
                path: path.clone(),
                len,
            });
        }
    }
    if let Some(tls) = tls_files(section)? {
        for (key, path) in [
            ("tls_ca", tls.ca),
            ("tls_cert", tls.cert),
            ("tls_key", tls.key),
        ] {
            if !path.is_file() {
                return Err(SecurityError::MissingTlsFile { key, path });
            }
        }
    }
    Ok(())
}

/// Secret and key files of `section` that other users can read.
pub fn file_warnings(section: &SecuritySection) -> Vec<String> {
    [
        ("secret_file", &section.secret_file),
        ("tls_key", &section.tls_key),
    ]
    .into_iter()
    .filter_map(|(key, path)| Some((key, path.as_ref()?)))
    .filter(|(_, path)| readable_by_others(path))
    .map(|(key, path)| {
        format!(
            "security.{key} {} can be read by other users: chmod 600 it",
            path.display()
        )
    })
    .collect()
}

fn readable_by_others(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.permissions().mode() & 0o077 != 0)
}

/// The TLS trio of `section`: all three, none, or an error naming the missing ones.
pub fn tls_files(section: &SecuritySection) -> Result<Option<TlsFiles>, SecurityError> {
    match (&section.tls_ca, &section.tls_cert, &section.tls_key) {
        (Some(ca), Some(cert), Some(key)) => Ok(Some(TlsFiles {
            ca: ca.clone(),
            cert: cert.clone(),
            key: key.clone(),
        })),
        (None, None, None) => Ok(None),
        (ca, cert, key) => {
            let missing: Vec<&str> = [("tls_ca", ca), ("tls_cert", cert), ("tls_key", key)]
                .into_iter()
                .filter(|(_, v)| v.is_none())
                .map(|(name, _)| name)
                .collect();
            Err(SecurityError::PartialTls(missing.join(", ")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(toml: &str) -> SecuritySection {
        toml::from_str(toml).unwrap()
    }

    #[test]
    fn generated_secrets_are_fresh_hex_and_redacted() {
        let a = Secret::generate().unwrap();
        let b = Secret::generate().unwrap();
        assert_ne!(a, b);
        assert_eq!(a.expose().len(), 64);
        assert!(a.expose().bytes().all(|c| c.is_ascii_hexdigit()));
        assert!(a.expose().len() >= SECRET_MIN_BYTES);
        let shown = format!(
            "{a:?} {:?}",
            InternalSecurity::resolve(&section("")).unwrap()
        );
        assert!(!shown.contains(a.expose()), "{shown}");
        assert!(shown.contains("redacted"), "{shown}");
    }

    #[test]
    fn the_tls_trio_is_all_or_nothing() {
        assert_eq!(tls_files(&section("")).unwrap(), None);
        let all = section("tls_ca = \"ca.pem\"\ntls_cert = \"c.pem\"\ntls_key = \"k.pem\"\n");
        assert!(tls_files(&all).unwrap().is_some());
        let env = InternalSecurity::resolve(&all).unwrap().env();
        assert_eq!(env.plain[TLS_CA_ENV], "ca.pem");
        assert_eq!(env.plain[TLS_CERT_ENV], "c.pem");
        assert_eq!(env.plain[TLS_KEY_ENV], "k.pem");
        let err = tls_files(&section("tls_cert = \"c.pem\"\n"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing: tls_ca, tls_key"), "{err}");
    }

    #[test]
    fn the_three_secret_sources() {
        let generated = InternalSecurity::resolve(&section("")).unwrap().env();
        assert!(generated.plain.is_empty());
        assert_eq!(generated.secret[SECRET_ENV].expose().len(), 64);

        let file = InternalSecurity::resolve(&section("secret_file = \"/run/s\"\n"))
            .unwrap()
            .env();
        assert!(file.secret.is_empty());
        assert_eq!(file.plain[SECRET_FILE_ENV], "/run/s");

        let insecure = InternalSecurity::resolve(&section("insecure = true\n")).unwrap();
        let env = insecure.env();
        assert!(env.secret.is_empty());
        assert_eq!(
            env.plain,
            BTreeMap::from([(INSECURE_ENV.to_string(), "true".to_string())]),
            "no secret, and the workers' explicit insecure flag"
        );
        for contradiction in [
            "insecure = true\nsecret_file = \"s\"\n",
            "insecure = true\ntls_ca = \"a\"\ntls_cert = \"b\"\ntls_key = \"c\"\n",
        ] {
            assert!(
                InternalSecurity::resolve(&section(contradiction)).is_err(),
                "{contradiction}"
            );
        }
    }

    #[test]
    fn files_are_checked_without_showing_the_secret() {
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str, content: &str, mode: u32| {
            let p = dir.path().join(name);
            std::fs::write(&p, content).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
            p.display().to_string()
        };
        let secret = file("secret", &format!("{}\n", "ab".repeat(32)), 0o600);
        let short = file("short", "0123456789abcdef0123456789abcde\n", 0o600);
        let (ca, cert, key) = (
            file("ca.pem", "x", 0o644),
            file("cert.pem", "x", 0o644),
            file("key.pem", "x", 0o600),
        );
        let missing = dir.path().join("nope").display().to_string();

        let ok = section(&format!(
            "secret_file = \"{secret}\"\ntls_ca = \"{ca}\"\ntls_cert = \"{cert}\"\ntls_key = \"{key}\""
        ));
        check_files(&ok).unwrap();
        assert!(file_warnings(&ok).is_empty(), "{:?}", file_warnings(&ok));

        for (toml, why) in [
            (
                format!("secret_file = \"{missing}\""),
                "security.secret_file",
            ),
            (format!("secret_file = \"{short}\""), "31 bytes"),
            (
                format!("tls_ca = \"{ca}\"\ntls_cert = \"{cert}\"\ntls_key = \"{missing}\""),
                "security.tls_key",
            ),
        ] {
            let err = check_files(&section(&toml)).unwrap_err().to_string();
            assert!(err.contains(why), "{toml:?} gave {err}");
            assert!(!err.contains("0123456789"), "the secret is shown: {err}");
        }

        let open = section(&format!(
            "secret_file = \"{}\"",
            file("open", &"cd".repeat(32), 0o644)
        ));
        check_files(&open).unwrap();
        let warnings = file_warnings(&open);
        assert!(
            warnings.len() == 1 && warnings[0].contains("chmod 600"),
            "{warnings:?}"
        );
    }
}
