//! `tandem up` for real: starts a tiny 1P1D deployment from a file, serves a request, stops
//! everything on SIGTERM with exit status 0; restarts a worker killed under it, after which
//! the deployment serves again; and when a worker keeps dying past its restart cap, stops the
//! rest and exits non-zero.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tandem_e2e::{binary, free_port};

struct Launcher {
    child: Child,
    stderr: mpsc::Receiver<String>,
    /// Every stderr line read so far.
    seen: Vec<String>,
    router: u16,
    _dir: tempfile::TempDir,
}

impl Drop for Launcher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `tandem up CONFIG` with the workspace's binaries, stdout and stderr piped.
fn spawn_up(config: &std::path::Path) -> Child {
    spawn_up_with(config, &[])
}

fn spawn_up_with(config: &std::path::Path, env: &[(&str, &std::path::Path)]) -> Child {
    let bin = binary("tandem").unwrap();
    Command::new(&bin)
        .envs(env.iter().copied())
        .arg("up")
        .arg(config)
        .arg("--bin-dir")
        .arg(bin.parent().unwrap())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Starts the tiny deployment with `extra` appended to its file, and waits for the banner.
fn start(extra: &str) -> Launcher {
    let dir = tempfile::tempdir().unwrap();
    let (router, prefill, decode) = (free_port(), free_port(), free_port());
    let kv = free_port();
    let config = format!(
        "[model]\nname = \"tiny\"\n[router]\nport = {router}\ntransport = \"tcp\"\n\
         [[prefill]]\nport = {prefill}\nthreads = 1\nkv_budget_mb = 16\n\
         [[decode]]\nport = {decode}\nkv_tcp_port = {kv}\nthreads = 1\nkv_budget_mb = 16\n{extra}"
    );
    let path = dir.path().join("tiny.toml");
    std::fs::write(&path, config).unwrap();
    let mut child = spawn_up(&path);
    let (tx, stderr) = mpsc::channel();
    let err = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    // Wait for the banner on stdout.
    let out = child.stdout.take().unwrap();
    let (up_tx, up_rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if line.starts_with("tandem is up") {
                let _ = up_tx.send(line);
            }
        }
    });
    let banner = up_rx
        .recv_timeout(Duration::from_secs(90))
        .expect("tandem up prints its banner");
    assert!(banner.contains(&format!("127.0.0.1:{router}")), "{banner}");
    Launcher {
        child,
        stderr,
        seen: Vec::new(),
        router,
        _dir: dir,
    }
}

