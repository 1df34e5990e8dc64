//! The router's configuration: `RouterArgs` (clap flags, each also a `TANDEM_*` env var, and
//! the same keys in a TOML file given with `--config`), validated once into `RouterConfig`,
//! which is all the library ever sees. Flags and env vars win over the file; the file wins
//! over the defaults.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tandem_auth::{InternalAuth, LoadInternalAuth};
pub use tandem_cli::{
    FallbackPolicy, LogFormat, PlacementPolicy, RouterArgs, RoutingPolicy, TransportArg,
};
use tandem_proto::v1::Transport;

use crate::auth::ApiKey;
use crate::discovery::WorkerEntry;
use crate::routing::SloTargets;

/// The wire value of a transport flag.
pub fn transport_of(t: TransportArg) -> Transport {
    match t {
        TransportArg::Shm => Transport::Shm,
        TransportArg::Tcp => Transport::Tcp,
        TransportArg::Grpc => Transport::Grpc,
        TransportArg::CudaIpc => Transport::CudaIpc,
        TransportArg::Nccl => Transport::Nccl,
    }
}

/// A configuration value that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    ReadFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {path}: {source}")]
    ParseFile {
        path: PathBuf,
        #[source]
        source: toml::de::Error,
    },
    #[error("{0}")]
    Invalid(String),
}

/// The validated configuration the library runs on.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    pub host: String,
    pub port: u16,
    /// Normalised worker entries: `http(s)://HOST:PORT` (no trailing slash) or
    /// `dns://NAME:PORT` (see `discovery::WorkerEntry`).
    pub prefill_urls: Vec<String>,
    pub decode_urls: Vec<String>,
    pub transport: Transport,
    pub agg_threshold: u32,
    pub placement: PlacementPolicy,
    /// The deployment's latency targets (what `--placement slo` places by).
    pub slo: SloTargets,
    /// Run the elastic thread planner (`workers::elastic`).
    pub elastic_threads: bool,
    pub fallback: FallbackPolicy,
    pub routing: RoutingPolicy,
    /// kv-aware routing's price of a missing prompt block, in free blocks.
    pub kv_overlap_weight: f64,
    pub served_model_name: Option<String>,
    pub max_concurrent_requests: usize,
    pub max_queued_requests: usize,
    /// Longest a request waits for a running slot (None: until its deadline).
    pub max_queue_wait: Option<Duration>,
    pub body_limit_bytes: usize,
    pub lease_ttl_ms: u32,
    pub health_interval: Duration,
    /// Period of re-resolving `dns://` entries.
    pub dns_refresh: Duration,
    pub request_timeout: Option<Duration>,
    pub startup_timeout: Duration,
    pub shutdown_grace: Duration,
    pub api_key: Option<ApiKey>,
    pub log_format: LogFormat,
    pub header_read_timeout: Duration,
    pub body_read_timeout: Duration,
    pub max_connections: usize,
    /// None: no keep-alive comments.
    pub sse_keepalive: Option<Duration>,
    /// What calls to workers carry, and what workers must prove.
    pub internal_auth: InternalAuth,
}

