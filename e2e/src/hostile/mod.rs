//! Hostile model files and what a worker does with them: the crafted files (`cases`, built
//! by `writers`), a run of a worker binary on one of them that measures its time and peak
//! memory, and the verdict (refused by name: exit status 1, the expected words on stderr, no
//! panic, no abort, no kill). The `hostile_models` test and example (and so
//! `scripts/bench-hostile-models`) share them.

mod cases;
mod writers;

pub use cases::{Case, write_all};
pub use writers::{Gguf, GgufTensor, HfFolder, StTensor, raw_entry, vocabulary};

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;

/// What one run of a worker on a hostile model came to.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The exit status, or `None` when a signal ended it (an abort, a kill).
    pub code: Option<i32>,
    /// The signal that ended it, if one did.
    pub signal: Option<i32>,
    pub stderr: String,
    pub seconds: f64,
    /// The process's peak resident memory (`ru_maxrss` of `wait4`, which counts its
    /// children too).
    pub peak_rss_kib: u64,
    /// Whether the hang guard killed it.
    pub timed_out: bool,
}

impl Outcome {
    /// Why this run is not a refusal by name of `case`, if it is not.
    pub fn problem(&self, case: &Case) -> Option<String> {
        if self.timed_out {
            return Some("still running at the hang guard".into());
        }
        if let Some(sig) = self.signal {
            return Some(format!("ended by signal {sig}"));
        }
        if self.code != Some(1) {
            return Some(format!("exit status {:?}, expected 1", self.code));
        }
        for bad in ["panicked", "memory allocation of", "overflowed its stack"] {
            if self.stderr.contains(bad) {
                return Some(format!("`{bad}` on stderr"));
            }
        }
        if !self.stderr.contains(case.expect) {
            return Some(format!("stderr lacks `{}`", case.expect));
        }
        None
    }

    /// The error's last line (the innermost cause).
    pub fn error_line(&self) -> String {
        let line = self
            .stderr
            .lines()
            .rev()
            .map(str::trim)
            .find(|l| !l.is_empty())
            .unwrap_or("");
        line.trim_start_matches(|c: char| c.is_ascii_digit() || c == ':')
            .trim()
            .to_string()
    }
}

/// Runs `bin` (a worker binary) with `--model` set to the case's file and its flags, until it
/// exits or `hang_guard` passes (then it is killed), and measures it. The environment is this
/// process's less every `TANDEM_*` variable (a shell's `TANDEM_MODEL_LIMITS` must not change
/// the verdict), with backtraces off: an error's backtrace, symbolized, costs tens of MiB that
/// are no part of the load.
pub fn run(bin: &Path, case: &Case, hang_guard: Duration) -> anyhow::Result<Outcome> {
    let mut cmd = Command::new(bin);
    cmd.arg("--model")
        .arg(&case.model)
        .args(&case.args)
        .args(["--port", "0", "--threads", "1"]);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("TANDEM_") {
            cmd.env_remove(key);
        }
    }
    cmd.env("TANDEM_INTERNAL_SECRET", crate::TEST_SECRET)
        .env("RUST_BACKTRACE", "0")
        .env("RUST_LIB_BACKTRACE", "0")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let started = Instant::now();
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let mut stderr = child.stderr.take().context("the child's stderr")?;
    // Drained on a thread so a chatty child never blocks on a full pipe; the first MiB kept.
    let reader = std::thread::spawn(move || {
        let mut kept = Vec::new();
        let _ = (&mut stderr).take(1 << 20).read_to_end(&mut kept);
        let _ = std::io::copy(&mut stderr, &mut std::io::sink());
        String::from_utf8_lossy(&kept).into_owned()
    });
    let pid = child.id() as libc::pid_t;
    let mut timed_out = false;
    let (status, usage) = loop {
        if let Some(done) = wait4(pid, libc::WNOHANG)? {
            break done;
        }
        if started.elapsed() > hang_guard {
            timed_out = true;
            // SAFETY: `pid` is our child, not yet reaped.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            break wait4(pid, 0)?.context("waiting for the killed child")?;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let seconds = started.elapsed().as_secs_f64();
    let stderr = reader.join().unwrap_or_default();
    Ok(Outcome {
        code: libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status)),
        signal: libc::WIFSIGNALED(status).then(|| libc::WTERMSIG(status)),
        stderr,
        seconds,
        // Linux reports KiB.
        peak_rss_kib: usage.ru_maxrss.max(0) as u64,
        timed_out,
    })
}

/// `wait4` on `pid`: its status and resource use once it has exited, `None` while it runs
/// (with `WNOHANG`).
fn wait4(pid: libc::pid_t, flags: libc::c_int) -> anyhow::Result<Option<(i32, libc::rusage)>> {
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value for wait4 to fill.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: the pointers are to live locals of the right types.
    let got = unsafe { libc::wait4(pid, &mut status, flags, &mut usage) };
    match got {
        0 => Ok(None),
        p if p == pid => Ok(Some((status, usage))),
        _ => Err(std::io::Error::last_os_error()).context("wait4"),
    }
}

/// The markdown table of outcomes: file, what is hostile, the error, seconds, peak RSS.
pub fn table(rows: &[(Case, Outcome)]) -> String {
    let mut out = String::from(
        "| file | hostile | refused with | seconds | peak RSS (MiB) |\n| --- | --- | --- | ---: | ---: |\n",
    );
    for (case, o) in rows {
        let verdict = match o.problem(case) {
            None => {
                let line = o.error_line();
                let line = match line.char_indices().nth(200) {
                    Some((cut, _)) => format!("{}…", &line[..cut]),
                    None => line,
                };
                line.replace('|', "\\|")
            }
            Some(p) => format!("**NOT REFUSED: {p}**"),
        };
        out.push_str(&format!(
            "| {} | {} | {} | {:.2} | {:.1} |\n",
            case.name,
            case.what,
            verdict,
            o.seconds,
            o.peak_rss_kib as f64 / 1024.0
        ));
    }
    out
}
