//! The deployment file: a TOML description of one router and its workers, with validation
//! that catches what would otherwise fail minutes into a start (bad ports, CPUs or GPU shares
//! that do not exist, an unknown transport, a missing secret or TLS file), and warnings for
//! what runs but is risky.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::security::SecuritySection;
use crate::supervise::RestartPolicy;

mod validate;

/// Why a deployment file is refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: Box<toml::de::Error>,
    },
    #[error("{0}")]
    Invalid(String),
}

/// The model every worker serves.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// `smollm2`, `tiny`, `dummy:PRESET[:SEED]`, or a path (passed to the workers' `--model`).
    #[serde(default = "default_model")]
    pub name: String,
    /// How the workers store the weights (their `--weights`).
    #[serde(default = "default_weights")]
    pub weights: String,
    /// Element type of every worker's KV cache (their `--kv-dtype`): f32, bf16 or f16.
    #[serde(default = "default_kv_dtype")]
    pub kv_dtype: String,
    /// How the workers compute quantized weights (their `--compute`): auto, exact or fast.
    /// One value for every worker, since the mode is part of the model's identity.
    #[serde(default = "default_compute")]
    pub compute: String,
    /// A tokenizer to use instead of the model's own.
    pub tokenizer: Option<String>,
    /// Where the workers cache the default model (`tandem up --cache-dir` overrides it).
    pub cache_dir: Option<PathBuf>,
}

fn default_model() -> String {
    "smollm2".into()
}

fn default_weights() -> String {
    "native".into()
}

fn default_kv_dtype() -> String {
    "f32".into()
}

fn default_compute() -> String {
    "auto".into()
}

impl Default for ModelSection {
    fn default() -> Self {
        Self {
            name: default_model(),
            weights: default_weights(),
            kv_dtype: default_kv_dtype(),
            compute: default_compute(),
            tokenizer: None,
            cache_dir: None,
        }
    }
}

/// The router.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RouterSection {
    #[serde(default = "localhost")]
    pub host: String,
    #[serde(default = "default_router_port")]
    pub port: u16,
    /// KV transport between the workers: shm, tcp, grpc, cuda-ipc (GPU workers on one
    /// node) or nccl (GPU workers anywhere).
    #[serde(default = "default_transport")]
    pub transport: String,
    /// Prompts shorter than this run aggregated on a decode worker, as do prompts whose
    /// decode worker has all but fewer than this many tokens cached (a huge value makes the
    /// whole deployment aggregated, for A/B runs).
    #[serde(default)]
    pub agg_threshold: u64,
    /// How the router picks workers: kv-aware (default), load or round-robin.
    #[serde(default)]
    pub routing: Option<String>,
    /// How the router places requests: static (by `agg_threshold`, the default) or slo (by
    /// the latency targets of `[router.slo]` and the workers' measured costs).
    #[serde(default)]
    pub placement: Option<String>,
    /// Move CPU compute threads between the workers by the TPOT target and the prompts
    /// queued (`--elastic-threads`; for workers sharing one host's cores).
    #[serde(default)]
    pub elastic_threads: bool,
    /// The latency targets (each absent: the router's default).
    #[serde(default)]
    pub slo: SloSection,
    /// CPU cores for the router process.
    #[serde(default)]
    pub cpus: Vec<usize>,
    /// Flags added after the ones the plan writes.
    #[serde(default)]
    pub extra_args: Vec<String>,
    /// Variables added to this process's environment; not one that a file key sets
    /// ([`crate::environment::check_env_tables`]).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

/// `[router.slo]`: the deployment's latency targets, in milliseconds.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SloSection {
    /// TTFT target, fixed part.
    pub ttft_ms: Option<f64>,
    /// TTFT target, part per prompt token.
    pub ttft_per_token_ms: Option<f64>,
    /// Time per output token.
    pub tpot_ms: Option<f64>,
}

fn localhost() -> String {
    "127.0.0.1".into()
}

fn default_router_port() -> u16 {
    8000
}

fn default_transport() -> String {
    "shm".into()
}

impl Default for RouterSection {
    fn default() -> Self {
        Self {
            host: localhost(),
            port: default_router_port(),
            transport: default_transport(),
            agg_threshold: 0,
            routing: None,
            placement: None,
            elastic_threads: false,
            slo: SloSection::default(),
            cpus: Vec::new(),
            extra_args: Vec::new(),
            env: BTreeMap::new(),
        }
    }
}

