//! The deployment under test: its file (1 prefill + 1 decode worker, shm transport, tight
//! timeouts so attacks end quickly), `tandem up` started on it, the launcher's children
//! found by pid in `/proc`, gRPC clients that hold the deployment's secret, the workers'
//! load, the logs, and the stop with what it left behind.
//!
//! It never decides whether a row passed: it reports what it saw.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tandem_auth::{InternalAuth, Secret};
use tandem_e2e::{DecodeClient, PrefillClient, channel, free_port, rss_kib};
use tandem_proto::v1::decode_service_client::DecodeServiceClient;
use tandem_proto::v1::prefill_service_client::PrefillServiceClient;
use tandem_proto::v1::{InfoRequest, LoadReport, LoadRequest, WorkerInfo};

use crate::client::{RouterClient, SERVED};

/// The router's header and body read timeouts in this deployment.
pub const HTTP_TIMEOUT_MS: u64 = 2_000;
/// The decode worker's cap on a lease's wait without progress.
pub const MAX_LEASE_TTL_MS: u64 = 2_000;
/// The router's bound on a request's wait for a running slot (the overload row checks it).
pub const MAX_QUEUE_WAIT_MS: u64 = 2_000;
/// The router's running and waiting requests at most: together well under the overload
/// client's connections, so that a burst meets a full queue as well as the wait bound.
pub const MAX_RUNNING: usize = 64;
pub const MAX_QUEUED: usize = 128;
/// The decode worker's deadline for a KV TCP connection to prove itself.
pub const KV_HELLO_TIMEOUT_MS: u64 = 1_000;

/// The pids of the launcher's children, by role.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Pids {
    pub router: Option<u32>,
    pub prefill: Option<u32>,
    pub decode: Option<u32>,
}

impl Pids {
    /// Resident memory in KiB of (router, prefill, decode); 0 for a missing one.
    pub fn rss(&self) -> [u64; 3] {
        [self.router, self.prefill, self.decode].map(|pid| pid.map_or(0, rss_kib))
    }

    /// [`Self::rss`] outside the KV pools (`tandem_e2e::rss_outside_kv_pools_kib`).
    pub fn rss_outside_kv_pools(&self) -> [u64; 3] {
        [self.router, self.prefill, self.decode]
            .map(|pid| pid.map_or(0, tandem_e2e::rss_outside_kv_pools_kib))
    }
}

/// The ports the deployment's file gives each process.
#[derive(Debug, Clone, Copy)]
pub struct Ports {
    pub router: u16,
    pub prefill: u16,
    pub decode: u16,
    /// The decode worker's KV TCP listener.
    pub kv: u16,
}

/// A process's name, from `/proc`.
fn comm(pid: u32) -> Option<String> {
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    Some(comm.trim().to_string())
}

/// Live (non-zombie) children of `parent`, with their names, from `/proc`.
fn children_of(parent: u32) -> Vec<(u32, String)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // The name may hold spaces and parentheses: the fields start after the last ')'.
            let mut fields = stat[stat.rfind(')')? + 1..].split_whitespace();
            let state = fields.next()?;
            let ppid: u32 = fields.next()?.parse().ok()?;
            if ppid != parent || state == "Z" {
                return None;
            }
            Some((pid, comm(pid)?))
        })
        .collect()
}

pub fn signal(pid: u32, sig: &str) -> anyhow::Result<()> {
    let status = Command::new("kill")
        .args(["-s", sig, &pid.to_string()])
        .status()
        .context("running kill")?;
    anyhow::ensure!(status.success(), "kill -s {sig} {pid} failed");
    Ok(())
}

/// A fresh deployment secret, hex-encoded.
pub fn random_secret() -> anyhow::Result<String> {
    Ok(tandem_auth::hex(&tandem_auth::random_bytes::<32>()?))
}

/// `what` (an RPC, usually), given `secs` seconds: a hung worker is an error, not a hang.
pub async fn within<F: Future>(secs: u64, what: &str, f: F) -> anyhow::Result<F::Output> {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .with_context(|| format!("{what} timed out"))
}

