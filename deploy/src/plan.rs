//! From a deployment file to the exact processes to start: binary, flags, environment and
//! CPU set of each. [`plan_with`] is pure, so tests can check every flag without starting
//! anything; [`plan`] first resolves the deployment's security settings (drawing its secret).
//!
//! Secret values travel in [`ProcessSpec::secret_env`], apart from the plain environment, so
//! nothing that prints a plan (its `Debug`, [`ProcessSpec::env_display`]) can show them.

use std::collections::BTreeMap;
use std::path::PathBuf;

use clap::ValueEnum;
use tandem_cli::{
    DecodeArgs, EngineArgs, ModelArgs, PlacementPolicy, PrefillArgs, RouterArgs, RoutingPolicy,
    ServerArgs, TransportArg, defaults, to_args,
};

use crate::config::{DeployConfig, WorkerSpec};
use crate::security::{InternalSecurity, SECRET_PLACEHOLDER, Secret, SecurityError};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
    Router,
}

/// One process to start.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessSpec {
    pub name: String,
    pub role: Role,
    /// Binary name (`tandem-prefill`, `tandem-decode`, `tandem-router`).
    pub binary: &'static str,
    pub args: Vec<String>,
    pub env: BTreeMap<String, String>,
    /// Environment variables whose values are secret (the internal secret).
    pub secret_env: BTreeMap<String, Secret>,
    /// CPUs to pin to (empty: no pinning).
    pub cpus: Vec<usize>,
}

impl ProcessSpec {
    /// `NAME=value` for every variable, secret values replaced by a placeholder.
    pub fn env_display(&self) -> Vec<String> {
        let mut all: BTreeMap<&str, &str> = self
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        for k in self.secret_env.keys() {
            all.insert(k, SECRET_PLACEHOLDER);
        }
        all.into_iter().map(|(k, v)| format!("{k}={v}")).collect()
    }
}

/// Every process of a deployment, workers first, router last.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub processes: Vec<ProcessSpec>,
    /// Where clients send requests.
    pub router_url: String,
}

/// The flags every worker takes, from its entry and the deployment's model.
fn fill_worker(
    cfg: &DeployConfig,
    w: &WorkerSpec,
    name: &str,
    model: &mut ModelArgs,
    engine: &mut EngineArgs,
    server: &mut ServerArgs,
) {
    model.model = cfg.model.name.clone();
    model.weights = cfg.model.weights.clone();
    model.kv_dtype = cfg.model.kv_dtype.clone();
    engine.compute = cfg.model.compute.clone();
    model.tokenizer = cfg.model.tokenizer.as_ref().map(PathBuf::from);
    model.cache_dir = cfg.model.cache_dir.clone();
    server.host = w.host.clone();
    server.port = Some(w.port);
    server.worker_id = Some(name.to_string());
    server.log.log_format = cfg.log_format;
    engine.threads = w.threads.or((!w.cpus.is_empty()).then_some(w.cpus.len()));
    if let Some(v) = w.kv_budget_mb {
        engine.kv_budget_mb = v;
    }
    if let Some(v) = w.max_batch_tokens {
        engine.max_batch_tokens = v;
    }
    if let Some(v) = w.max_running {
        engine.max_running = v;
    }
    if let Some(on) = w.prefix_caching {
        engine.no_prefix_caching = !on;
    }
    if let Some(priority) = &w.cpu_priority {
        engine.cpu_priority = priority.clone();
    }
    // Any GPU setting puts the worker's engine on the GPU (device 0 of what
    // CUDA_VISIBLE_DEVICES leaves it).
    if w.uses_gpu() {
        engine.device = "cuda".into();
        engine.green_context_sms = w.green_context_sms;
    }
}

fn worker(cfg: &DeployConfig, role: Role, index: usize, w: &WorkerSpec) -> ProcessSpec {
    let (binary, prefix) = match role {
        Role::Prefill => ("tandem-prefill", "prefill"),
        _ => ("tandem-decode", "decode"),
    };
    let name = w
        .name
        .clone()
        .unwrap_or_else(|| format!("{prefix}-{index}"));
    let mut args = if role == Role::Prefill {
        let mut a: PrefillArgs = defaults();
        fill_worker(cfg, w, &name, &mut a.model, &mut a.engine, &mut a.server);
        to_args(&a)
    } else {
        let mut a: DecodeArgs = defaults();
        fill_worker(cfg, w, &name, &mut a.model, &mut a.engine, &mut a.server);
        a.kv_tcp_port = w.kv_tcp_port.unwrap_or(w.port.wrapping_add(1));
        a.lend_slack = w.lend_slack.unwrap_or(false);
        to_args(&a)
    };
    args.extend(w.extra_args.iter().cloned());
    let mut env = w.env.clone();
    if let Some(g) = w.gpu {
        env.insert("CUDA_VISIBLE_DEVICES".into(), g.to_string());
    }
    if let Some(p) = w.mps_thread_percentage {
        env.insert("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".into(), p.to_string());
    }
    ProcessSpec {
        name,
        role,
        binary,
        args,
        env,
        secret_env: BTreeMap::new(),
        cpus: w.cpus.clone(),
    }
}