impl RouterConfig {
    /// Defaults for everything, with these workers: the starting point of tests and embedders.
    pub fn new(prefill_urls: Vec<String>, decode_urls: Vec<String>) -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8000,
            prefill_urls,
            decode_urls,
            transport: Transport::Shm,
            agg_threshold: 0,
            placement: PlacementPolicy::Static,
            slo: SloTargets::default(),
            elastic_threads: false,
            fallback: FallbackPolicy::Aggregated,
            routing: RoutingPolicy::KvAware,
            kv_overlap_weight: 2.0,
            served_model_name: None,
            max_concurrent_requests: 256,
            max_queued_requests: 512,
            max_queue_wait: Some(Duration::from_secs(30)),
            body_limit_bytes: 2_000_000,
            lease_ttl_ms: 30_000,
            health_interval: Duration::from_millis(1000),
            dns_refresh: Duration::from_millis(5000),
            request_timeout: Some(Duration::from_secs(600)),
            startup_timeout: Duration::from_secs(120),
            shutdown_grace: Duration::from_secs(30),
            api_key: None,
            log_format: LogFormat::Text,
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            max_connections: 1024,
            sse_keepalive: Some(Duration::from_secs(15)),
            internal_auth: InternalAuth::none(),
        }
    }

    /// Merges `args` over the TOML file it names (if any) over the defaults, and validates.
    pub fn from_args(args: RouterArgs) -> Result<Self, ConfigError> {
        let file = match &args.config {
            Some(path) => read_file(path)?,
            None => RouterArgs::default(),
        };
        let pick_list = |flag: Vec<String>, file: Vec<String>| {
            if flag.is_empty() { file } else { flag }
        };
        let defaults = RouterConfig::new(Vec::new(), Vec::new());
        let config = RouterConfig {
            host: args.host.or(file.host).unwrap_or(defaults.host),
            port: args.port.or(file.port).unwrap_or(defaults.port),
            prefill_urls: normalise_urls("prefill", pick_list(args.prefill, file.prefill))?,
            decode_urls: normalise_urls("decode", pick_list(args.decode, file.decode))?,
            transport: args
                .transport
                .or(file.transport)
                .map_or(defaults.transport, transport_of),
            agg_threshold: args
                .agg_threshold
                .or(file.agg_threshold)
                .unwrap_or(defaults.agg_threshold),
            placement: args
                .placement
                .or(file.placement)
                .unwrap_or(defaults.placement),
            elastic_threads: args.elastic_threads || file.elastic_threads,
            slo: SloTargets {
                ttft_ms: args
                    .slo_ttft_ms
                    .or(file.slo_ttft_ms)
                    .unwrap_or(defaults.slo.ttft_ms),
                ttft_per_token_ms: args
                    .slo_ttft_per_token_ms
                    .or(file.slo_ttft_per_token_ms)
                    .unwrap_or(defaults.slo.ttft_per_token_ms),
                tpot_ms: args
                    .slo_tpot_ms
                    .or(file.slo_tpot_ms)
                    .unwrap_or(defaults.slo.tpot_ms),
            },
            fallback: args.fallback.or(file.fallback).unwrap_or(defaults.fallback),
            routing: args.routing.or(file.routing).unwrap_or(defaults.routing),
            kv_overlap_weight: args
                .kv_overlap_weight
                .or(file.kv_overlap_weight)
                .unwrap_or(defaults.kv_overlap_weight),
            served_model_name: args.served_model_name.or(file.served_model_name),
            max_concurrent_requests: args
                .max_concurrent_requests
                .or(file.max_concurrent_requests)
                .unwrap_or(defaults.max_concurrent_requests),
            max_queued_requests: args
                .max_queued_requests
                .or(file.max_queued_requests)
                .unwrap_or(defaults.max_queued_requests),
            max_queue_wait: match args.max_queue_wait_ms.or(file.max_queue_wait_ms) {
                Some(0) => None,
                Some(ms) => Some(Duration::from_millis(ms)),
                None => defaults.max_queue_wait,
            },
            body_limit_bytes: args
                .body_limit_bytes
                .or(file.body_limit_bytes)
                .unwrap_or(defaults.body_limit_bytes),
            lease_ttl_ms: args
                .lease_ttl_ms
                .or(file.lease_ttl_ms)
                .unwrap_or(defaults.lease_ttl_ms),
            health_interval: args
                .health_interval_ms
                .or(file.health_interval_ms)
                .map_or(defaults.health_interval, Duration::from_millis),
            dns_refresh: args
                .dns_refresh_ms
                .or(file.dns_refresh_ms)
                .map_or(defaults.dns_refresh, Duration::from_millis),
            request_timeout: match args.request_timeout_s.or(file.request_timeout_s) {
                Some(0) => None,
                Some(s) => Some(Duration::from_secs(s)),
                None => defaults.request_timeout,
            },
            startup_timeout: args
                .startup_timeout_s
                .or(file.startup_timeout_s)
                .map_or(defaults.startup_timeout, Duration::from_secs),
            shutdown_grace: args
                .shutdown_grace_s
                .or(file.shutdown_grace_s)
                .map_or(defaults.shutdown_grace, Duration::from_secs),
            api_key: args
                .api_key
                .or(file.api_key)
                .map(|k| ApiKey::new(&k))
                .transpose()
                .map_err(ConfigError::Invalid)?,
            log_format: args.log.log_format,
            header_read_timeout: args
                .header_read_timeout_ms
                .or(file.header_read_timeout_ms)
                .map_or(defaults.header_read_timeout, Duration::from_millis),
            body_read_timeout: args
                .body_read_timeout_ms
                .or(file.body_read_timeout_ms)
                .map_or(defaults.body_read_timeout, Duration::from_millis),
            max_connections: args
                .max_connections
                .or(file.max_connections)
                .unwrap_or(defaults.max_connections),
            sse_keepalive: match args.sse_keepalive_ms.or(file.sse_keepalive_ms) {
                Some(0) => None,
                Some(ms) => Some(Duration::from_millis(ms)),
                None => defaults.sse_keepalive,
            },
            internal_auth: args
                .internal
                .load()
                .map_err(|e| ConfigError::Invalid(format!("internal authentication: {e}")))?,
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks the relations between values; `from_args` calls it, embedders should too.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |m: &str| Err(ConfigError::Invalid(m.to_string()));
        if self.decode_urls.is_empty() {
            return invalid("at least one decode worker is required (--decode URL[,URL...])");
        }
        for (role, entries) in [
            ("prefill", &self.prefill_urls),
            ("decode", &self.decode_urls),
        ] {
            for entry in entries {
                WorkerEntry::parse(entry)
                    .map_err(|e| ConfigError::Invalid(format!("{role} worker entry {e}")))?;
            }
        }
        if self.max_concurrent_requests == 0 {
            return invalid("--max-concurrent-requests must be at least 1");
        }
        if self.body_limit_bytes < 1024 {
            return invalid("--body-limit-bytes must be at least 1024");
        }
        if !(0.0..=1000.0).contains(&self.kv_overlap_weight) {
            return invalid("--kv-overlap-weight must be in [0, 1000]");
        }
        self.slo.validate().map_err(ConfigError::Invalid)?;
        if self.lease_ttl_ms == 0 {
            return invalid("--lease-ttl-ms must be at least 1");
        }
        if self.health_interval < Duration::from_millis(10) {
            return invalid("--health-interval-ms must be at least 10");
        }
        if self.dns_refresh < Duration::from_millis(10) {
            return invalid("--dns-refresh-ms must be at least 10");
        }
        if self.startup_timeout.is_zero() {
            return invalid("--startup-timeout-s must be at least 1");
        }
        if self.served_model_name.as_deref().is_some_and(str::is_empty) {
            return invalid("--served-model-name must not be empty");
        }
        if self.header_read_timeout < Duration::from_millis(100) {
            return invalid("--header-read-timeout-ms must be at least 100");
        }
        if self.body_read_timeout < Duration::from_millis(100) {
            return invalid("--body-read-timeout-ms must be at least 100");
        }
        if self.max_connections == 0 {
            return invalid("--max-connections must be at least 1");
        }
        Ok(())
    }
}

