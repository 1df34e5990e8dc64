//! The trial render of a model's chat template at load, in a child process that may take at
//! most [`TRIAL_MEMORY_BYTES`] of memory more than its parent had (`RLIMIT_DATA`: the
//! private writable memory a process maps, heap and anonymous mappings alike; address space
//! merely reserved does not count).
//!
//! Why a process: minijinja bounds a render's instructions (its fuel), and tandem its output,
//! but nothing bounds the memory a template builds in values it never prints. A string
//! doubled forty times in a variable (`{% set ns.s = ns.s ~ ns.s %}`), one `join` of 10 GB,
//! a `format` or `indent` a billion wide: each is a handful of instructions and an allocation
//! that ends in an abort or the OOM killer, and no allocation in minijinja can fail softly.
//! A forked child under `RLIMIT_DATA` can: its allocation fails, it aborts, and the parent
//! refuses the model, naming the file, where the worker itself would have died. The child
//! also contains anything else a template could do to a process (a stack overflow, a panic).
//!
//! The child only compiles and renders, then `_exit`s: no thread, lock or file of the parent
//! is used in it. minijinja's lazily built tables are built in the parent first, so no
//! other thread can be halfway through building one when the child is forked. Where `fork`
//! is refused (or off Unix) the trial runs in this process, as every render at serving time
//! does.

use std::time::{Duration, Instant};

use tandem_text::{ChatTemplate, TextError};

/// Memory the trial render may take beyond the parent's: legitimate
/// templates render the sample conversations in well under a megabyte, and every render's
/// output is bounded at about one.
pub const TRIAL_MEMORY_BYTES: u64 = 64 << 20;

/// The trial gives up on a child this long after forking it (the fuel stops a render in
/// about a second).
const TRIAL_TIMEOUT: Duration = Duration::from_secs(20);

/// Compiles `source` and renders it on the sample conversations ([`ChatTemplate::new`]) in a
/// child process under [`TRIAL_MEMORY_BYTES`]: `Err(ChatTemplateLimit)` when it runs past a
/// budget (the child's own words), takes more memory, crashes or hangs; `Ok` otherwise,
/// including when the template merely does not compile or refuses the samples (its own
/// business: the router serves completions without it).
pub(super) fn trial_render(
    source: &str,
    bos: Option<&str>,
    eos: Option<&str>,
) -> Result<(), TextError> {
    // minijinja's tables built here, before any fork (see the module's header).
    let _ = ChatTemplate::new("", None, None);
    #[cfg(unix)]
    if let Some(outcome) = unix::in_child(source, bos, eos) {
        return outcome;
    }
    in_process(source, bos, eos)
}

/// The trial in this process.
fn in_process(source: &str, bos: Option<&str>, eos: Option<&str>) -> Result<(), TextError> {
    match ChatTemplate::new(source, bos, eos) {
        Err(e @ TextError::ChatTemplateLimit(_)) => Err(e),
        _ => Ok(()),
    }
}

#[cfg(unix)]
mod unix {
    use super::*;

    /// The first byte the child writes: how its trial ended (a limit's words follow).
    const PASSED: u8 = b'P';
    const LIMIT: u8 = b'L';