/// The processes of `cfg`, with the security settings of its `[security]` section (a fresh
/// secret unless it names a file or is insecure).
pub fn plan(cfg: &DeployConfig) -> Result<Plan, SecurityError> {
    Ok(plan_with(cfg, &InternalSecurity::resolve(&cfg.security)?))
}

/// The processes of `cfg`, every one of them given `security`'s variables.
pub fn plan_with(cfg: &DeployConfig, security: &InternalSecurity) -> Plan {
    let mut processes = Vec::new();
    let url = |w: &WorkerSpec| format!("http://{}:{}", w.host, w.port);
    for (i, w) in cfg.prefill.iter().enumerate() {
        processes.push(worker(cfg, Role::Prefill, i, w));
    }
    for (i, w) in cfg.decode.iter().enumerate() {
        processes.push(worker(cfg, Role::Decode, i, w));
    }
    let r = &cfg.router;
    let mut router: RouterArgs = defaults();
    router.host = Some(r.host.clone());
    router.port = Some(r.port);
    // `validate` checked the name; an unknown one would be left to the router's default.
    router.transport = TransportArg::from_str(&r.transport, true).ok();
    router.agg_threshold = Some(u32::try_from(r.agg_threshold).unwrap_or(u32::MAX));
    router.routing = r
        .routing
        .as_deref()
        .and_then(|name| RoutingPolicy::from_str(name, true).ok());
    router.placement = r
        .placement
        .as_deref()
        .and_then(|name| PlacementPolicy::from_str(name, true).ok());
    router.slo_ttft_ms = r.slo.ttft_ms;
    router.slo_ttft_per_token_ms = r.slo.ttft_per_token_ms;
    router.slo_tpot_ms = r.slo.tpot_ms;
    router.elastic_threads = r.elastic_threads;
    // The router waits for a decode worker's model as long as the launcher waits for the
    // deployment: a worker that builds large weights must not outlast the router's own
    // default and fail a deployment the launcher would still have waited for.
    router.startup_timeout_s = Some(cfg.startup_timeout_s);
    router.decode = cfg.decode.iter().map(url).collect();
    router.prefill = cfg.prefill.iter().map(url).collect();
    router.log.log_format = cfg.log_format;
    let mut args = to_args(&router);
    args.extend(r.extra_args.iter().cloned());
    processes.push(ProcessSpec {
        name: "router".into(),
        role: Role::Router,
        binary: "tandem-router",
        args,
        env: r.env.clone(),
        secret_env: BTreeMap::new(),
        cpus: r.cpus.clone(),
    });
    let shared = security.env();
    for p in &mut processes {
        p.env.extend(shared.plain.clone());
        p.secret_env.extend(shared.secret.clone());
    }
    Plan {
        processes,
        router_url: format!("http://{}:{}", r.host, r.port),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_plan_flags() {
        let p = plan(&DeployConfig::default_local(2)).unwrap();
        assert_eq!(p.router_url, "http://127.0.0.1:8000");
        let names: Vec<&str> = p.processes.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["prefill-0", "decode-0", "router"]);
        let decode = &p.processes[1];
        assert_eq!(decode.cpus, vec![1]);
        let joined = decode.args.join(" ");
        // Defaults (the model among them) go unsaid: the processes get no TANDEM_* variable
        // but the plan's, so the defaults hold.
        assert!(
            !joined.contains("--model")
                && joined.contains("--threads 1")
                && joined.contains("--kv-tcp-port 7202"),
            "{joined}"
        );
        let router = p.processes[2].args.join(" ");
        assert!(router.contains("--startup-timeout-s 600"), "{router}");
        let mut tiny = DeployConfig::default_local(2);
        tiny.model.name = "tiny".into();
        tiny.model.cache_dir = Some("/var/cache/tandem".into());
        tiny.log_format = tandem_cli::LogFormat::Json;
        let p = plan(&tiny).unwrap();
        for proc in &p.processes[..2] {
            let joined = proc.args.join(" ");
            assert!(
                joined.contains("--model tiny")
                    && joined.contains("--cache-dir /var/cache/tandem")
                    && joined.contains("--log-format json"),
                "{joined}"
            );
        }
        assert!(p.processes[2].args.join(" ").contains("--log-format json"));
        let router = p.processes[2].args.join(" ");
        assert!(
            router.contains("--prefill http://127.0.0.1:7101")
                && router.contains("--decode http://127.0.0.1:7201")
                && !router.contains("--routing"),
            "{router}"
        );
        let mut rr = DeployConfig::default_local(2);
        rr.router.routing = Some("round-robin".into());
        let p = plan(&rr).unwrap();
        let router = p.processes[2].args.join(" ");
        assert!(router.contains("--routing round-robin"), "{router}");
        let mut slo = DeployConfig::default_local(2);
        slo.router.placement = Some("slo".into());
        slo.router.slo.tpot_ms = Some(45.0);
        let router = plan(&slo).unwrap().processes[2].args.join(" ");
        assert!(
            router.contains("--placement slo") && router.contains("--slo-tpot-ms 45"),
            "{router}"
        );
        assert!(!router.contains("--slo-ttft-ms"), "{router}");
    }

    #[test]
    fn gpu_shares_become_environment() {
        let cfg = DeployConfig::from_toml(
            "[gpu]\ncount = 2\nsms = 132\nmps = true\n[[prefill]]\nport = 7101\ngpu = 0\nmps_thread_percentage = 60\n[[decode]]\nport = 7201\ngpu = 1\ngreen_context_sms = 64\n",
        )
        .unwrap();
        cfg.validate(2).unwrap();
        let p = plan(&cfg).unwrap();
        assert_eq!(
            p.processes[0].env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"],
            "60"
        );
        assert_eq!(p.processes[1].env["CUDA_VISIBLE_DEVICES"], "1");
        assert!(
            p.processes[1]
                .args
                .windows(2)
                .any(|w| w == ["--green-context-sms", "64"]),
            "{:?}",
            p.processes[1].args
        );
        for worker in &p.processes[..2] {
            assert!(
                worker.args.join(" ").contains("--device cuda"),
                "{worker:?}"
            );
        }
        let cpu = plan(&DeployConfig::default_local(2)).unwrap();
        assert!(
            cpu.processes
                .iter()
                .all(|p| !p.args.contains(&"--device".into()))
        );
    }

    #[test]
    fn every_process_gets_the_secret_in_its_environment_only() {
        use crate::security::SECRET_ENV;
        let p = plan(&DeployConfig::default_local(2)).unwrap();
        let secret = p.processes[0].secret_env[SECRET_ENV].expose().to_string();
        assert_eq!(secret.len(), 64);
        let shown = format!("{p:?}");
        assert!(!shown.contains(&secret), "Debug shows the secret: {shown}");
        for proc in &p.processes {
            assert_eq!(
                proc.secret_env[SECRET_ENV].expose(),
                secret,
                "{}",
                proc.name
            );
            assert!(
                proc.args.iter().all(|a| !a.contains(&secret)),
                "{} has the secret on its command line",
                proc.name
            );
            assert!(!proc.env.contains_key(SECRET_ENV));
            let display = proc.env_display().join(" ");
            assert!(
                display.contains("TANDEM_INTERNAL_SECRET=<generated at start>")
                    && !display.contains(&secret),
                "{display}"
            );
        }
        let again = plan(&DeployConfig::default_local(2)).unwrap();
        assert_ne!(
            again.processes[0].secret_env[SECRET_ENV].expose(),
            secret,
            "each deployment draws its own secret"
        );
    }

    #[test]
    fn a_secret_file_or_insecure_passes_no_secret_value() {
        use crate::security::{SECRET_ENV, SECRET_FILE_ENV, TLS_KEY_ENV};
        let with = |section: &str| {
            let cfg =
                DeployConfig::from_toml(&format!("{section}\n[[decode]]\nport = 7201\n")).unwrap();
            plan(&cfg).unwrap()
        };
        let file = with(
            "[security]\nsecret_file = \"/run/tandem/secret\"\ntls_ca = \"ca.pem\"\ntls_cert = \"c.pem\"\ntls_key = \"k.pem\"",
        );
        for proc in &file.processes {
            assert!(proc.secret_env.is_empty(), "{proc:?}");
            assert_eq!(proc.env[SECRET_FILE_ENV], "/run/tandem/secret");
            assert_eq!(proc.env[TLS_KEY_ENV], "k.pem");
            assert!(!proc.env.contains_key(SECRET_ENV));
        }
        let insecure = with("[security]\ninsecure = true");
        for proc in &insecure.processes {
            assert!(proc.secret_env.is_empty(), "{proc:?}");
            assert_eq!(
                proc.env.keys().collect::<Vec<_>>(),
                [crate::security::INSECURE_ENV],
                "only the explicit insecure flag: {proc:?}"
            );
        }
    }
}
