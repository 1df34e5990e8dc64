//! The one logging flag every binary takes.

use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

/// Log line format of a binary.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line (for log collectors).
    Json,
}

/// How a binary logs (the level comes from `RUST_LOG`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Args, Serialize, Deserialize)]
pub struct LogArgs {
    /// Log line format (the level comes from `RUST_LOG`).
    #[arg(long, env = "TANDEM_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}
