//! `tandem`: the launcher. `tandem up [CONFIG]` runs a deployment; `tandem check CONFIG…`
//! validates deployment files; `tandem plan [CONFIG]` prints the commands `up` would run.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use tandem_cli::LogFormat;
use tandem_deploy::cli::{Cli, Cmd};
use tandem_deploy::environment::{check_env_tables, inherited, refuse_shell_settings};
use tandem_deploy::launcher::{LaunchOptions, run};
use tandem_deploy::mps::{self, MpsDaemon};
use tandem_deploy::security::InternalSecurity;
use tandem_deploy::{DeployConfig, plan, plan_with};

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn load(config: Option<&Path>) -> anyhow::Result<DeployConfig> {
    match config {
        Some(p) => DeployConfig::from_file(p).with_context(|| format!("reading {}", p.display())),
        None => Ok(DeployConfig::default_local(cores())),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Cmd::Up {
            config,
            bin_dir,
            log_dir,
            mps_control,
            cache_dir,
            log,
        } => up(
            config.as_deref(),
            bin_dir,
            log_dir,
            mps_control,
            cache_dir,
            log.log_format,
        ),
        Cmd::Check { configs, cores: c } => check(&configs, c.unwrap_or_else(cores)),
        Cmd::Plan { config } => print_plan(config.as_deref()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tandem: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// One line per process with its command, then its environment (secret values shown as a
/// placeholder: a plan is for reading, the secret is drawn again by `up`).
fn print_plan(config: Option<&Path>) -> anyhow::Result<()> {
    let cfg = load(config)?;
    refuse_shell_settings(std::env::vars_os(), config.is_some())?;
    for p in plan(&cfg)?.processes {
        println!("{}: {} {}", p.name, p.binary, p.args.join(" "));
        let env = p.env_display();
        if !env.is_empty() {
            println!("    env: {}", env.join(" "));
        }
    }
    Ok(())
}

fn check(configs: &[PathBuf], cores: usize) -> anyhow::Result<()> {
    let mut failed = 0;
    for path in configs {
        let valid = DeployConfig::from_file(path)
            .and_then(|c| c.validate(cores).map(|()| c))
            .and_then(|c| check_env_tables(&c).map(|()| c));
        match valid {
            Ok(c) => {
                println!("ok      {}", path.display());
                for w in c.warnings() {
                    println!("warning {}: {w}", path.display());
                }
            }
            Err(e) => {
                println!("invalid {}: {e}", path.display());
                failed += 1;
            }
        }
    }
    anyhow::ensure!(
        failed == 0,
        "{failed} of {} deployment files are invalid",
        configs.len()
    );
    Ok(())
}

fn up(
    config: Option<&Path>,
    bin_dir: Option<PathBuf>,
    log_dir: Option<PathBuf>,
    mps_control: Option<PathBuf>,
    cache_dir: Option<PathBuf>,
    log_format: LogFormat,
) -> anyhow::Result<()> {
    let mut cfg = load(config)?;
    // Before anything starts: a worker setting in this shell would not reach the workers.
    refuse_shell_settings(std::env::vars_os(), config.is_some())?;
    cfg.log_format = log_format;
    if cache_dir.is_some() {
        cfg.model.cache_dir = cache_dir;
    }
    cfg.validate(cores())?;
    check_env_tables(&cfg)?;
    for w in cfg.warnings() {
        eprintln!("[tandem] warning: {w}");
    }
    let bin_dir = bin_dir
        .or_else(|| cfg.bin_dir.clone())
        .or_else(|| {
            std::env::current_exe()
                .ok()
                .and_then(|e| e.parent().map(Path::to_path_buf))
        })
        .context("cannot locate the tandem binaries; pass --bin-dir")?;
    ensure_binaries(&bin_dir)?;
    let opts = LaunchOptions {
        bin_dir,
        // The plan configures every process; nothing TANDEM_* leaks in from this shell.
        inherited_env: inherited(std::env::vars_os()),
        log_dir: log_dir.or_else(|| cfg.log_dir.clone()),
        startup_timeout: Duration::from_secs(cfg.startup_timeout_s),
        stop_timeout: Duration::from_secs(15),
        restart: cfg.supervise.policy(),
    };
    let security = InternalSecurity::resolve(&cfg.security)?;
    let plan = plan_with(&cfg, &security);
    if let Some(d) = &cfg.description {
        eprintln!("[tandem] {d}");
    }
    eprintln!("[tandem] {}", security.describe());
    // Under MPS the daemon must run before the workers initialise CUDA; one started here is
    // stopped when this function returns, however the deployment ended.
    let _mps = match &cfg.gpu {
        Some(gpu) if gpu.mps => {
            let daemon = MpsDaemon::ensure(&mps::control_program(mps_control))?;
            if daemon.started_here() {
                eprintln!("[tandem] started the MPS control daemon");
            }
            Some(daemon)
        }
        _ => None,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let url = plan.router_url.clone();
    runtime.block_on(run(&plan, &opts, shutdown_signal(), || {
        println!("tandem is up: {url}");
        println!("  curl {url}/v1/completions -H 'Content-Type: application/json' -d '{{\"prompt\": \"The capital of France is\", \"max_tokens\": 16, \"temperature\": 0}}'");
        println!("  OpenAI API at {url}/v1, TGI at {url}/generate_stream, metrics at {url}/metrics. Ctrl-C stops everything.");
    }))?;
    Ok(())
}

/// Under `cargo run` (CARGO is set), builds the serving binaries beside this one when they are
/// missing, so `cargo run --release -p tandem-deploy -- up` is all a new user types.
fn ensure_binaries(bin_dir: &Path) -> anyhow::Result<()> {
    let names = ["tandem-router", "tandem-prefill", "tandem-decode"];
    if names.iter().all(|n| bin_dir.join(n).exists()) {
        return Ok(());
    }
    let Some(cargo) = std::env::var_os("CARGO") else {
        return Ok(()); // the launcher reports the missing binary with a hint
    };
    eprintln!("[tandem] building tandem-router, tandem-prefill and tandem-decode (once)");
    let mut cmd = std::process::Command::new(cargo);
    cmd.args([
        "build",
        "-p",
        "tandem-router",
        "-p",
        "tandem-prefill",
        "-p",
        "tandem-decode",
        "--bins",
    ]);
    if bin_dir.ends_with("release") {
        cmd.arg("--release");
    }
    let status = cmd.status().context("running cargo build")?;
    anyhow::ensure!(status.success(), "building the serving binaries failed");
    Ok(())
}

async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        () = term => {},
    }
}
