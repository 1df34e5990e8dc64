//! The launcher's own command line (`tandem up|check|plan`): parsed by `main`, and rendered
//! into docs/configuration.md with the other binaries'.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use tandem_cli::LogArgs;

/// tandem: disaggregated prefill/decode LLM serving.
#[derive(Debug, Parser)]
#[command(name = "tandem", version)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Cmd,
}

#[derive(Debug, Subcommand)]
pub enum Cmd {
    /// Start the router and workers of CONFIG (default: 1 prefill + 1 decode worker on
    /// SmolLM2, router on port 8000) and keep them running until Ctrl-C.
    Up {
        /// The deployment file (TOML; see deploy/ for examples).
        config: Option<PathBuf>,
        /// Folder with tandem-router, tandem-prefill and tandem-decode (default: beside this
        /// binary).
        #[arg(long, env = "TANDEM_BIN_DIR")]
        bin_dir: Option<PathBuf>,
        /// Write each process's log to DIR/<name>.log.
        #[arg(long, env = "TANDEM_LOG_DIR")]
        log_dir: Option<PathBuf>,
        /// The MPS control program, for deployments with `[gpu] mps = true` (default:
        /// nvidia-cuda-mps-control on the PATH).
        #[arg(long, env = "TANDEM_MPS_CONTROL")]
        mps_control: Option<PathBuf>,
        /// Where the workers find (and the first run downloads) the default model (default: the
        /// workers' own default, the user's cache dir + /tandem).
        #[arg(long, env = "TANDEM_CACHE")]
        cache_dir: Option<PathBuf>,
        /// How every process of the deployment logs.
        #[command(flatten)]
        log: LogArgs,
    },
    /// Validate deployment files without starting anything.
    Check {
        /// Deployment files (TOML).
        #[arg(required = true)]
        configs: Vec<PathBuf>,
        /// CPUs of the machine the files target (default: this machine's).
        #[arg(long)]
        cores: Option<usize>,
    },
    /// Print the processes a deployment would start.
    Plan {
        /// The deployment file (TOML; default: the built-in local deployment).
        config: Option<PathBuf>,
    },
}
