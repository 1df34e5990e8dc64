//! Starting, supervising and stopping the processes of a [`Plan`].
//!
//! Each child gets its flags, environment and CPU set (`sched_setaffinity` before exec); its
//! output lines are prefixed with its name on our stderr, or written to `<log_dir>/<name>.log`.
//! The launcher waits for the router's `/health` to answer 200 with every worker healthy (a
//! child that exits before then fails the start), then supervises: a child that exits on its
//! own is started again with the same command after a backoff, within a cap on restarts per
//! minute ([`crate::supervise`]);
//! past the cap everything is stopped and the launcher fails. Ctrl-C or SIGTERM stops
//! everything in order (router first, so no new work reaches the workers), and no restart
//! waiting out its backoff happens after that.
//!
//! Children run in a process group of their own, so a Ctrl-C at the terminal reaches the
//! launcher alone and the stop keeps its order (and is not mistaken for crashes to restart);
//! their parent-death signal is SIGTERM, so a launcher killed outright does not leave workers
//! holding their ports.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::Command;
use tokio::sync::mpsc;

use crate::plan::{Plan, ProcessSpec, Role};
use crate::supervise::{RestartPolicy, RestartTracker, Verdict};

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
    #[error(
        "{name} kept exiting (last: {status}) after {restarts} restarts within a minute, the limit set by [supervise] max_restarts_per_minute; stopped the others"
    )]
    RestartLimit {
        name: String,
        status: String,
        restarts: u32,
    },
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
    /// The environment every process starts from: the launcher's own, less every `TANDEM_*`
    /// variable ([`crate::environment::inherited`]). A deployment's processes are configured by
    /// their plan alone (flags and the plan's environment), never by what the launcher's shell
    /// happened to export; `tandem up` refuses to start with a variable they would have read.
    pub inherited_env: Vec<(std::ffi::OsString, std::ffi::OsString)>,
    pub log_dir: Option<PathBuf>,
    pub startup_timeout: Duration,
    /// How long each process may take to stop after SIGTERM before it is killed.
    pub stop_timeout: Duration,
    /// When a process that exits while the deployment runs is started again.
    pub restart: RestartPolicy,
}

/// How long to wait for a SIGKILLed process to be reaped before giving up on it.
const KILL_WAIT: Duration = Duration::from_secs(5);

/// A child's exit: its index in the plan and how it ended.
type Exit = (usize, String);

/// One process of the plan and its current incarnation.
struct Supervised<'a> {
    spec: &'a ProcessSpec,
    /// The running incarnation's pid; `None` while none runs (so no stale pid is signalled).
    pid: Option<u32>,
    restarts: RestartTracker,
    /// When a restart waiting out its backoff is due.
    restart_at: Option<Instant>,
}

