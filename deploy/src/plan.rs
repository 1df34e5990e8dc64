//! From a deployment file to the exact processes to start: binary, flags, environment and
//! CPU set of each. Pure, so tests can check every flag without starting anything.

use std::collections::BTreeMap;

use crate::config::{DeployConfig, WorkerSpec};

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
    /// CPUs to pin to (empty: no pinning).
    pub cpus: Vec<usize>,
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
        cpus: w.cpus.clone(),
    }
}

/// The processes of `cfg`.
pub fn plan(cfg: &DeployConfig) -> Plan {
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
        cpus: r.cpus.clone(),
    });
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
        let p = plan(&DeployConfig::default_local(2));
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
        let p = plan(&cfg);
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
        let cpu = plan(&DeployConfig::default_local(2));
        assert!(
            cpu.processes
                .iter()
                .all(|p| !p.args.contains(&"--device".into()))
        );
    }
}