/// The deployment's file. JSON strings are valid TOML basic strings: paths and flags go in
/// escaped.
fn config_toml(
    model: &str,
    router_args: &[String],
    ports: Ports,
    log_dir: &Path,
    shm_dir: &Path,
    secret_file: &Path,
) -> String {
    let s = |v: &str| serde_json::to_string(v).unwrap_or_default();
    let path = |p: &Path| s(&p.to_string_lossy());
    // The tiny model's blocks are 8 KiB; a real model's are ~100× larger, and the soak,
    // the long streams and the disconnect storm must fit without preemption.
    let kv_mb = if model == "tiny" { 32 } else { 1024 };
    let shm = path(shm_dir);
    let router_extra: String = router_args.iter().map(|a| format!(", {}", s(a))).collect();
    format!(
        r#"description = {description}
log_dir = {log_dir}
startup_timeout_s = 600

[model]
name = {model_s}

[router]
port = {router_port}
transport = "shm"
extra_args = ["--header-read-timeout-ms", "{HTTP_TIMEOUT_MS}", "--body-read-timeout-ms", "{HTTP_TIMEOUT_MS}", "--sse-keepalive-ms", "1000", "--max-queue-wait-ms", "{MAX_QUEUE_WAIT_MS}", "--max-concurrent-requests", "{MAX_RUNNING}", "--max-queued-requests", "{MAX_QUEUED}", "--served-model-name", "{SERVED}"{router_extra}]

[[prefill]]
port = {prefill_port}
threads = 1
kv_budget_mb = {kv_mb}
extra_args = ["--shm-dir", {shm}]

[[decode]]
port = {decode_port}
kv_tcp_port = {kv_port}
threads = 1
kv_budget_mb = {kv_mb}
extra_args = ["--shm-dir", {shm}, "--kv-tcp-hello-timeout-ms", "{KV_HELLO_TIMEOUT_MS}", "--max-lease-ttl-ms", "{MAX_LEASE_TTL_MS}"]

[security]
secret_file = {secret}

[supervise]
backoff_initial_ms = 200
"#,
        description = s(&format!("fault bench: 1P1D on {model}, shm")),
        model_s = s(model),
        log_dir = path(log_dir),
        secret = path(secret_file),
        router_port = ports.router,
        prefill_port = ports.prefill,
        decode_port = ports.decode,
        kv_port = ports.kv,
    )
}

/// Writes `secret` to a new file only its owner may read, as `tandem up` requires.
fn write_secret_file(path: &Path, secret: &str) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .context("creating the secret file")?;
    writeln!(f, "{secret}")?;
    Ok(())
}

/// How the workers came back to idle after a burst of work: within a first wait, or a
/// second, longer one (a worker still working off abandoned requests is busy, not leaking).
pub struct Settled {
    /// How long idle took, when within the first wait.
    pub promptly: Option<Duration>,
    /// Blocks in use (prefill, decode) when the first wait ended.
    pub used_then: (u32, u32),
    /// What the workers were doing when the first wait ended without idle.
    pub busy: Option<String>,
    /// How long idle took, within either wait.
    pub idle_after: Option<Duration>,
    /// The last counts of blocks in use (prefill, decode).
    pub used: (u32, u32),
}

/// What is known once the deployment has stopped.
pub struct Ending {
    pub stop_status: String,
    pub stop_took: Duration,
    /// Pids of serving processes still alive after the stop.
    pub survivors: Vec<u32>,
    pub shm_left: Vec<PathBuf>,
    /// Lines containing "panicked" in any log.
    pub panics: Vec<String>,
    /// Restarts the launcher decided.
    pub restarts: usize,
}

/// A deployment run by `tandem up`, stopped (SIGTERM to the launcher) when dropped.
pub struct Deployment {
    dir: tempfile::TempDir,
    shm_dir: tempfile::TempDir,
    launcher: Child,
    pub ports: Ports,
    auth: InternalAuth,
    pub router: RouterClient,
    stopped: bool,
}