/// One prefill or decode worker.
#[derive(Debug, Clone, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct WorkerSpec {
    /// A name for logs (default: role and index).
    pub name: Option<String>,
    #[serde(default = "localhost")]
    pub host: String,
    pub port: u16,
    /// Decode workers: the raw TCP KV port (default: port + 1).
    pub kv_tcp_port: Option<u16>,
    /// CPU cores this worker runs on (empty: no pinning).
    #[serde(default)]
    pub cpus: Vec<usize>,
    /// Compute threads (default: one per pinned core, else all cores).
    pub threads: Option<usize>,
    /// CPU scheduling priority: `normal` (default) or `idle` (runs only on cycles the
    /// other workers on its cores leave; see `--cpu-priority`).
    pub cpu_priority: Option<String>,
    /// Decode workers: pace decode passes to the streams' TPOT targets and leave the rest
    /// of each period to an idle-priority worker on the same cores (`--lend-slack`).
    pub lend_slack: Option<bool>,
    pub kv_budget_mb: Option<usize>,
    pub max_batch_tokens: Option<usize>,
    pub max_running: Option<usize>,
    /// Reuse the KV of prefixes computed before (default: on; see `--no-prefix-caching`).
    pub prefix_caching: Option<bool>,
    /// GPU index (`CUDA_VISIBLE_DEVICES`).
    pub gpu: Option<u32>,
    /// Share of the GPU's SMs under MPS (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, 1–100).
    pub mps_thread_percentage: Option<u32>,
    /// SMs of a green context this worker is confined to (`--green-context-sms`).
    pub green_context_sms: Option<u32>,
    /// Flags added after the ones the plan writes.
    #[serde(default)]
    pub extra_args: Vec<String>,
    /// Variables added to this process's environment; not one that a file key sets
    /// ([`crate::environment::check_env_tables`]).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

impl WorkerSpec {
    /// Whether any GPU setting is present: such a worker runs its engine on the GPU.
    pub fn uses_gpu(&self) -> bool {
        self.gpu.is_some()
            || self.mps_thread_percentage.is_some()
            || self.green_context_sms.is_some()
    }
}

/// GPU facts used to check GPU layouts (an H100 SXM has 132 SMs).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GpuSection {
    /// GPUs on the machine.
    pub count: u32,
    /// SMs per GPU.
    pub sms: u32,
    /// Whether the workers need an MPS control daemon.
    #[serde(default)]
    pub mps: bool,
}

/// How `tandem up` restarts a process that exits while the deployment runs.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SuperviseSection {
    /// Restarts allowed per process within a minute; past it the launcher stops everything
    /// and fails. 0: never restart.
    #[serde(default = "default_max_restarts")]
    pub max_restarts_per_minute: u32,
    /// Delay before the first restart; it doubles with each restart in a row.
    #[serde(default = "default_backoff_initial_ms")]
    pub backoff_initial_ms: u64,
    /// The longest delay between restarts.
    #[serde(default = "default_backoff_max_ms")]
    pub backoff_max_ms: u64,
}

fn default_max_restarts() -> u32 {
    5
}

fn default_backoff_initial_ms() -> u64 {
    500
}

fn default_backoff_max_ms() -> u64 {
    10_000
}

impl Default for SuperviseSection {
    fn default() -> Self {
        Self {
            max_restarts_per_minute: default_max_restarts(),
            backoff_initial_ms: default_backoff_initial_ms(),
            backoff_max_ms: default_backoff_max_ms(),
        }
    }
}

impl SuperviseSection {
    /// The restart policy these settings describe.
    pub fn policy(&self) -> RestartPolicy {
        RestartPolicy {
            max_per_minute: self.max_restarts_per_minute,
            backoff_initial: Duration::from_millis(self.backoff_initial_ms),
            backoff_max: Duration::from_millis(self.backoff_max_ms),
            ..RestartPolicy::default()
        }
    }
}