fn read_file(path: &Path) -> Result<RouterArgs, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::ReadFile {
        path: path.to_path_buf(),
        source,
    })?;
    toml::from_str(&text).map_err(|source| ConfigError::ParseFile {
        path: path.to_path_buf(),
        source,
    })
}

/// Trims, drops a trailing slash, and checks each entry is `http(s)://HOST[:PORT]` or
/// `dns://NAME:PORT`, listed once.
fn normalise_urls(role: &str, urls: Vec<String>) -> Result<Vec<String>, ConfigError> {
    let mut out: Vec<String> = Vec::with_capacity(urls.len());
    for raw in urls {
        if raw.trim().is_empty() {
            continue;
        }
        let entry = WorkerEntry::parse(&raw)
            .map_err(|e| ConfigError::Invalid(format!("{role} worker entry {e}")))?
            .to_text();
        if out.contains(&entry) {
            return Err(ConfigError::Invalid(format!(
                "{role} worker entry `{entry}` is listed twice"
            )));
        }
        out.push(entry);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn parse(args: &[&str]) -> Result<RouterConfig, ConfigError> {
        let mut argv = vec!["tandem-router"];
        argv.extend_from_slice(args);
        RouterConfig::from_args(RouterArgs::try_parse_from(argv).expect("flags parse"))
    }

    #[test]
    fn flags_and_defaults() {
        let c = parse(&[
            "--decode",
            "http://127.0.0.1:7201/,http://127.0.0.1:7202",
            "--prefill",
            "http://127.0.0.1:7101",
            "--transport",
            "tcp",
            "--fallback",
            "error",
            "--request-timeout-s",
            "0",
        ])
        .unwrap();
        assert_eq!(
            c.decode_urls,
            ["http://127.0.0.1:7201", "http://127.0.0.1:7202"]
        );
        assert_eq!(c.transport, Transport::Tcp);
        assert_eq!(c.fallback, FallbackPolicy::Error);
        assert_eq!(c.request_timeout, None);
        assert_eq!(c.max_concurrent_requests, 256);
        assert_eq!(c.max_queued_requests, 512);
        assert_eq!(c.body_limit_bytes, 2_000_000);
        assert_eq!(c.lease_ttl_ms, 30_000);
        assert_eq!(c.port, 8000);
        assert_eq!(c.dns_refresh, Duration::from_millis(5000));
    }

    #[test]
    fn dns_entries_in_flags_and_file() {
        let c = parse(&[
            "--decode",
            "dns://tandem-decode.tandem.svc.cluster.local:7201/,http://10.0.0.9:7201",
            "--prefill",
            "dns://tandem-prefill:7101",
            "--dns-refresh-ms",
            "250",
        ])
        .unwrap();
        assert_eq!(
            c.decode_urls,
            [
                "dns://tandem-decode.tandem.svc.cluster.local:7201",
                "http://10.0.0.9:7201"
            ]
        );
        assert_eq!(c.prefill_urls, ["dns://tandem-prefill:7101"]);
        assert_eq!(c.dns_refresh, Duration::from_millis(250));
        let dir = std::env::temp_dir().join(format!("tandem-router-dns-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("router.toml");
        std::fs::write(
            &path,
            "decode = [\"dns://decode.test:7201\"]\ndns_refresh_ms = 1000\n",
        )
        .unwrap();
        let c = parse(&["--config", path.to_str().unwrap()]).unwrap();
        assert_eq!(c.decode_urls, ["dns://decode.test:7201"]);
        assert_eq!(c.dns_refresh, Duration::from_millis(1000));
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            parse(&["--decode", "dns://decode.test"]).is_err(),
            "no port"
        );
        assert!(
            parse(&["--decode", "dns://d:1,dns://d:1/"]).is_err(),
            "twice"
        );
        assert!(parse(&["--decode", "dns://d:1", "--dns-refresh-ms", "0"]).is_err());
        let mut embedded = RouterConfig::new(Vec::new(), vec!["dns://d".into()]);
        assert!(embedded.validate().is_err(), "validate checks entries too");
        embedded.decode_urls = vec!["dns://d:7201".into()];
        assert!(embedded.validate().is_ok());
    }

    #[test]
    fn file_below_flags() {
        let dir = std::env::temp_dir().join(format!("tandem-router-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("router.toml");
        std::fs::write(
            &path,
            "decode = [\"http://10.0.0.2:7201\"]\nprefill = [\"http://10.0.0.3:7101\"]\nport = 9000\nagg_threshold = 64\n",
        )
        .unwrap();
        let c = parse(&["--config", path.to_str().unwrap(), "--port", "9100"]).unwrap();
        assert_eq!(c.decode_urls, ["http://10.0.0.2:7201"]);
        assert_eq!(c.agg_threshold, 64);
        assert_eq!(c.port, 9100);
        std::fs::write(&path, "decode = [\"http://x:1\"]\nbogus = 1\n").unwrap();
        assert!(matches!(
            parse(&["--config", path.to_str().unwrap()]),
            Err(ConfigError::ParseFile { .. })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn rejects_bad_values() {
        assert!(parse(&[]).is_err(), "no decode worker");
        assert!(parse(&["--decode", "127.0.0.1:7201"]).is_err(), "no scheme");
        assert!(parse(&["--decode", "http://a:1/path"]).is_err(), "path");
        assert!(
            parse(&["--decode", "http://a:1,http://a:1"]).is_err(),
            "twice"
        );
        assert!(parse(&["--decode", "http://a:1", "--max-concurrent-requests", "0"]).is_err());
        assert!(parse(&["--decode", "http://a:1", "--api-key", ""]).is_err());
        assert!(parse(&["--decode", "http://a:1", "--slo-tpot-ms", "0"]).is_err());
        assert!(parse(&["--decode", "http://a:1", "--slo-ttft-ms", "NaN"]).is_err());
    }

    #[test]
    fn placement_and_slo_from_flags_and_file() {
        let c = parse(&["--decode", "http://a:1"]).unwrap();
        assert_eq!(c.placement, PlacementPolicy::Static);
        assert_eq!(c.slo, SloTargets::default());
        let dir = std::env::temp_dir().join(format!("tandem-router-slo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("router.toml");
        std::fs::write(
            &path,
            "decode = [\"http://a:1\"]\nplacement = \"slo\"\nslo_tpot_ms = 45\nslo_ttft_ms = 800.5\n",
        )
        .unwrap();
        let c = parse(&[
            "--config",
            path.to_str().unwrap(),
            "--slo-ttft-per-token-ms",
            "0",
        ])
        .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(c.placement, PlacementPolicy::Slo);
        assert_eq!(
            c.slo,
            SloTargets {
                ttft_ms: 800.5,
                ttft_per_token_ms: 0.0,
                tpot_ms: 45.0
            }
        );
    }
}
