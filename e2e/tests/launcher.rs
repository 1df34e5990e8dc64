//! `tandem up` for real: starts a tiny 1P1D deployment from a file, serves a request, stops
//! everything on SIGTERM with exit status 0; and when a worker dies, reports it and exits
//! non-zero after stopping the rest.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tandem_e2e::{binary, free_port};

struct Launcher {
    child: Child,
    stderr: mpsc::Receiver<String>,
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

fn start() -> Launcher {
    let dir = tempfile::tempdir().unwrap();
    let (router, prefill, decode) = (free_port(), free_port(), free_port());
    let kv = free_port();
    let config = format!(
        "[model]\nname = \"tiny\"\n[router]\nport = {router}\ntransport = \"tcp\"\n\
         [[prefill]]\nport = {prefill}\nthreads = 1\nkv_budget_mb = 16\n\
         [[decode]]\nport = {decode}\nkv_tcp_port = {kv}\nthreads = 1\nkv_budget_mb = 16\n"
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
        router,
        _dir: dir,
    }
}

fn pid_of(l: &Launcher, name: &str, seen: &mut Vec<String>) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        while let Ok(line) = l.stderr.try_recv() {
            seen.push(line);
        }
        let prefix = format!("[tandem] started {name} (pid ");
        if let Some(line) = seen.iter().find(|s| s.starts_with(&prefix)) {
            let rest = &line[prefix.len()..];
            return rest[..rest.find(')').unwrap()].parse().unwrap();
        }
        assert!(
            Instant::now() < deadline,
            "no start line for {name}: {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
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
    let mut l = start();
    let mut seen = Vec::new();
    let pids: Vec<u32> = ["prefill-0", "decode-0", "router"]
        .iter()
        .map(|n| pid_of(&l, n, &mut seen))
        .collect();
    let resp = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{}/v1/completions", l.router))
        .json(&serde_json::json!({"prompt": "hello", "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-tandem-mode"], "disaggregated");
    let status = Command::new("kill")
        .args(["-TERM", &l.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let status = wait_exit(&mut l.child, Duration::from_secs(30));
    assert!(status.success(), "clean stop exits 0, got {status}");
    for pid in pids {
        assert!(!alive(pid), "process {pid} outlived the launcher");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dying_worker_is_reported_and_fails_the_launcher() {
    let mut l = start();
    let mut seen = Vec::new();
    let decode = pid_of(&l, "decode-0", &mut seen);
    let others = [
        pid_of(&l, "prefill-0", &mut seen),
        pid_of(&l, "router", &mut seen),
    ];
    Command::new("kill")
        .args(["-KILL", &decode.to_string()])
        .status()
        .unwrap();
    let status = wait_exit(&mut l.child, Duration::from_secs(30));
    assert!(!status.success(), "a dead worker must fail the launcher");
    while let Ok(line) = l.stderr.try_recv() {
        seen.push(line);
    }
    assert!(
        seen.iter()
            .any(|s| s.contains("decode-0 exited unexpectedly")),
        "{seen:?}"
    );
    for pid in others {
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
