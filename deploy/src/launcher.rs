//! Starting, watching and stopping the processes of a [`Plan`].
//!
//! Each child gets its flags, environment and CPU set (`sched_setaffinity` before exec); its
//! output lines are prefixed with its name on our stderr, or written to `<log_dir>/<name>.log`.
//! The launcher waits for the router's `/health` to answer 200, then supervises: Ctrl-C or
//! SIGTERM stops everything in order (router first, so no new work reaches the workers); a
//! child that exits on its own is reported and the rest are stopped, and the launcher fails.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::Command;
use tokio::sync::mpsc;

use crate::plan::{Plan, ProcessSpec, Role};

/// Why a deployment did not come up or did not stay up.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error(
        "{binary} not found in {dir}: build it with `cargo build --release --bins` (or set bin_dir)"
    )]
    MissingBinary { binary: String, dir: PathBuf },
    #[error("starting {name}: {source}")]
    Spawn {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{name} exited during startup ({status})")]
    StartupExit { name: String, status: String },
    #[error("the deployment was not healthy after {0:?}")]
    StartupTimeout(Duration),
    #[error("{name} exited unexpectedly ({status}); stopped the others")]
    ChildExited { name: String, status: String },
    #[error("log file {path}: {source}")]
    Log {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// How to run a plan.
#[derive(Debug, Clone)]
pub struct LaunchOptions {
    pub bin_dir: PathBuf,
    pub log_dir: Option<PathBuf>,
    pub startup_timeout: Duration,
    /// How long each process may take to stop after SIGTERM before it is killed.
    pub stop_timeout: Duration,
}

struct Running {
    name: String,
    role: Role,
    pid: u32,
}

/// Runs `plan` until `shutdown` resolves (clean stop, `Ok`) or a process dies (`Err`).
/// `on_ready` runs once the router is healthy.
pub async fn run(
    plan: &Plan,
    opts: &LaunchOptions,
    shutdown: impl Future<Output = ()>,
    on_ready: impl FnOnce(),
) -> Result<(), LaunchError> {
    let (exit_tx, mut exits) = mpsc::unbounded_channel::<(String, String)>();
    let mut running = Vec::new();
    for spec in &plan.processes {
        match spawn(spec, opts, exit_tx.clone()).await {
            Ok(r) => running.push(r),
            Err(e) => {
                stop_all(&running, opts.stop_timeout, &mut exits).await;
                return Err(e);
            }
        }
    }
    drop(exit_tx);
    let health = plan.router_url.trim_start_matches("http://").to_string();
    let deadline = Instant::now() + opts.startup_timeout;
    loop {
        if let Ok((name, status)) = exits.try_recv() {
            eprintln!("[tandem] {name} exited during startup ({status})");
            stop_all(&running, opts.stop_timeout, &mut exits).await;
            return Err(LaunchError::StartupExit { name, status });
        }
        if router_healthy(&health).await {
            break;
        }
        if Instant::now() > deadline {
            stop_all(&running, opts.stop_timeout, &mut exits).await;
            return Err(LaunchError::StartupTimeout(opts.startup_timeout));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    on_ready();
    tokio::pin!(shutdown);
    tokio::select! {
        () = &mut shutdown => {
            eprintln!("[tandem] stopping");
            stop_all(&running, opts.stop_timeout, &mut exits).await;
            Ok(())
        }
        Some((name, status)) = exits.recv() => {
            eprintln!("[tandem] {name} exited unexpectedly ({status}); stopping the others");
            let others: Vec<Running> = running.into_iter().filter(|r| r.name != name).collect();
            stop_all(&others, opts.stop_timeout, &mut exits).await;
            Err(LaunchError::ChildExited { name, status })
        }
    }
}

async fn spawn(
    spec: &ProcessSpec,
    opts: &LaunchOptions,
    exits: mpsc::UnboundedSender<(String, String)>,
) -> Result<Running, LaunchError> {
    let path = opts.bin_dir.join(spec.binary);
    if !path.exists() {
        return Err(LaunchError::MissingBinary {
            binary: spec.binary.to_string(),
            dir: opts.bin_dir.clone(),
        });
    }
    let mut cmd = Command::new(&path);
    cmd.args(&spec.args)
        .envs(&spec.env)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if !spec.cpus.is_empty() {
        let cpus = spec.cpus.clone();
        // SAFETY: between fork and exec only async-signal-safe calls are made
        // (sched_setaffinity on a stack-built set).
        unsafe {
            cmd.pre_exec(move || pin_to(&cpus));
        }
    }
    let mut child = cmd.spawn().map_err(|source| LaunchError::Spawn {
        name: spec.name.clone(),
        source,
    })?;
    let pid = child.id().unwrap_or(0);
    eprintln!(
        "[tandem] started {} (pid {pid}): {} {}",
        spec.name,
        spec.binary,
        spec.args.join(" ")
    );
    let log = match &opts.log_dir {
        Some(dir) => Some(log_file(dir, &spec.name).await?),
        None => None,
    };
    if let Some(out) = child.stdout.take() {
        tokio::spawn(forward_lines(out, spec.name.clone(), log.clone()));
    }
    if let Some(err) = child.stderr.take() {
        tokio::spawn(forward_lines(err, spec.name.clone(), log));
    }
    let name = spec.name.clone();
    tokio::spawn(async move {
        let status = match child.wait().await {
            Ok(s) => s.to_string(),
            Err(e) => format!("wait failed: {e}"),
        };
        let _ = exits.send((name, status));
    });
    Ok(Running {
        name: spec.name.clone(),
        role: spec.role,
        pid,
    })
}

fn pin_to(cpus: &[usize]) -> std::io::Result<()> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET bounds-checks the index.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            libc::CPU_SET(c, &mut set);
        }
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

type SharedLog = std::sync::Arc<tokio::sync::Mutex<tokio::fs::File>>;

async fn log_file(dir: &Path, name: &str) -> Result<SharedLog, LaunchError> {
    let path = dir.join(format!("{name}.log"));
    let err = |source| LaunchError::Log {
        path: path.clone(),
        source,
    };
    tokio::fs::create_dir_all(dir).await.map_err(err)?;
    let file = tokio::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .await
        .map_err(err)?;
    Ok(std::sync::Arc::new(tokio::sync::Mutex::new(file)))
}

async fn forward_lines(stream: impl AsyncRead + Unpin, name: String, log: Option<SharedLog>) {
    let mut lines = BufReader::new(stream).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        match &log {
            Some(file) => {
                let mut f = file.lock().await;
                let _ = f.write_all(format!("{line}\n").as_bytes()).await;
            }
            None => eprintln!("[{name}] {line}"),
        }
    }
}

/// One `GET /health` over plain HTTP/1.1: true on a 200.
async fn router_healthy(addr: &str) -> bool {
    let attempt = async {
        let mut s = TcpStream::connect(addr).await.ok()?;
        s.write_all(
            format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .ok()?;
        let mut buf = [0u8; 64];
        let n = s.read(&mut buf).await.ok()?;
        let head = String::from_utf8_lossy(&buf[..n]);
        Some(head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200"))
    };
    tokio::time::timeout(Duration::from_secs(2), attempt)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}

/// SIGTERM the router, then the workers; wait for each group; SIGKILL what is left.
async fn stop_all(
    running: &[Running],
    timeout: Duration,
    exits: &mut mpsc::UnboundedReceiver<(String, String)>,
) {
    let mut alive: HashMap<&str, u32> = running.iter().map(|r| (r.name.as_str(), r.pid)).collect();
    for group in [&[Role::Router][..], &[Role::Prefill, Role::Decode][..]] {
        let members: Vec<&Running> = running
            .iter()
            .filter(|r| group.contains(&r.role) && alive.contains_key(r.name.as_str()))
            .collect();
        for r in &members {
            signal(r.pid, libc::SIGTERM);
        }
        let deadline = Instant::now() + timeout;
        while members.iter().any(|r| alive.contains_key(r.name.as_str())) {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, exits.recv()).await {
                Ok(Some((name, status))) => {
                    eprintln!("[tandem] {name} stopped ({status})");
                    alive.remove(name.as_str());
                }
                Ok(None) => return,
                Err(_) => {
                    for r in &members {
                        if alive.remove(r.name.as_str()).is_some() {
                            eprintln!(
                                "[tandem] {} did not stop in {timeout:?}; killing it",
                                r.name
                            );
                            signal(r.pid, libc::SIGKILL);
                        }
                    }
                }
            }
        }
    }
}

fn signal(pid: u32, sig: libc::c_int) {
    if let Ok(pid) = libc::pid_t::try_from(pid)
        && pid > 0
    {
        // SAFETY: kill(2) on a child's pid; a stale pid at worst fails with ESRCH.
        unsafe {
            libc::kill(pid, sig);
        }
    }
}