/// Runs `plan` until `shutdown` resolves (clean stop, `Ok`), or a process fails the start or
/// exceeds its restarts (`Err`). `on_ready` runs once the router counts every worker healthy.
pub async fn run(
    plan: &Plan,
    opts: &LaunchOptions,
    shutdown: impl Future<Output = ()>,
    on_ready: impl FnOnce(),
) -> Result<(), LaunchError> {
    let (exit_tx, mut exits) = mpsc::unbounded_channel::<Exit>();
    let now = Instant::now();
    let mut procs: Vec<Supervised> = plan
        .processes
        .iter()
        .map(|spec| Supervised {
            spec,
            pid: None,
            restarts: RestartTracker::new(now),
            restart_at: None,
        })
        .collect();
    for i in 0..procs.len() {
        match spawn(i, procs[i].spec, opts, exit_tx.clone()).await {
            Ok(pid) => {
                procs[i].pid = Some(pid);
                procs[i].restarts.on_start(Instant::now());
            }
            Err(e) => {
                stop_all(&mut procs, opts.stop_timeout, &mut exits).await;
                return Err(e);
            }
        }
    }
    let health = plan.router_url.trim_start_matches("http://").to_string();
    let deadline = Instant::now() + opts.startup_timeout;
    loop {
        if let Ok((i, status)) = exits.try_recv() {
            procs[i].pid = None;
            let name = procs[i].spec.name.clone();
            eprintln!("[tandem] {name} exited during startup ({status})");
            stop_all(&mut procs, opts.stop_timeout, &mut exits).await;
            return Err(LaunchError::StartupExit { name, status });
        }
        if deployment_healthy(&health).await {
            break;
        }
        if Instant::now() > deadline {
            stop_all(&mut procs, opts.stop_timeout, &mut exits).await;
            return Err(LaunchError::StartupTimeout(opts.startup_timeout));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    on_ready();
    supervise(&mut procs, opts, &exit_tx, &mut exits, shutdown).await
}

/// The running deployment: restarts what exits, until `shutdown` or a process past its cap.
async fn supervise(
    procs: &mut [Supervised<'_>],
    opts: &LaunchOptions,
    exit_tx: &mpsc::UnboundedSender<Exit>,
    exits: &mut mpsc::UnboundedReceiver<Exit>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), LaunchError> {
    let policy = opts.restart;
    tokio::pin!(shutdown);
    loop {
        let next = procs.iter().filter_map(|p| p.restart_at).min();
        let wake = tokio::time::Instant::from_std(next.unwrap_or_else(Instant::now));
        tokio::select! {
            // Shutdown first: once it has begun, nothing is started again.
            biased;
            () = &mut shutdown => {
                eprintln!("[tandem] stopping");
                stop_all(procs, opts.stop_timeout, exits).await;
                return Ok(());
            }
            Some((i, status)) = exits.recv() => {
                let p = &mut procs[i];
                p.pid = None;
                let spec = p.spec;
                let name = &spec.name;
                let now = Instant::now();
                match p.restarts.on_exit(&policy, now) {
                    Verdict::Restart { delay, recent } => {
                        eprintln!(
                            "[tandem] {name} exited unexpectedly ({status}); restarting it in {delay:?} (restart {recent} of at most {} per minute)",
                            policy.max_per_minute
                        );
                        p.restart_at = Some(now + delay);
                    }
                    Verdict::GiveUp { recent } => {
                        eprintln!(
                            "[tandem] ERROR: {name} exited unexpectedly ({status}) after {recent} restarts in the last minute (limit {}); giving up and stopping everything",
                            policy.max_per_minute
                        );
                        stop_all(procs, opts.stop_timeout, exits).await;
                        return Err(LaunchError::RestartLimit {
                            name: name.clone(),
                            status,
                            restarts: recent,
                        });
                    }
                }
            }
            () = tokio::time::sleep_until(wake), if next.is_some() => {
                let now = Instant::now();
                for (i, p) in procs.iter_mut().enumerate() {
                    if p.restart_at.is_none_or(|t| t > now) {
                        continue;
                    }
                    p.restart_at = None;
                    p.restarts.on_start(now);
                    match spawn(i, p.spec, opts, exit_tx.clone()).await {
                        Ok(pid) => p.pid = Some(pid),
                        // A start that fails is an exit like any other: it goes through the
                        // policy, so a binary that vanished ends at the cap, not in a loop.
                        Err(e) => {
                            let _ = exit_tx.send((i, format!("could not start: {e}")));
                        }
                    }
                }
            }
        }
    }
}

/// Starts an incarnation of plan entry `index`; its exit will arrive on `exits`. Returns its pid.
async fn spawn(
    index: usize,
    spec: &ProcessSpec,
    opts: &LaunchOptions,
    exits: mpsc::UnboundedSender<Exit>,
) -> Result<u32, LaunchError> {
    let path = opts.bin_dir.join(spec.binary);
    if !path.exists() {
        return Err(LaunchError::MissingBinary {
            binary: spec.binary.to_string(),
            dir: opts.bin_dir.clone(),
        });
    }
    // Opened before the child exists, so a failure here leaves no child nobody waits for.
    let log = match &opts.log_dir {
        Some(dir) => Some(log_file(dir, &spec.name).await?),
        None => None,
    };
    let mut cmd = Command::new(&path);
    cmd.env_clear()
        .envs(opts.inherited_env.iter().map(|(k, v)| (k, v)))
        .args(&spec.args)
        .envs(&spec.env)
        .envs(spec.secret_env.iter().map(|(k, v)| (k, v.expose())))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let cpus = spec.cpus.clone();
    let parent = std::process::id();
    // SAFETY: between fork and exec only async-signal-safe calls are made (prctl, getppid,
    // sched_setaffinity on a stack-built set), and nothing allocates.
    unsafe {
        cmd.pre_exec(move || child_setup(&cpus, parent));
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
    if let Some(out) = child.stdout.take() {
        tokio::spawn(forward_lines(out, spec.name.clone(), log.clone()));
    }
    if let Some(err) = child.stderr.take() {
        tokio::spawn(forward_lines(err, spec.name.clone(), log));
    }
    tokio::spawn(async move {
        let status = match child.wait().await {
            Ok(s) => s.to_string(),
            Err(e) => format!("wait failed: {e}"),
        };
        let _ = exits.send((index, status));
    });
    Ok(pid)
}

/// Runs in the child between fork and exec.
fn child_setup(cpus: &[usize], parent: u32) -> std::io::Result<()> {
    // The death signal fires when the forking thread ends: `run` spawns from the thread that
    // drives it, which lives as long as the launcher's runtime.
    // SAFETY: prctl with integer arguments.
    if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // The launcher may have died before the death signal was armed.
    // SAFETY: getppid cannot fail.
    if u32::try_from(unsafe { libc::getppid() }).ok() != Some(parent) {
        return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
    }
    if !cpus.is_empty() {
        pin_to(cpus)?;
    }
    Ok(())
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

/// One `GET /health` over plain HTTP/1.1: true once the router answers 200 and counts every
/// worker it was given as healthy. The router alone answers 200 as soon as one decode worker
/// can serve (what a load balancer in front of it wants); a deployment whose prefill worker is
/// still loading would run every request sent meanwhile aggregated, so "up" waits for all.
async fn deployment_healthy(addr: &str) -> bool {
    let attempt = async {
        let mut s = TcpStream::connect(addr).await.ok()?;
        s.write_all(
            format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .ok()?;
        // The answer is a status line, a few headers and a small JSON object; a longer one is
        // not the router's.
        let mut answer = Vec::new();
        s.take(HEALTH_ANSWER_MAX)
            .read_to_end(&mut answer)
            .await
            .ok()?;
        Some(all_workers_healthy(&String::from_utf8_lossy(&answer)))
    };
    tokio::time::timeout(Duration::from_secs(2), attempt)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}

/// The most of a `/health` answer read.
const HEALTH_ANSWER_MAX: u64 = 16 * 1024;

/// Whether a router's `/health` answer is a 200 whose body counts every worker healthy.
fn all_workers_healthy(answer: &str) -> bool {
    let Some((head, body)) = answer.split_once("\r\n\r\n") else {
        return false;
    };
    if !(head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200")) {
        return false;
    }
    let Ok(v) = serde_json::from_str::<serde_json::Value>(body.trim()) else {
        return false;
    };
    let count = |key: &str| v.get(key).and_then(serde_json::Value::as_u64);
    matches!(
        (
            count("decode_workers_healthy"),
            count("decode_workers"),
            count("prefill_workers_healthy"),
            count("prefill_workers"),
        ),
        (Some(dh), Some(d), Some(ph), Some(p)) if dh == d && ph == p
    )
}

/// Stops every running process: SIGTERM the router, then the workers; wait for each group;
/// SIGKILL what is left. Pending restarts are cancelled first.
async fn stop_all(
    procs: &mut [Supervised<'_>],
    timeout: Duration,
    exits: &mut mpsc::UnboundedReceiver<Exit>,
) {
    for p in procs.iter_mut() {
        p.restart_at = None;
    }
    for group in [&[Role::Router][..], &[Role::Prefill, Role::Decode][..]] {
        // Exits already queued first, so no pid that is gone gets a signal.
        while let Ok((i, status)) = exits.try_recv() {
            note_stopped(&mut procs[i], &status);
        }
        let members: Vec<usize> = (0..procs.len())
            .filter(|&i| group.contains(&procs[i].spec.role) && procs[i].pid.is_some())
            .collect();
        for &i in &members {
            if let Some(pid) = procs[i].pid {
                signal(pid, libc::SIGTERM);
            }
        }
        let mut deadline = Instant::now() + timeout;
        let mut killed = false;
        while members.iter().any(|&i| procs[i].pid.is_some()) {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, exits.recv()).await {
                Ok(Some((i, status))) => note_stopped(&mut procs[i], &status),
                Ok(None) => return,
                Err(_) if !killed => {
                    for &i in &members {
                        if let Some(pid) = procs[i].pid {
                            eprintln!(
                                "[tandem] {} did not stop in {timeout:?}; killing it",
                                procs[i].spec.name
                            );
                            signal(pid, libc::SIGKILL);
                        }
                    }
                    killed = true;
                    deadline = Instant::now() + KILL_WAIT;
                }
                Err(_) => {
                    for &i in &members {
                        if procs[i].pid.take().is_some() {
                            eprintln!(
                                "[tandem] {} was not reaped {KILL_WAIT:?} after SIGKILL",
                                procs[i].spec.name
                            );
                        }
                    }
                }
            }
        }
    }
}

fn note_stopped(p: &mut Supervised<'_>, status: &str) {
    eprintln!("[tandem] {} stopped ({status})", p.spec.name);
    p.pid = None;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: &str, body: &str) -> String {
        format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
    }

    fn body(decode: (u64, u64), prefill: (u64, u64)) -> String {
        format!(
            r#"{{"status":"ok","model_ready":true,"decode_workers_healthy":{},"decode_workers":{},"prefill_workers_healthy":{},"prefill_workers":{}}}"#,
            decode.0, decode.1, prefill.0, prefill.1
        )
    }

    #[test]
    fn up_waits_for_every_worker_not_just_a_servable_router() {
        assert!(all_workers_healthy(&answer(
            "200 OK",
            &body((1, 1), (1, 1))
        )));
        assert!(all_workers_healthy(&answer(
            "200 OK",
            &body((2, 2), (0, 0))
        )));
        // The router serves (200) with its decode worker alone: a prefill worker still
        // loading would see every request meanwhile run aggregated.
        assert!(!all_workers_healthy(&answer(
            "200 OK",
            &body((1, 1), (0, 1))
        )));
        assert!(!all_workers_healthy(&answer(
            "200 OK",
            &body((1, 2), (1, 1))
        )));
        assert!(!all_workers_healthy(&answer(
            "503 Service Unavailable",
            &body((0, 1), (1, 1))
        )));
    }

    #[test]
    fn a_health_answer_that_is_not_the_routers_is_not_ready() {
        assert!(!all_workers_healthy(""));
        assert!(!all_workers_healthy("HTTP/1.1 200 OK\r\n"));
        assert!(!all_workers_healthy(&answer("200 OK", "ok")));
        assert!(!all_workers_healthy(&answer(
            "200 OK",
            r#"{"status":"ok"}"#
        )));
        assert!(!all_workers_healthy(&answer(
            "200 OK",
            r#"{"decode_workers_healthy":-1,"decode_workers":-1,"prefill_workers_healthy":0,"prefill_workers":0}"#
        )));
    }
}
