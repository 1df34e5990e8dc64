//! The CUDA MPS control daemon for deployments that split a GPU by thread percentage
//! (`[gpu] mps = true`). Without a daemon, `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` does nothing
//! and both workers would share the whole GPU unnoticed, so `tandem up` makes sure one runs:
//! it asks `nvidia-cuda-mps-control` for the server list, starts the daemon (`-d`) when none
//! answers, and stops the one it started (`quit`) when the deployment ends. A daemon that was
//! already running is left alone.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Why the MPS daemon could not be checked or started.
#[derive(Debug, thiserror::Error)]
pub enum MpsError {
    #[error(
        "the deployment asks for MPS but {0} cannot be run ({1}): install the NVIDIA driver utilities, or start the daemon yourself and set TANDEM_MPS_CONTROL"
    )]
    Missing(PathBuf, std::io::Error),
    #[error("{program} {what} did not succeed: {detail}")]
    Failed {
        program: PathBuf,
        what: String,
        detail: String,
    },
}

/// The control program: the one given (`--mps-control`), or `nvidia-cuda-mps-control` on
/// the PATH.
pub fn control_program(given: Option<PathBuf>) -> PathBuf {
    given.unwrap_or_else(|| PathBuf::from("nvidia-cuda-mps-control"))
}

/// A running MPS daemon; stops it on drop if this launcher started it.
#[derive(Debug)]
pub struct MpsDaemon {
    program: PathBuf,
    started_here: bool,
}

impl MpsDaemon {
    /// Makes sure a daemon answers, starting one if none does.
    pub fn ensure(program: &Path) -> Result<Self, MpsError> {
        if answers(program)? {
            return Ok(Self {
                program: program.to_owned(),
                started_here: false,
            });
        }
        let status = Command::new(program)
            .arg("-d")
            .stdin(Stdio::null())
            .status()
            .map_err(|e| MpsError::Missing(program.to_owned(), e))?;
        let failed = |detail: String| MpsError::Failed {
            program: program.to_owned(),
            what: "-d".into(),
            detail,
        };
        if !status.success() {
            return Err(failed(status.to_string()));
        }
        // `-d` returns once the daemon forked; give it a moment to open its pipe.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !answers(program)? {
            if Instant::now() > deadline {
                return Err(failed("the daemon did not answer within 10 s".into()));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(Self {
            program: program.to_owned(),
            started_here: true,
        })
    }

    /// Whether this launcher started the daemon (and will stop it).
    pub fn started_here(&self) -> bool {
        self.started_here
    }
}

impl Drop for MpsDaemon {
    fn drop(&mut self) {
        if self.started_here
            && let Err(e) = send(&self.program, "quit")
        {
            eprintln!("[tandem] stopping the MPS daemon: {e}");
        }
    }
}

/// Whether a daemon answers `get_server_list`.
fn answers(program: &Path) -> Result<bool, MpsError> {
    match send(program, "get_server_list") {
        Ok(()) => Ok(true),
        Err(MpsError::Failed { .. }) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Runs one control command; a client without a daemon exits non-zero.
fn send(program: &Path, command: &str) -> Result<(), MpsError> {
    let mut child = Command::new(program)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| MpsError::Missing(program.to_owned(), e))?;
    if let Some(mut stdin) = child.stdin.take() {
        // A client that exits before reading gives a broken pipe: its status says why.
        let _ = writeln!(stdin, "{command}");
    }
    let failed = |detail: String| MpsError::Failed {
        program: program.to_owned(),
        what: format!("`{command}`"),
        detail,
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return Ok(()),
            Ok(Some(status)) => return Err(failed(status.to_string())),
            Ok(None) if Instant::now() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(failed("no answer within 5 s".into()));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(failed(e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A stand-in for nvidia-cuda-mps-control: `-d` creates a state file, `quit` on stdin
    /// removes it, any other command succeeds only while it exists.
    fn fake_control(dir: &Path) -> PathBuf {
        let state = dir.join("running");
        let program = dir.join("mps-control");
        std::fs::write(
            &program,
            format!(
                "#!/bin/sh\nif [ \"$1\" = -d ]; then touch {s}; exit 0; fi\nread cmd\n[ -e {s} ] || exit 1\n[ \"$cmd\" = quit ] && rm {s}\nexit 0\n",
                s = state.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
        program
    }

    #[test]
    fn starts_a_daemon_when_none_runs_and_stops_only_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let program = fake_control(dir.path());
        let running = dir.path().join("running");
        let daemon = MpsDaemon::ensure(&program).unwrap();
        assert!(daemon.started_here());
        assert!(running.exists(), "the daemon was started");
        drop(daemon);
        assert!(!running.exists(), "the daemon we started was stopped");

        std::fs::write(&running, "").unwrap();
        let daemon = MpsDaemon::ensure(&program).unwrap();
        assert!(!daemon.started_here(), "a running daemon is reused");
        drop(daemon);
        assert!(running.exists(), "someone else's daemon is left running");
    }

    #[test]
    fn a_missing_control_program_is_a_clear_error() {
        let err = MpsDaemon::ensure(Path::new("/nonexistent/nvidia-cuda-mps-control"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("asks for MPS"), "{err}");
    }
}
