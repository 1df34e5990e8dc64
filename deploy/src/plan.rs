//! From a deployment file to the exact processes to start: binary, flags, environment and
//! CPU set of each. [`plan_with`] is pure, so tests can check every flag without starting
//! anything; [`plan`] first resolves the deployment's security settings (drawing its secret).
//!
//! Secret values travel in [`ProcessSpec::secret_env`], apart from the plain environment, so
//! nothing that prints a plan (its `Debug`, [`ProcessSpec::env_display`]) can show them.

use std::collections::BTreeMap;

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

fn worker(cfg: &DeployConfig, role: Role, index: usize, w: &WorkerSpec) -> ProcessSpec {
    let (binary, prefix) = match role {
        Role::Prefill => ("tandem-prefill", "prefill"),
        _ => ("tandem-decode", "decode"),
    };
    let name = w
        .name
        .clone()
        .unwrap_or_else(|| format!("{prefix}-{index}"));
    let mut args: Vec<String> = vec![
        "--model".into(),
        cfg.model.name.clone(),
        "--dtype".into(),
        cfg.model.dtype.clone(),
        "--host".into(),
        w.host.clone(),
        "--port".into(),
        w.port.to_string(),
        "--worker-id".into(),
        name.clone(),
    ];
    if let Some(t) = &cfg.model.tokenizer {
        args.extend(["--tokenizer".into(), t.clone()]);
    }
    let threads = w.threads.or((!w.cpus.is_empty()).then_some(w.cpus.len()));
    let optional = [
        ("--threads", threads),
        ("--kv-budget-mb", w.kv_budget_mb),
        ("--max-batch-tokens", w.max_batch_tokens),
        ("--max-running", w.max_running),
    ];
    for (flag, value) in optional {
        if let Some(v) = value {
            args.extend([flag.to_string(), v.to_string()]);
        }
    }
    if role == Role::Decode {
        args.extend([
            "--kv-tcp-port".into(),
            w.kv_tcp_port.unwrap_or(w.port.wrapping_add(1)).to_string(),
        ]);
    }
    args.extend(w.extra_args.iter().cloned());
    // Any GPU setting puts the worker's engine on the GPU (device 0 of what
    // CUDA_VISIBLE_DEVICES leaves it).
    if w.uses_gpu() {
        args.extend(["--device".into(), "cuda".into()]);
    }
    let mut env = w.env.clone();
    if let Some(g) = w.gpu {
        env.insert("CUDA_VISIBLE_DEVICES".into(), g.to_string());
    }
    if let Some(p) = w.mps_thread_percentage {
        env.insert("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".into(), p.to_string());
    }
    if let Some(sms) = w.green_context_sms {
        env.insert("TANDEM_GREEN_CONTEXT_SMS".into(), sms.to_string());
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
    let mut args: Vec<String> = vec![
        "--host".into(),
        r.host.clone(),
        "--port".into(),
        r.port.to_string(),
        "--transport".into(),
        r.transport.clone(),
        "--agg-threshold".into(),
        r.agg_threshold.to_string(),
        "--decode".into(),
        cfg.decode.iter().map(url).collect::<Vec<_>>().join(","),
    ];
    if !cfg.prefill.is_empty() {
        args.extend([
            "--prefill".into(),
            cfg.prefill.iter().map(url).collect::<Vec<_>>().join(","),
        ]);
    }
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
        assert!(
            joined.contains("--model smollm2")
                && joined.contains("--threads 1")
                && joined.contains("--kv-tcp-port 7202"),
            "{joined}"
        );
        let router = p.processes[2].args.join(" ");
        assert!(
            router.contains("--prefill http://127.0.0.1:7101")
                && router.contains("--decode http://127.0.0.1:7201"),
            "{router}"
        );
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
        assert_eq!(p.processes[1].env["TANDEM_GREEN_CONTEXT_SMS"], "64");
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