impl Deployment {
    pub async fn start(
        bin_dir: &Path,
        model: &str,
        router_args: &[String],
    ) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("tandem-fault-bench-")
            .tempdir()
            .context("creating the temporary folder")?;
        // A folder of its own for the shared-memory pools, so what is left after the stop is
        // ours alone to count (other deployments on the machine use /dev/shm too).
        let shm_root = match Path::new("/dev/shm") {
            root if root.is_dir() => root.to_path_buf(),
            _ => std::env::temp_dir(),
        };
        let shm_dir = tempfile::Builder::new()
            .prefix("tandem-fault-bench-shm-")
            .tempdir_in(shm_root)
            .context("creating the shared-memory folder")?;
        // The secret is ours too: this benchmark acts as a member of the deployment.
        let secret = random_secret()?;
        let secret_file = dir.path().join("secret");
        write_secret_file(&secret_file, &secret)?;
        let ports = Ports {
            router: free_port(),
            prefill: free_port(),
            decode: free_port(),
            kv: free_port(),
        };
        anyhow::ensure!(
            [ports.router, ports.prefill, ports.decode, ports.kv]
                .iter()
                .all(|&p| p != 0),
            "no free port"
        );
        let log_dir = dir.path().join("logs");
        let config = config_toml(
            model,
            router_args,
            ports,
            &log_dir,
            shm_dir.path(),
            &secret_file,
        );
        let config_path = dir.path().join("deployment.toml");
        std::fs::write(&config_path, config).context("writing the deployment file")?;
        let launcher_log = std::fs::File::create(dir.path().join("launcher.log"))?;
        let tandem = bin_dir.join("tandem");
        let launcher = Command::new(&tandem)
            .arg("up")
            .arg(&config_path)
            .arg("--bin-dir")
            .arg(bin_dir)
            .stdin(Stdio::null())
            .stdout(launcher_log.try_clone()?)
            .stderr(launcher_log)
            .spawn()
            .with_context(|| format!("starting {}", tandem.display()))?;
        progress!(
            "started `tandem up` (pid {}), files in {}",
            launcher.id(),
            dir.path().display()
        );
        let mut dep = Self {
            dir,
            shm_dir,
            launcher,
            ports,
            auth: InternalAuth::with_secret(&Secret::new(&secret)?),
            router: RouterClient::new(ports.router)?,
            stopped: false,
        };
        if let Err(e) = dep.wait_healthy(Duration::from_secs(600)).await {
            dep.keep_files("no healthy deployment");
            return Err(e);
        }
        Ok(dep)
    }

    pub fn shm_dir(&self) -> &Path {
        self.shm_dir.path()
    }

    /// Keeps the folder with the deployment's file and logs after this run, and says where.
    pub fn keep_files(&mut self, why: &str) {
        self.dir.disable_cleanup(true);
        progress!(
            "{why}: logs and deployment file kept in {}",
            self.dir.path().display()
        );
    }

    fn launcher_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("launcher.log")).unwrap_or_default()
    }

    /// Fails when the launcher has exited (it gives up past the restart cap).
    pub fn check_launcher(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.launcher.try_wait()? {
            let log = self.launcher_log();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(15)..].join("\n");
            bail!("the launcher exited ({status}); last lines:\n{tail}");
        }
        Ok(())
    }

    async fn wait_healthy(&mut self, within: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        let health = self.router.url("/health");
        loop {
            self.check_launcher()?;
            let answer = self.router.http.get(&health).send();
            if let Ok(Ok(r)) = tokio::time::timeout(Duration::from_secs(2), answer).await
                && r.status() == reqwest::StatusCode::OK
            {
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the router's /health did not answer 200 within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    pub fn pids(&self) -> Pids {
        let mut pids = Pids::default();
        for (pid, comm) in children_of(self.launcher.id()) {
            match comm.as_str() {
                "tandem-router" => pids.router = Some(pid),
                "tandem-prefill" => pids.prefill = Some(pid),
                "tandem-decode" => pids.decode = Some(pid),
                _ => {}
            }
        }
        pids
    }

    /// Waits until the launcher runs a `role` process other than `old`; its pid.
    pub async fn wait_new_pid(
        &mut self,
        role: fn(&Pids) -> Option<u32>,
        old: u32,
        within: Duration,
    ) -> anyhow::Result<u32> {
        let deadline = Instant::now() + within;
        loop {
            self.check_launcher()?;
            if let Some(pid) = role(&self.pids()).filter(|&p| p != old) {
                return Ok(pid);
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "no new process replaced pid {old} within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A decode worker client signing with `auth` (a stranger's, for the attacks).
    pub async fn decode_as(&self, auth: &InternalAuth) -> anyhow::Result<DecodeClient> {
        let endpoint = format!("http://127.0.0.1:{}", self.ports.decode);
        Ok(DecodeServiceClient::new(channel(&endpoint, auth).await?))
    }

    /// A prefill worker client signing with `auth` (a stranger's, for the attacks).
    pub async fn prefill_as(&self, auth: &InternalAuth) -> anyhow::Result<PrefillClient> {
        let endpoint = format!("http://127.0.0.1:{}", self.ports.prefill);
        Ok(PrefillServiceClient::new(channel(&endpoint, auth).await?))
    }

    /// A decode worker client holding the deployment's secret.
    pub async fn decode(&self) -> anyhow::Result<DecodeClient> {
        self.decode_as(&self.auth).await
    }

    /// A prefill worker client holding the deployment's secret.
    pub async fn prefill(&self) -> anyhow::Result<PrefillClient> {
        self.prefill_as(&self.auth).await
    }

    pub async fn decode_info(&self) -> anyhow::Result<WorkerInfo> {
        let mut d = self.decode().await?;
        let info = within(10, "decode GetInfo", d.get_info(InfoRequest::default())).await??;
        Ok(info.into_inner())
    }

    pub async fn prefill_info(&self) -> anyhow::Result<WorkerInfo> {
        let mut p = self.prefill().await?;
        let info = within(10, "prefill GetInfo", p.get_info(InfoRequest::default())).await??;
        Ok(info.into_inner())
    }

    /// Both workers' load: (prefill, decode).
    async fn loads(&self) -> (anyhow::Result<LoadReport>, anyhow::Result<LoadReport>) {
        let prefill = async {
            let mut p = self.prefill().await?;
            Ok(
                within(5, "prefill GetLoad", p.get_load(LoadRequest::default()))
                    .await??
                    .into_inner(),
            )
        };
        let decode = async {
            let mut d = self.decode().await?;
            Ok(
                within(5, "decode GetLoad", d.get_load(LoadRequest::default()))
                    .await??
                    .into_inner(),
            )
        };
        (prefill.await, decode.await)
    }

    /// KV blocks in use (reserved blocks and leases included) on (prefill, decode).
    pub async fn blocks_in_use(&self) -> anyhow::Result<(u32, u32)> {
        let used = |l: LoadReport| l.total_blocks.saturating_sub(l.free_blocks) + l.leases;
        let (prefill, decode) = self.loads().await;
        Ok((used(prefill?), used(decode?)))
    }

    /// Both workers' load, for when they are not idle: what they are still doing.
    pub async fn load_summary(&self) -> String {
        let show = |l: anyhow::Result<LoadReport>| match l {
            Ok(l) => format!(
                "{} blocks used, {} leases, {} running, {} waiting",
                l.total_blocks.saturating_sub(l.free_blocks),
                l.leases,
                l.running,
                l.waiting
            ),
            Err(e) => format!("no answer ({e:#})"),
        };
        let (prefill, decode) = self.loads().await;
        format!("prefill: {}; decode: {}", show(prefill), show(decode))
    }

    /// Polls until no block is in use on either worker, up to `within`: how long that took
    /// (None if it did not), and the last counts.
    pub async fn wait_idle(&self, within: Duration) -> (Option<Duration>, (u32, u32)) {
        let started = Instant::now();
        let mut last = (u32::MAX, u32::MAX);
        loop {
            if let Ok(used) = self.blocks_in_use().await {
                last = used;
                if used == (0, 0) {
                    return (Some(started.elapsed()), used);
                }
            }
            if started.elapsed() > within {
                return (None, last);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits for idle up to `first`; if not idle by then, notes what the workers are doing
    /// and waits up to `then` more.
    pub async fn settle(&self, first: Duration, then: Duration) -> Settled {
        let (promptly, used_then) = self.wait_idle(first).await;
        if promptly.is_some() {
            return Settled {
                promptly,
                used_then,
                busy: None,
                idle_after: promptly,
                used: used_then,
            };
        }
        let busy = Some(self.load_summary().await);
        let (later, used) = self.wait_idle(then).await;
        Settled {
            promptly,
            used_then,
            busy,
            idle_after: later.map(|d| d + first),
            used,
        }
    }

    /// `[tandem] ... exited unexpectedly` lines of the launcher: restarts it decided.
    fn restarts(&self) -> usize {
        self.launcher_log()
            .lines()
            .filter(|l| l.contains("exited unexpectedly"))
            .count()
    }

    /// Lines containing "panicked" in every process's log and the launcher's.
    fn panics(&self) -> Vec<String> {
        let mut files = vec![self.dir.path().join("launcher.log")];
        if let Ok(entries) = std::fs::read_dir(self.dir.path().join("logs")) {
            files.extend(entries.filter_map(|e| e.ok().map(|e| e.path())));
        }
        let mut found = Vec::new();
        for f in files {
            let name = f.file_name().unwrap_or_default().to_string_lossy();
            let text = std::fs::read_to_string(&f).unwrap_or_default();
            for line in text.lines().filter(|l| l.contains("panicked")) {
                found.push(format!("{name}: {line}"));
            }
        }
        found
    }

    /// SIGTERM to the launcher, then waits for it (bounded; SIGKILL past it). The exit
    /// status, and how long the stop took. Blocking on purpose: it also runs from `Drop`,
    /// where nothing can be awaited, and by then no other task of the benchmark runs.
    fn stop(&mut self) -> (String, Duration) {
        let started = Instant::now();
        if self.stopped {
            return ("already stopped".into(), Duration::ZERO);
        }
        self.stopped = true;
        if let Ok(Some(status)) = self.launcher.try_wait() {
            return (format!("had exited: {status}"), started.elapsed());
        }
        let _ = signal(self.launcher.id(), "TERM");
        // The launcher gives each group 15 s before SIGKILL: 40 s covers both groups.
        let deadline = started + Duration::from_secs(40);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.launcher.try_wait() {
                return (status.to_string(), started.elapsed());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.launcher.kill();
        let _ = self.launcher.wait();
        ("did not stop within 40 s; killed".into(), started.elapsed())
    }

    /// Stops the deployment and looks at what it left: processes, shared memory, logs.
    pub fn finish(&mut self) -> Ending {
        let last = self.pids();
        let (stop_status, stop_took) = self.stop();
        // A process of the deployment still alive after the launcher's stop (by pid and name).
        let survivors = [last.router, last.prefill, last.decode]
            .into_iter()
            .flatten()
            .filter(|&pid| comm(pid).is_some_and(|c| c.starts_with("tandem-")))
            .collect();
        let shm_left = std::fs::read_dir(self.shm_dir.path())
            .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default();
        Ending {
            stop_status,
            stop_took,
            survivors,
            shm_left,
            panics: self.panics(),
            restarts: self.restarts(),
        }
    }
}

impl Drop for Deployment {
    fn drop(&mut self) {
        self.stop();
    }
}