    /// The trial in a forked child, or `None` when no child could be made.
    pub(super) fn in_child(
        source: &str,
        bos: Option<&str>,
        eos: Option<&str>,
    ) -> Option<Result<(), TextError>> {
        let mut fds = [0; 2];
        // SAFETY: `fds` has room for the two descriptors.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return None;
        }
        let [read_fd, write_fd] = fds;
        let Some(ceiling) = data_size().map(|now| now.saturating_add(TRIAL_MEMORY_BYTES)) else {
            // SAFETY: both ends are ours to close.
            unsafe {
                libc::close(read_fd);
                libc::close(write_fd);
            }
            return None;
        };
        // SAFETY: the child runs only `child` (no lock or thread of the parent), then exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            child(write_fd, read_fd, ceiling, source, bos, eos);
        }
        // SAFETY: the parent's copy of the write end is ours to close.
        unsafe { libc::close(write_fd) };
        if pid < 0 {
            // SAFETY: as above.
            unsafe { libc::close(read_fd) };
            tracing::warn!("cannot fork for the chat template's trial render: rendering it here");
            return None;
        }
        let (report, timed_out) = read_report(read_fd, Instant::now() + TRIAL_TIMEOUT);
        // SAFETY: as above.
        unsafe { libc::close(read_fd) };
        if timed_out {
            // SAFETY: `pid` is our child, not yet reaped.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        let mut status = 0;
        // SAFETY: reaps our own child (again when a signal interrupted the wait).
        while unsafe { libc::waitpid(pid, &mut status, 0) } < 0
            && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
        {}
        let budget = TRIAL_MEMORY_BYTES >> 20;
        Some(match report.split_first() {
            _ if timed_out => Err(TextError::ChatTemplateLimit(format!(
                "its trial render did not finish in {} s",
                TRIAL_TIMEOUT.as_secs()
            ))),
            Some((&PASSED, _)) => Ok(()),
            Some((&LIMIT, words)) => Err(TextError::ChatTemplateLimit(
                String::from_utf8_lossy(words).into_owned(),
            )),
            _ if libc::WIFSIGNALED(status) => Err(TextError::ChatTemplateLimit(format!(
                "its trial render took more than its {budget} MiB of memory or crashed \
                 (signal {})",
                libc::WTERMSIG(status)
            ))),
            _ => Err(TextError::ChatTemplateLimit(format!(
                "its trial render ended without a verdict (status {status})"
            ))),
        })
    }

    /// The forked child: the ceiling on its address space, stderr to /dev/null (an
    /// allocation that fails says so there before the abort), the trial, its verdict on the
    /// pipe, `_exit`.
    fn child(
        write_fd: i32,
        read_fd: i32,
        ceiling: u64,
        source: &str,
        bos: Option<&str>,
        eos: Option<&str>,
    ) -> ! {
        // SAFETY: plain system calls on descriptors and limits of this (child) process.
        unsafe {
            libc::close(read_fd);
            // Every other descriptor the parent had goes too: among them may be the write end
            // of another thread's trial pipe, whose reader would otherwise wait for this child
            // to end before it saw its own child's verdict.
            close_all_but(write_fd);
            let null = libc::open(c"/dev/null".as_ptr(), libc::O_WRONLY);
            if null >= 0 {
                libc::dup2(null, 2);
            }
            let limit = libc::rlimit {
                rlim_cur: ceiling,
                rlim_max: ceiling,
            };
            if libc::setrlimit(libc::RLIMIT_DATA, &limit) != 0 {
                libc::_exit(2);
            }
            // A memory bomb ends in an abort: no core file for it (a system that keeps cores
            // would write one per hostile template; qemu-user writes the guest's itself).
            let no_core = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            libc::setrlimit(libc::RLIMIT_CORE, &no_core);
        }
        let verdict = std::panic::catch_unwind(|| match ChatTemplate::new(source, bos, eos) {
            Err(TextError::ChatTemplateLimit(words)) => [&[LIMIT], words.as_bytes()].concat(),
            _ => vec![PASSED],
        });
        if let Ok(verdict) = verdict {
            let mut sent = 0;
            while sent < verdict.len() {
                // SAFETY: writes from a live buffer to our pipe.
                let n = unsafe {
                    libc::write(
                        write_fd,
                        verdict[sent..].as_ptr().cast(),
                        verdict.len() - sent,
                    )
                };
                if n <= 0 {
                    break;
                }
                sent += n as usize;
            }
        }
        // SAFETY: leaves at once, running nothing of the parent's (no atexit, no flushing).
        unsafe { libc::_exit(0) }
    }

    /// Closes every descriptor from 3 up but `keep` (`close_range`, Linux 5.9; where it is
    /// missing the descriptors stay open, as before).
    ///
    /// # Safety
    /// Only in the forked child, which uses none of the descriptors it closes.
    unsafe fn close_all_but(keep: i32) {
        #[cfg(target_os = "linux")]
        {
            let keep = keep.max(3) as libc::c_uint;
            // SAFETY: per the caller; the ranges hold no descriptor the child uses.
            unsafe {
                if keep > 3 {
                    libc::syscall(libc::SYS_close_range, 3 as libc::c_uint, keep - 1, 0);
                }
                libc::syscall(libc::SYS_close_range, keep + 1, libc::c_uint::MAX, 0);
            }
        }
        #[cfg(not(target_os = "linux"))]
        let _ = keep;
    }

    /// Everything the child writes until it closes the pipe, or until `deadline` (then
    /// `true`).
    fn read_report(fd: i32, deadline: Instant) -> (Vec<u8>, bool) {
        let mut report = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return (report, true);
            }
            let mut poll = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = left.as_millis().min(i32::MAX as u128) as i32;
            // SAFETY: one live pollfd.
            let ready = unsafe { libc::poll(&mut poll, 1, ms) };
            if ready < 0 {
                if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return (report, false);
            }
            if ready == 0 {
                continue;
            }
            // SAFETY: reads into a live buffer from our pipe.
            let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
            match n {
                n if n > 0 => report.extend_from_slice(&buf[..n as usize]),
                0 => return (report, false),
                _ if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => {}
                _ => return (report, false),
            }
        }
    }

    /// This process's private writable memory now, in bytes (`VmData`, what `RLIMIT_DATA`
    /// counts).
    pub(super) fn data_size() -> Option<u64> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmData:"))?
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kib << 10)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether a forked child here is held to `RLIMIT_DATA`: a child that may take 64 MiB
    /// more asks for 256 MiB. Linux holds it; qemu-user, which runs CI's aarch64 tests, maps
    /// the guest's memory inside a region it reserved up front and does not.
    #[cfg(unix)]
    fn data_limit_holds() -> bool {
        let Some(now) = unix::data_size() else {
            return false;
        };
        // SAFETY: the child only sets a limit, allocates and exits; the parent reaps it.
        unsafe {
            let pid = libc::fork();
            if pid == 0 {
                let limit = libc::rlimit {
                    rlim_cur: now + TRIAL_MEMORY_BYTES,
                    rlim_max: now + TRIAL_MEMORY_BYTES,
                };
                libc::setrlimit(libc::RLIMIT_DATA, &limit);
                // black_box: the allocation must happen, not be folded away with its test.
                let p = std::hint::black_box(libc::malloc(std::hint::black_box(256 << 20)));
                libc::_exit(if p.is_null() { 0 } else { 1 });
            }
            let mut status = 0;
            pid > 0
                && libc::waitpid(pid, &mut status, 0) == pid
                && libc::WIFEXITED(status)
                && libc::WEXITSTATUS(status) == 0
        }
    }

    /// Templates that build gigabytes in values they never print are refused in the child,
    /// which alone runs out of memory; ordinary ones and their own refusals pass.
    #[test]
    fn memory_bombs_are_refused_and_ordinary_templates_pass() {
        #[cfg(unix)]
        let bombs_refused = data_limit_holds();
        #[cfg(not(unix))]
        let bombs_refused = false;
        if !bombs_refused {
            eprintln!(
                "the memory bombs are not tried: this platform does not hold a child to RLIMIT_DATA"
            );
        }
        for bomb in [
            "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
            "{{ range(100000) | join('x' * 100000) }}",
            "{% set a = 'x' * 100000000 %}{{ a | length }}",
        ]
        .into_iter()
        .filter(|_| bombs_refused)
        {
            let err = trial_render(bomb, None, None).unwrap_err();
            assert!(
                matches!(err, TextError::ChatTemplateLimit(_)),
                "{bomb}: {err}"
            );
            // Natively the child's allocation fails at the cap; under an emulator (the
            // aarch64 tests run in qemu-user) the child may instead outlive the deadline.
            let err = err.to_string();
            assert!(
                err.contains("MiB of memory") || err.contains("did not finish"),
                "{bomb}: {err}"
            );
        }
        let chatml = "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}";
        assert!(trial_render(chatml, None, None).is_ok());
        assert!(trial_render("{{ raise_exception('no') }}", None, None).is_ok());
        assert!(trial_render("{% for %}", None, None).is_ok());
        let loops =
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
        let err = trial_render(loops, None, None).unwrap_err().to_string();
        assert!(
            err.contains("instructions") || err.contains("did not finish"),
            "{err}"
        );
    }
}