impl Launcher {
    /// Waits (at most `within`) for a stderr line at index `from` or later that satisfies
    /// `pred`, and returns its index.
    fn wait_line(&mut self, from: usize, within: Duration, pred: impl Fn(&str) -> bool) -> usize {
        let deadline = Instant::now() + within;
        loop {
            while let Ok(line) = self.stderr.try_recv() {
                self.seen.push(line);
            }
            if let Some(i) = (from..self.seen.len()).find(|&i| pred(&self.seen[i])) {
                return i;
            }
            assert!(
                Instant::now() < deadline,
                "no such line within {within:?}: {:#?}",
                self.seen
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The pid in the first `[tandem] started NAME (pid N)` line at index `from` or later.
    fn pid_of(&mut self, name: &str, from: usize) -> u32 {
        let prefix = format!("[tandem] started {name} (pid ");
        let i = self.wait_line(from, Duration::from_secs(10), |l| l.starts_with(&prefix));
        let rest = &self.seen[i][prefix.len()..];
        rest[..rest.find(')').unwrap()].parse().unwrap()
    }

    fn completions_url(&self) -> String {
        format!("http://127.0.0.1:{}/v1/completions", self.router)
    }

    fn sigterm(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }
}

fn kill9(pid: u32) {
    let status = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -9 {pid}");
}

fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z ")
}

fn wait_exit(child: &mut Child, within: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "launcher still running after {within:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_serves_and_stops_cleanly_on_sigterm() {
    let mut l = start("");
    let pids: Vec<u32> = ["prefill-0", "decode-0", "router"]
        .iter()
        .map(|n| l.pid_of(n, 0))
        .collect();
    let resp = reqwest::Client::new()
        .post(l.completions_url())
        .json(&serde_json::json!({"prompt": "hello", "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-tandem-mode"], "disaggregated");
    l.sigterm();
    let status = wait_exit(&mut l.child, Duration::from_secs(30));
    assert!(status.success(), "clean stop exits 0, got {status}");
    for pid in pids {
        assert!(!alive(pid), "process {pid} outlived the launcher");
    }
}

/// Restarts use short backoffs here so the tests do not wait.
const FAST_RESTARTS: &str = "[supervise]\nbackoff_initial_ms = 100\nbackoff_max_ms = 400\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_is_restarted_and_the_deployment_serves_again() {
    let mut l = start(FAST_RESTARTS);
    let decode = l.pid_of("decode-0", 0);
    let mut pids = vec![l.pid_of("prefill-0", 0), l.pid_of("router", 0)];
    let before = l.seen.len();
    kill9(decode);
    let i = l.wait_line(before, Duration::from_secs(30), |s| {
        s.contains("decode-0 exited unexpectedly") && s.contains("restarting it in")
    });
    assert!(l.seen[i].contains("signal: 9"), "{}", l.seen[i]);
    let restarted = l.pid_of("decode-0", i);
    assert_ne!(restarted, decode);
    pids.push(restarted);

    // The router finds the new decode worker again: poll until a request succeeds.
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = String::new();
    for _ in 0..240 {
        let resp = client
            .post(l.completions_url())
            .json(&serde_json::json!({"prompt": "hello", "max_tokens": 4}))
            .timeout(Duration::from_secs(10))
            .send()
            .await;
        match resp {
            Ok(r) if r.status() == 200 => {
                last.clear();
                break;
            }
            Ok(r) => last = format!("{}: {}", r.status(), r.text().await.unwrap_or_default()),
            Err(e) => last = e.to_string(),
        }
        assert!(
            Instant::now() < deadline,
            "no successful request within 60 s of the restart; last: {last}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(last.is_empty(), "still failing: {last}");

    l.sigterm();
    let status = wait_exit(&mut l.child, Duration::from_secs(30));
    assert!(status.success(), "clean stop exits 0, got {status}");
    for pid in pids {
        assert!(!alive(pid), "process {pid} outlived the launcher");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_keeps_dying_stops_the_deployment() {
    let mut l = start(&format!("{FAST_RESTARTS}max_restarts_per_minute = 1\n"));
    let first = l.pid_of("decode-0", 0);
    let others = [l.pid_of("prefill-0", 0), l.pid_of("router", 0)];
    let before = l.seen.len();
    kill9(first);
    let i = l.wait_line(before, Duration::from_secs(30), |s| {
        s.contains("decode-0 exited unexpectedly") && s.contains("restarting it in")
    });
    let second = l.pid_of("decode-0", i);
    kill9(second);
    let status = wait_exit(&mut l.child, Duration::from_secs(60));
    assert!(
        !status.success(),
        "a worker past its restart cap must fail the launcher"
    );
    l.wait_line(i, Duration::from_secs(5), |s| {
        s.contains("decode-0 exited unexpectedly") && s.contains("giving up")
    });
    for pid in others.into_iter().chain([first, second]) {
        assert!(!alive(pid), "process {pid} outlived the launcher");
    }
}

/// A GPU deployment on binaries built without the `cuda` feature fails loudly (the workers
/// refuse `--device cuda`, the launcher reports them and exits non-zero) instead of running on
/// the CPU with its GPU settings ignored; each committed GPU file is still a valid file.
#[test]
fn gpu_deployments_fail_loudly_without_cuda_support() {
    let bin = binary("tandem").unwrap();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for file in [
        "deploy/gpu/mps-1gpu.toml",
        "deploy/gpu/green-ctx-1gpu.toml",
        "deploy/gpu/two-gpus.toml",
    ] {
        let path = root.join(file);
        let check = Command::new(&bin)
            .args(["check", "--cores", "16"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(check.status.success(), "{file}: {check:?}");
        if tandem_engine::CUDA_SUPPORT {
            continue;
        }
        // MPS files get the control daemon first: a stand-in records that it was started,
        // and that the launcher stopped it again when the workers refused to start.
        let mps = tempfile::tempdir().unwrap();
        let daemon = mps.path().join("running");
        let control = mps.path().join("mps-control");
        std::fs::write(
            &control,
            format!(
                "#!/bin/sh\nif [ \"$1\" = -d ]; then touch {d}; echo started >> {d}.log; exit 0; fi\nread cmd\n[ -e {d} ] || exit 1\n[ \"$cmd\" = quit ] && rm {d}\nexit 0\n",
                d = daemon.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(
            &control,
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        let mut up = spawn_up_with(&path, &[("TANDEM_MPS_CONTROL", &control)]);
        let status = wait_exit(&mut up, Duration::from_secs(60));
        let mut stderr = String::new();
        std::io::Read::read_to_string(&mut up.stderr.take().unwrap(), &mut stderr).unwrap();
        assert!(!status.success(), "{file}: up must fail\n{stderr}");
        assert!(stderr.contains("without CUDA support"), "{file}: {stderr}");
        let started = mps.path().join("running.log").exists();
        assert_eq!(started, file.contains("mps"), "{file}: MPS daemon started?");
        assert!(
            !daemon.exists(),
            "{file}: the daemon tandem started was stopped"
        );
    }
}
