//! The Python client tools the end-to-end tests drive tandem with (the `openai` package,
//! TGI's `text-generation`, `jsonschema`): which Python has them, and a client script run
//! with it against a deployment.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A Python that imports every one of `modules`: `TANDEM_TOOLS_PYTHON`, else the tools venv
/// that `scripts/tools-venv` makes on first use (pip, once), as the harness builds the
/// binaries on first use. If neither works the test fails saying why: a test that needs the
/// clients never passes without running them.
///
/// # Panics
/// When no such Python can be found or made.
pub fn tools_python(modules: &[&str]) -> PathBuf {
    let import = format!("import {}", modules.join(", "));
    let works = |python: &Path| {
        Command::new(python)
            .args(["-c", &import])
            .status()
            .is_ok_and(|s| s.success())
    };
    let wanted = modules.join(", ");
    if let Some(given) = std::env::var_os("TANDEM_TOOLS_PYTHON").map(PathBuf::from) {
        assert!(
            works(&given),
            "TANDEM_TOOLS_PYTHON={} cannot import {wanted}",
            given.display()
        );
        return given;
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/tools-venv");
    let out = Command::new(&script)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "scripts/tools-venv could not make the Python tools venv (pip needs PyPI once): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let python = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    assert!(
        works(&python),
        "{} cannot import {wanted}",
        python.display()
    );
    python
}

/// Runs a client `script` (with the Python that has `openai`, `text_generation` and
/// `jsonschema`) against the deployment at `base_url` (its argument), and parses the JSON
/// line it prints.
///
/// # Panics
/// When the script fails (its stderr is the message) or prints no JSON.
pub async fn run_python_client(script: &'static str, base_url: String) -> serde_json::Value {
    let python = tools_python(&["openai", "text_generation", "jsonschema"]);
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .args(["-c", script, &base_url])
            .output()
    })
    .await
    .expect("the client task")
    .expect("the tools Python runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the client prints one JSON line")
}
