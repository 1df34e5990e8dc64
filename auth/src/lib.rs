//! tandem-auth: how tandem's internal services know each other.
//!
//! Every process of a deployment holds one secret (`TANDEM_INTERNAL_SECRET` or a file named by
//! `TANDEM_INTERNAL_SECRET_FILE`; `tandem up` makes a fresh one per deployment). From it:
//! - every call to a worker's gRPC service carries a per-call token bound to the method, the
//!   time and a nonce ([`AttachToken`] adds it, [`RequireToken`] checks it; see `token`);
//! - a worker answers `GetInfo` with a proof over the caller's challenge and the fields peers
//!   act on, so a prefill worker sends KV (and a router sends prompts) only to a worker of the
//!   deployment ([`InternalAuth::worker_info_proof`]);
//! - a raw TCP KV connection opens with the decode worker's challenge and the sender's proof,
//!   checked before anything else is read ([`InternalAuth::kv_hello_proof`]).
//!
//! Optional mutual TLS ([`Tls`]) encrypts and authenticates the gRPC traffic between hosts.
//! Without a secret, nothing is checked: workers then listen only on loopback unless started
//! with `--insecure-no-internal-auth` (see [`InternalAuth::check_listen`]).
//!
//! Kept apart from `tandem-proto` (pure wire types) so that the router, which must not depend
//! on the engine or the workers, shares it with them.

//!
//! The files: `internal` ([`InternalAuth`]), `secret` (keys derived from the secret), `token`
//! (call tokens), `proof` (what a worker info proof covers), `layer` (tower layers that sign
//! and check calls), `tls`, `args` (loading credentials from flags and environment), `error`.

mod args;
mod error;
mod internal;
mod layer;
mod proof;
mod secret;
mod tls;
mod token;

pub use args::{InternalAuthArgs, LoadInternalAuth, refuse_secret_on_command_line};
pub use error::AuthError;
pub use internal::{InternalAuth, challenge, is_loopback};
pub use layer::{
    AttachToken, AuthChannel, GuardedServer, RateLimitedLog, RequireToken, RequireTokenLayer,
};
pub use secret::{MIN_SECRET_BYTES, Secret, hex, random_bytes, unhex};
pub use tls::{Tls, TlsFiles};
pub use token::WINDOW as TOKEN_WINDOW;

pub use tokio_rustls;
