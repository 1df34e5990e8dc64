//! The deployment file: a TOML description of one router and its workers, with validation
//! that catches what would otherwise fail minutes into a start (bad ports, CPUs or GPU shares
//! that do not exist, an unknown transport, a missing secret or TLS file), and warnings for
//! what runs but is risky.

use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::security::{self, INTERNAL_ENV, SecuritySection};
use crate::supervise::RestartPolicy;

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

/// The values a router flag of type `T` accepts, by name.
fn flag_values<T: clap::ValueEnum>() -> Vec<String> {
    T::value_variants()
        .iter()
        .filter_map(|t| t.to_possible_value())
        .map(|v| v.get_name().to_string())
        .collect()
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

    /// Checks everything that can be checked without starting anything. `cores` is the
    /// number of CPUs of the machine the deployment will run on (CPU lists must exist there).
    pub fn validate(&self, cores: usize) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.decode.is_empty() {
            return bad("a deployment needs at least one [[decode]] worker".into());
        }
        let known = flag_values::<tandem_cli::TransportArg>();
        if !known.contains(&self.router.transport) {
            return bad(format!(
                "router.transport `{}`: use one of {known:?}",
                self.router.transport
            ));
        }
        if let Some(routing) = &self.router.routing {
            let known = flag_values::<tandem_cli::RoutingPolicy>();
            if !known.contains(routing) {
                return bad(format!("router.routing `{routing}`: use one of {known:?}"));
            }
        }
        let transport = self.router.transport.as_str();
        if transport == "cuda-ipc" || transport == "nccl" {
            // Device-to-device transports: every worker on a GPU (cuda-ipc: on one node).
            let workers = || self.prefill.iter().chain(&self.decode);
            if let Some(w) = workers().find(|w| !w.uses_gpu()) {
                return bad(format!(
                    "router.transport `{transport}` needs every worker on a GPU; the worker on port {} has no GPU setting",
                    w.port
                ));
            }
            let hosts: HashSet<&str> = workers().map(|w| w.host.as_str()).collect();
            if transport == "cuda-ipc" && hosts.len() > 1 {
                return bad(format!(
                    "router.transport `cuda-ipc` works within one node; workers are on {} hosts (use tcp or grpc)",
                    hosts.len()
                ));
            }
        }
        if !tandem_cli::KV_DTYPES.contains(&self.model.kv_dtype.as_str()) {
            return bad(format!(
                "model.kv_dtype `{}`: use one of {}",
                self.model.kv_dtype,
                tandem_cli::KV_DTYPES.join(", ")
            ));
        }
        if !tandem_cli::COMPUTE_MODES.contains(&self.model.compute.as_str()) {
            return bad(format!(
                "model.compute `{}`: use one of {}",
                self.model.compute,
                tandem_cli::COMPUTE_MODES.join(", ")
            ));
        }
        if !tandem_cli::WEIGHT_FORMATS.contains(&self.model.weights.as_str()) {
            return bad(format!(
                "model.weights `{}`: use one of {}",
                self.model.weights,
                tandem_cli::WEIGHT_FORMATS.join(", ")
            ));
        }
        let name = self.model.name.as_str();
        let known = ["smollm2", "default", "smollm2-135m-instruct", "tiny"].contains(&name)
            || name.strip_prefix("dummy:").is_some_and(|rest| {
                tandem_cli::MODEL_PRESETS.contains(&rest.split(':').next().unwrap_or(""))
            })
            || Path::new(name).exists();
        if !known {
            return bad(format!(
                "model.name `{name}` is neither smollm2, tiny, dummy:<{}> nor an existing path",
                tandem_cli::MODEL_PRESETS.join("|")
            ));
        }
        let mut ports = HashSet::new();
        let mut claim = |port: u16, what: &str| -> Result<(), ConfigError> {
            if port == 0 || !ports.insert(port) {
                return Err(ConfigError::Invalid(format!(
                    "{what}: port {port} is zero or used twice"
                )));
            }
            Ok(())
        };
        claim(self.router.port, "router")?;
        for (role, workers) in [("prefill", &self.prefill), ("decode", &self.decode)] {
            for (i, w) in workers.iter().enumerate() {
                let what = format!("{role}[{i}]");
                claim(w.port, &what)?;
                if role == "decode" {
                    claim(
                        w.kv_tcp_port.unwrap_or(w.port.wrapping_add(1)),
                        &format!("{what} kv_tcp_port"),
                    )?;
                }
                if let Some(&c) = w.cpus.iter().find(|&&c| c >= cores) {
                    return bad(format!(
                        "{what}: CPU {c} does not exist (this machine has {cores})"
                    ));
                }
                if w.threads == Some(0) {
                    return bad(format!("{what}: threads must be at least 1"));
                }
                self.validate_gpu(&what, w)?;
            }
        }
        if let Some(&c) = self.router.cpus.iter().find(|&&c| c >= cores) {
            return bad(format!(
                "router: CPU {c} does not exist (this machine has {cores})"
            ));
        }
        self.validate_supervise()?;
        self.validate_security()?;
        if let Some(gpu) = &self.gpu {
            // Green contexts on one GPU must fit in its SMs together.
            for g in 0..gpu.count {
                let total: u32 = self
                    .prefill
                    .iter()
                    .chain(&self.decode)
                    .filter(|w| w.gpu.unwrap_or(0) == g)
                    .filter_map(|w| w.green_context_sms)
                    .sum();
                if total > gpu.sms {
                    return bad(format!(
                        "GPU {g}: green contexts ask for {total} SMs, it has {}",
                        gpu.sms
                    ));
                }
            }
        }
        Ok(())
    }

    /// Every process's label (`router`, `prefill[0]`, …), host and extra environment.
    fn processes(&self) -> impl Iterator<Item = (String, &str, &BTreeMap<String, String>)> {
        let router = std::iter::once((
            "router".to_string(),
            self.router.host.as_str(),
            &self.router.env,
        ));
        let workers = [("prefill", &self.prefill), ("decode", &self.decode)]
            .into_iter()
            .flat_map(|(role, ws)| {
                ws.iter()
                    .enumerate()
                    .map(move |(i, w)| (format!("{role}[{i}]"), w.host.as_str(), &w.env))
            });
        router.chain(workers)
    }

    fn validate_supervise(&self) -> Result<(), ConfigError> {
        let s = &self.supervise;
        if s.backoff_initial_ms > s.backoff_max_ms {
            return Err(ConfigError::Invalid(format!(
                "supervise.backoff_initial_ms ({}) exceeds supervise.backoff_max_ms ({})",
                s.backoff_initial_ms, s.backoff_max_ms
            )));
        }
        Ok(())
    }

    /// The `[security]` section is consistent and its files exist here; no process's `env`
    /// sets the internal variables behind its back (they would bypass the section and be
    /// printed by `tandem plan`).
    fn validate_security(&self) -> Result<(), ConfigError> {
        let sec = &self.security;
        let invalid = |e: security::SecurityError| ConfigError::Invalid(e.to_string());
        security::check(sec).map_err(invalid)?;
        security::check_files(sec).map_err(invalid)?;
        for (what, _, env) in self.processes() {
            if let Some(var) = INTERNAL_ENV.iter().find(|v| env.contains_key(**v)) {
                return Err(ConfigError::Invalid(format!(
                    "{what}.env sets {var}: use the [security] section instead"
                )));
            }
        }
        Ok(())
    }

    /// What runs but deserves a second look: an insecure deployment listening beyond
    /// loopback, secret or key files others can read. Call after [`Self::validate`].
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        let sec = &self.security;
        if sec.insecure {
            for (what, host, _) in self.processes().filter(|(_, h, _)| !is_loopback(h)) {
                out.push(format!(
                    "security.insecure = true but {what} listens on {host}: internal requests go unauthenticated beyond this machine"
                ));
            }
        }
        out.extend(security::file_warnings(sec));
        out
    }

    fn validate_gpu(&self, what: &str, w: &WorkerSpec) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        let Some(gpu) = &self.gpu else {
            if w.uses_gpu() {
                return bad(format!("{what}: GPU settings need a [gpu] section"));
            }
            return Ok(());
        };
        if let Some(g) = w.gpu
            && g >= gpu.count
        {
            return bad(format!(
                "{what}: GPU {g} does not exist ([gpu] count = {})",
                gpu.count
            ));
        }
        if let Some(p) = w.mps_thread_percentage {
            if !(1..=100).contains(&p) {
                return bad(format!(
                    "{what}: mps_thread_percentage {p} is not in 1..=100"
                ));
            }
            if !gpu.mps {
                return bad(format!(
                    "{what}: mps_thread_percentage needs `mps = true` in [gpu]"
                ));
            }
        }
        if let Some(sms) = w.green_context_sms
            && (sms == 0 || sms > gpu.sms)
        {
            return bad(format!(
                "{what}: green_context_sms {sms} is not in 1..={}",
                gpu.sms
            ));
        }
        if w.green_context_sms.is_some() && w.mps_thread_percentage.is_some() {
            return bad(format!("{what}: choose green contexts or MPS, not both"));
        }
        Ok(())
    }
}

/// Whether `host` (an address or `localhost`) is a loopback address.
fn is_loopback(host: &str) -> bool {
    host == "localhost"
        || host
            .trim_matches(['[', ']'])
            .parse::<IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
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
        assert!(is_loopback("127.0.0.2") && is_loopback("[::1]") && !is_loopback("10.0.0.1"));
    }
}