/// A whole deployment.
#[derive(Debug, Clone, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct DeployConfig {
    /// Free text shown by `tandem up`.
    pub description: Option<String>,
    #[serde(default)]
    pub model: ModelSection,
    #[serde(default)]
    pub router: RouterSection,
    #[serde(default)]
    pub prefill: Vec<WorkerSpec>,
    #[serde(default)]
    pub decode: Vec<WorkerSpec>,
    pub gpu: Option<GpuSection>,
    /// Folder of the tandem binaries (default: beside this launcher, then PATH).
    pub bin_dir: Option<PathBuf>,
    /// Write each process's log to `<log_dir>/<name>.log` instead of prefixing it on stderr.
    pub log_dir: Option<PathBuf>,
    /// How long to wait for the deployment to become healthy, in seconds (the first run
    /// downloads the default model).
    #[serde(default = "default_startup_timeout")]
    pub startup_timeout_s: u64,
    #[serde(default)]
    pub supervise: SuperviseSection,
    #[serde(default)]
    pub security: SecuritySection,
    /// How every process logs (`tandem up --log-format`; not a file setting).
    #[serde(skip)]
    pub log_format: tandem_cli::LogFormat,
}

fn default_startup_timeout() -> u64 {
    600
}

impl DeployConfig {
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_toml(&text).map_err(|e| match e {
            ConfigError::Parse { source, .. } => ConfigError::Parse {
                path: path.to_owned(),
                source,
            },
            other => other,
        })
    }

    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let cfg: DeployConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: PathBuf::from("<config>"),
            source: Box::new(e),
        })?;
        Ok(cfg)
    }

    /// The deployment `tandem up` runs without a file: one prefill and one decode worker on
    /// the default model, the machine's cores split between them, router on port 8000.
    pub fn default_local(cores: usize) -> Self {
        let (p_cpus, d_cpus): (Vec<usize>, Vec<usize>) = if cores >= 2 {
            ((0..cores / 2).collect(), (cores / 2..cores).collect())
        } else {
            (Vec::new(), Vec::new())
        };
        DeployConfig {
            description: Some(
                "default: 1 prefill + 1 decode worker on SmolLM2-135M-Instruct".into(),
            ),
            prefill: vec![WorkerSpec {
                port: 7101,
                host: localhost(),
                cpus: p_cpus,
                kv_budget_mb: Some(512),
                ..WorkerSpec::default()
            }],
            decode: vec![WorkerSpec {
                port: 7201,
                host: localhost(),
                cpus: d_cpus,
                kv_budget_mb: Some(2048),
                ..WorkerSpec::default()
            }],
            startup_timeout_s: default_startup_timeout(),
            ..DeployConfig::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_splits_the_cores() {
        let cfg = DeployConfig::default_local(2);
        cfg.validate(2).unwrap();
        assert_eq!(cfg.prefill[0].cpus, vec![0]);
        assert_eq!(cfg.decode[0].cpus, vec![1]);
        assert!(DeployConfig::default_local(1).prefill[0].cpus.is_empty());
        assert_eq!(
            DeployConfig::default_local(8).decode[0].cpus,
            vec![4, 5, 6, 7]
        );
    }

    #[test]
    fn refuses_what_cannot_run() {
        let base = "[[decode]]\nport = 7201\n";
        assert!(DeployConfig::from_toml(base).unwrap().validate(2).is_ok());
        for (bad, why) in [
            ("", "at least one [[decode]]"),
            (
                "[router]\ntransport = \"rdma\"\n[[decode]]\nport = 7201\n",
                "router.transport",
            ),
            (
                "[router]\nrouting = \"random\"\n[[decode]]\nport = 7201\n",
                "router.routing",
            ),
            ("[[decode]]\nport = 8000\n", "used twice"),
            (
                "[[decode]]\nport = 7201\ncpus = [5]\n",
                "CPU 5 does not exist",
            ),
            ("[[decode]]\nport = 7201\ngpu = 0\n", "need a [gpu] section"),
            (
                "[gpu]\ncount = 1\nsms = 132\n[[decode]]\nport = 7201\ngpu = 1\n",
                "GPU 1 does not exist",
            ),
            (
                "[gpu]\ncount = 1\nsms = 132\n[[decode]]\nport = 7201\nmps_thread_percentage = 50\n",
                "needs `mps = true`",
            ),
            (
                "[gpu]\ncount = 1\nsms = 132\n[[prefill]]\nport = 7101\ngreen_context_sms = 100\n[[decode]]\nport = 7201\ngreen_context_sms = 64\n",
                "ask for 164 SMs",
            ),
            (
                "[model]\nname = \"gpt-9\"\n[[decode]]\nport = 7201\n",
                "model.name",
            ),
            (
                "[model]\ncompute = \"int4\"\n[[decode]]\nport = 7201\n",
                "model.compute `int4`: use one of auto, exact, fast",
            ),
            (
                "[router]\ntransport = \"cuda-ipc\"\n[gpu]\ncount = 1\nsms = 132\n[[prefill]]\nport = 7101\n[[decode]]\nport = 7201\ngpu = 0\n",
                "no GPU setting",
            ),
            (
                "[router]\ntransport = \"cuda-ipc\"\n[gpu]\ncount = 1\nsms = 132\n[[prefill]]\nport = 7101\ngpu = 0\nhost = \"10.0.0.1\"\n[[decode]]\nport = 7201\ngpu = 0\n",
                "within one node",
            ),
            (
                "[router]\ntransport = \"nccl\"\n[[decode]]\nport = 7201\n",
                "needs every worker on a GPU",
            ),
        ] {
            let err = DeployConfig::from_toml(bad)
                .and_then(|c| c.validate(2))
                .unwrap_err()
                .to_string();
            assert!(err.contains(why), "{bad:?} gave {err}");
        }
        assert!(
            DeployConfig::from_toml("[[decode]]\nport = 1\nunknown = 3\n").is_err(),
            "unknown keys are errors"
        );
    }

    #[test]
    fn supervise_section() {
        let cfg = DeployConfig::from_toml("[[decode]]\nport = 7201\n").unwrap();
        assert_eq!(cfg.supervise, SuperviseSection::default());
        assert_eq!(cfg.supervise.policy(), RestartPolicy::default());
        let cfg = DeployConfig::from_toml(
            "[supervise]\nmax_restarts_per_minute = 1\nbackoff_initial_ms = 50\nbackoff_max_ms = 200\n[[decode]]\nport = 7201\n",
        )
        .unwrap();
        cfg.validate(2).unwrap();
        let p = cfg.supervise.policy();
        assert_eq!(
            (p.max_per_minute, p.backoff_initial, p.backoff_max),
            (1, Duration::from_millis(50), Duration::from_millis(200))
        );
        let err = DeployConfig::from_toml(
            "[supervise]\nbackoff_initial_ms = 500\nbackoff_max_ms = 100\n[[decode]]\nport = 7201\n",
        )
        .unwrap()
        .validate(2)
        .unwrap_err()
        .to_string();
        assert!(err.contains("exceeds supervise.backoff_max_ms"), "{err}");
        assert!(DeployConfig::from_toml("[supervise]\nmax_restarts = 3\n").is_err());
    }

    fn secured(section: &str) -> Result<DeployConfig, String> {
        let cfg =
            DeployConfig::from_toml(&format!("[security]\n{section}\n[[decode]]\nport = 7201\n"))
                .map_err(|e| e.to_string())?;
        cfg.validate(2).map_err(|e| e.to_string())?;
        Ok(cfg)
    }

    /// The section's own checks are `security`'s tests; these check they are wired in.
    #[test]
    fn security_section_is_validated() {
        for (section, why) in [
            (
                "secret_file = \"/nonexistent/secret\"",
                "security.secret_file",
            ),
            ("tls_ca = \"a\"\ntls_cert = \"b\"", "missing: tls_key"),
            (
                "insecure = true\nsecret_file = \"s\"",
                "contradicts secret_file",
            ),
            ("secret = \"inline\"", "unknown field"),
        ] {
            let err = secured(section).unwrap_err();
            assert!(err.contains(why), "{section:?} gave {err}");
        }
        let err = DeployConfig::from_toml(
            "[[decode]]\nport = 7201\n[decode.env]\nTANDEM_INTERNAL_SECRET = \"x\"\n",
        )
        .unwrap()
        .validate(2)
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("decode[0].env sets TANDEM_INTERNAL_SECRET"),
            "{err}"
        );
    }

    #[test]
    fn insecure_beyond_loopback_is_a_warning() {
        let local = secured("insecure = true").unwrap();
        assert!(local.warnings().is_empty(), "{:?}", local.warnings());
        let cfg = DeployConfig::from_toml(
            "[security]\ninsecure = true\n[router]\nhost = \"::1\"\n[[prefill]]\nport = 7101\nhost = \"localhost\"\n[[decode]]\nport = 7201\nhost = \"0.0.0.0\"\n",
        )
        .unwrap();
        cfg.validate(2).unwrap();
        let warnings = cfg.warnings();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains("decode[0] listens on 0.0.0.0"),
            "{warnings:?}"
        );
    }
}
