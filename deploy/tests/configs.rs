//! Every deployment file in `deploy/` parses and validates (GPU layouts against their own
//! `[gpu]` section, CPU lists against a 4-core machine), through the real `tandem check`.

use std::path::PathBuf;
use std::process::Command;

fn files(dir: &str) -> Vec<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(dir);
    let mut out: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    out.sort();
    out
}

#[test]
fn every_deployment_file_is_valid() {
    let mut all = files("local");
    all.extend(files("gpu"));
    all.extend(files("experiments/configs"));
    assert!(all.len() >= 12, "{all:?}");
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .arg("check")
        .arg("--cores")
        .arg("4")
        .args(&all)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("ok")).count(),
        all.len()
    );
}

#[test]
fn check_reports_a_bad_file() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[[decode]]\nport = 7201\ncpus = [9]\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["check", "--cores", "2"])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("CPU 9 does not exist"));
}

#[test]
fn plan_prints_the_default_deployment() {
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .arg("plan")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(
        stdout.contains("prefill-0: tandem-prefill --kv-budget-mb 512 --threads 1 --port 7101"),
        "{stdout}"
    );
    assert!(
        stdout.contains("router: tandem-router --host 127.0.0.1 --port 8000"),
        "{stdout}"
    );
}

/// A worker setting in the launcher's environment is refused before anything starts, with the
/// file key that sets it; it is never dropped in silence.
#[test]
fn up_and_plan_refuse_a_worker_setting_from_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tiny.toml");
    std::fs::write(
        &config,
        "[model]\nname = \"tiny\"\n[[prefill]]\nport = 7101\n[[decode]]\nport = 7201\n",
    )
    .unwrap();
    let empty_bin_dir = dir.path().join("bin");
    std::fs::create_dir(&empty_bin_dir).unwrap();
    for args in [
        vec![
            "up".into(),
            config.clone(),
            "--bin-dir".into(),
            empty_bin_dir,
        ],
        vec!["plan".into(), config],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(&args)
            .env("TANDEM_WEIGHTS", "f32")
            // Were the refusal missing, `up` must not build the serving binaries from here.
            .env_remove("CARGO")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {stderr}");
        assert!(
            stderr.contains("TANDEM_WEIGHTS: set `weights` in the file's [model] section"),
            "{args:?}: {stderr}"
        );
        assert!(
            !stderr.contains("started") && out.stdout.is_empty(),
            "{args:?}: nothing may start: {stderr}"
        );
    }
}
