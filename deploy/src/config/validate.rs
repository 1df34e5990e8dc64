//! What a deployment file must satisfy before anything starts: workers and ports, CPU lists
//! and GPU shares that exist, known transports, placements and priorities, latency targets,
//! the supervisor's limits, the secret and TLS files; and the warnings for what runs but is
//! risky.

use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;
use std::path::Path;

use super::{ConfigError, DeployConfig, WorkerSpec};
use crate::security::{self, INTERNAL_ENV};

impl DeployConfig {
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
        for w in self.prefill.iter().chain(&self.decode) {
            if let Some(p) = &w.cpu_priority
                && !tandem_cli::CPU_PRIORITIES.contains(&p.as_str())
            {
                return bad(format!(
                    "cpu_priority `{p}` of the worker on port {}: use one of {:?}",
                    w.port,
                    tandem_cli::CPU_PRIORITIES
                ));
            }
        }
        if let Some(placement) = &self.router.placement {
            let known = flag_values::<tandem_cli::PlacementPolicy>();
            if !known.contains(placement) {
                return bad(format!(
                    "router.placement `{placement}`: use one of {known:?}"
                ));
            }
        }
        let slo = &self.router.slo;
        for (key, value) in [
            ("ttft_ms", slo.ttft_ms),
            ("ttft_per_token_ms", slo.ttft_per_token_ms),
            ("tpot_ms", slo.tpot_ms),
        ] {
            if value.is_some_and(|v| !v.is_finite() || v < 0.0) {
                return bad(format!(
                    "router.slo.{key}: a number of milliseconds, not negative"
                ));
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

/// The values a router flag of type `T` accepts, by name.
fn flag_values<T: clap::ValueEnum>() -> Vec<String> {
    T::value_variants()
        .iter()
        .filter_map(|t| t.to_possible_value())
        .map(|v| v.get_name().to_string())
        .collect()
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
    use super::is_loopback;

    #[test]
    fn loopback_hosts() {
        assert!(is_loopback("127.0.0.2") && is_loopback("[::1]") && is_loopback("localhost"));
        assert!(!is_loopback("10.0.0.1") && !is_loopback("0.0.0.0"));
    }
}
