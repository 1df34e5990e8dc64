//! The launcher behind `tandem up`: reads a deployment file (router, prefill and decode
//! workers, each with its CPU cores or GPU share), starts every process with its flags,
//! pinning and environment, prefixes their logs, waits until the router reports healthy, and
//! stops them all cleanly on Ctrl-C or SIGTERM. A process that dies is restarted after a
//! backoff ([`supervise`]); one that keeps dying stops the deployment with an error.
//!
//! Every process of a deployment gets the deployment's internal secret (drawn per deployment,
//! or named by a file) and optional mTLS files through its environment ([`security`]).
//!
//! The deployment file is the one source of the processes' settings: they start without the
//! launcher's `TANDEM_*` variables, and one the router or a worker would read stops `tandem
//! up` with the file key to use instead, so nothing set in the shell is dropped in silence
//! ([`environment`]).
//!
//! Deployments that split a GPU under MPS get the MPS control daemon started (and stopped)
//! around them ([`mps`]).
//!
//! It runs binaries and sets their flags and variables, and links none of them: the flags
//! come from the same typed structures the binaries parse (`tandem-cli`), written out by
//! [`tandem_cli::to_args`].

pub mod cli;
pub mod config;
pub mod environment;
pub mod launcher;
pub mod mps;
pub mod plan;
pub mod security;
pub mod supervise;

pub use config::{DeployConfig, WorkerSpec};
pub use plan::{Plan, ProcessSpec, plan, plan_with};
