//! A small persistent thread team for the forward pass's parallel regions.
//!
//! A decode step runs ~180 short parallel regions (every projection and every layer's
//! attention); handing each to rayon cost ~10 % of a batch-1 step in futex wake-ups. The team's
//! threads spin briefly between regions and park when idle, and the calling thread works too.
//! Tasks are claimed from a shared counter, so uneven tasks (causal attention rows) balance.
//!
//! One caller at a time: a second concurrent caller (two engines in one process, as in tests)
//! runs its tasks inline instead of waiting.
//!
//! The team's size is fixed when it starts; how many of its threads take part can change at
//! any time ([`set_active_threads`]): a worker that shares its host's cores with another
//! gives some back while the other needs them (the router's elastic thread planner). Every
//! partition in the kernels is by output rows or columns, so the result does not depend on it.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long an idle team thread spins before parking: longer than the gaps between the
/// regions of one forward pass, short enough not to burn a core between requests.
const SPIN: Duration = Duration::from_micros(300);

struct Job {
    /// The caller's closure, valid until every task has run (the caller waits for that).
    f: *const (dyn Fn(usize) + Sync),
    tasks: usize,
    /// Threads that take part (the caller included): members of a lower index.
    members: usize,
    next: AtomicUsize,
    done: AtomicUsize,
}

// SAFETY: `f` points to a `Sync` closure that outlives every call made through it (see
// `parallel_for`); the counters are atomics.
unsafe impl Send for Job {}
unsafe impl Sync for Job {}

impl Job {
    /// Claims and runs tasks until none are left.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.tasks {
                return;
            }
            // SAFETY: i < tasks, so the caller is still waiting in `parallel_for` and the
            // closure is alive.
            unsafe { (*self.f)(i) };
            self.done.fetch_add(1, Ordering::Release);
        }
    }
}

struct Team {
    epoch: AtomicU64,
    slot: Mutex<Option<Arc<Job>>>,
    caller: Mutex<()>,
    threads: Vec<(Thread, Arc<AtomicBool>)>,
}

static TEAM: OnceLock<Team> = OnceLock::new();
static SIZE: AtomicUsize = AtomicUsize::new(0);
/// Threads taking part (the caller included); 0: all of them.
static ACTIVE: AtomicUsize = AtomicUsize::new(0);

/// Sets the number of compute threads (the caller included). Takes effect if called before
/// the first parallel region; later calls are ignored.
pub fn set_threads(n: usize) {
    SIZE.store(n.max(1), Ordering::Relaxed);
}

/// Compute threads taking part in parallel regions now (the caller included).
pub fn threads() -> usize {
    active(team())
}

/// Compute threads the team has (the caller included): the most [`set_active_threads`] can
/// give.
pub fn max_threads() -> usize {
    team().threads.len() + 1
}

/// Lets `n` of the team's threads (the caller included; at least 1, at most
/// [`max_threads`]) take part in the regions that start from now on; the others park.
/// Returns the number in effect.
pub fn set_active_threads(n: usize) -> usize {
    let n = n.clamp(1, max_threads());
    ACTIVE.store(n, Ordering::Relaxed);
    n
}

/// The share of the team taking part now, 1 when all do or before the team has started
/// (which this does not start: a GPU engine never does).
pub fn active_share() -> f64 {
    TEAM.get()
        .map_or(1.0, |t| active(t) as f64 / (t.threads.len() + 1) as f64)
}

fn active(team: &Team) -> usize {
    match ACTIVE.load(Ordering::Relaxed) {
        0 => team.threads.len() + 1,
        n => n.min(team.threads.len() + 1),
    }
}

fn team() -> &'static Team {
    TEAM.get_or_init(|| {
        let n = match SIZE.load(Ordering::Relaxed) {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let mut threads = Vec::new();
        for i in 1..n {
            let parked = Arc::new(AtomicBool::new(false));
            let flag = parked.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("tandem-compute-{i}"))
                .spawn(move || member(i, flag));
            match spawned {
                Ok(h) => threads.push((h.thread().clone(), parked)),
                Err(e) => tracing::warn!(error = %e, "could not start a compute thread"),
            }
        }
        Team {
            epoch: AtomicU64::new(0),
            slot: Mutex::new(None),
            caller: Mutex::new(()),
            threads,
        }
    })
}

/// Team thread `index` (1-based: the caller is 0) takes jobs while it is among the active.
fn member(index: usize, parked: Arc<AtomicBool>) {
    // The team is initialised before its threads can observe it.
    let team = loop {
        if let Some(t) = TEAM.get() {
            break t;
        }
        std::thread::yield_now();
    };
    let mut seen = 0u64;
    let mut idle_since = Instant::now();
    let mut spins = 0u32;
    loop {
        let epoch = team.epoch.load(Ordering::Acquire);
        if epoch != seen {
            seen = epoch;
            let job = team.slot.lock().unwrap_or_else(|p| p.into_inner()).clone();
            // An inactive member leaves the job to the others; it parks as usual.
            if let Some(job) = job.filter(|j| index < j.members) {
                job.work();
            }
            idle_since = Instant::now();
            continue;
        }
        // Reading the clock costs more than a spin: look at it every 256 spins.
        spins = spins.wrapping_add(1);
        if !spins.is_multiple_of(256) || idle_since.elapsed() < SPIN {
            std::hint::spin_loop();
            continue;
        }
        parked.store(true, Ordering::SeqCst);
        // Re-check after announcing: a job published in between is not missed.
        if team.epoch.load(Ordering::SeqCst) == seen {
            std::thread::park_timeout(Duration::from_millis(50));
        }
        parked.store(false, Ordering::SeqCst);
        idle_since = Instant::now();
    }
}

/// Runs `f(0..tasks)` on the team and the calling thread; returns when all have run.
pub fn parallel_for(tasks: usize, f: &(dyn Fn(usize) + Sync)) {
    let team = team();
    let members = active(team);
    if tasks <= 1 || members <= 1 {
        (0..tasks).for_each(f);
        return;
    }
    let Ok(_guard) = team.caller.try_lock() else {
        (0..tasks).for_each(f);
        return;
    };
    // SAFETY (lifetime erasure): the job may outlive this call inside a team thread's Arc,
    // but the closure is only called for claimed task indices, and we return only after
    // every index has been claimed and run.
    let f_static: *const (dyn Fn(usize) + Sync + 'static) =
        unsafe { std::mem::transmute(f as *const (dyn Fn(usize) + Sync)) };
    let job = Arc::new(Job {
        f: f_static,
        tasks,
        members,
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
    });
    *team.slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(job.clone());
    team.epoch.fetch_add(1, Ordering::SeqCst);
    for (thread, parked) in team.threads.iter().take(members - 1) {
        if parked.load(Ordering::SeqCst) {
            thread.unpark();
        }
    }
    job.work();
    while job.done.load(Ordering::Acquire) < tasks {
        std::hint::spin_loop();
    }
    *team.slot.lock().unwrap_or_else(|p| p.into_inner()) = None;
}

/// Rows per task of the per-row operations; fewer than twice this run on the caller alone
/// (starting a region costs more than a few short rows, as in every decode step).
const MIN_ROWS_PER_TASK: usize = 16;

/// Runs `f(rows)` over disjoint ranges covering `0..rows` on the team, for per-row work a
/// row computes the same way whichever thread runs it; fewer than twice
/// [`MIN_ROWS_PER_TASK`] rows run on the caller alone.
pub fn parallel_row_ranges(rows: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
    if rows < 2 * MIN_ROWS_PER_TASK {
        f(0..rows);
        return;
    }
    let tasks = (rows / MIN_ROWS_PER_TASK).min(threads() * 4);
    let per_task = rows.div_ceil(tasks);
    parallel_for(rows.div_ceil(per_task), &|t| {
        f(t * per_task..((t + 1) * per_task).min(rows))
    });
}

/// Runs `f(first_row, rows)` over disjoint runs of `out`'s rows (`width` floats each) on the
/// team: for per-row operations (norms, RoPE, SwiGLU, residual adds) of a prefill chunk,
/// which a row computes the same way whichever thread runs it.
pub fn parallel_rows(out: &mut [f32], width: usize, f: &(dyn Fn(usize, &mut [f32]) + Sync)) {
    let rows = out.len() / width.max(1);
    if rows < 2 * MIN_ROWS_PER_TASK || width == 0 {
        f(0, out);
        return;
    }
    let base = super::SharedMut(out.as_mut_ptr());
    parallel_row_ranges(rows, &|r| {
        let base = &base;
        // SAFETY: ranges are disjoint rows of `out`, which outlives the region.
        let chunk =
            unsafe { std::slice::from_raw_parts_mut(base.0.add(r.start * width), r.len() * width) };
        f(r.start, chunk);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_every_task_once() {
        for tasks in [0, 1, 2, 7, 1000] {
            let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            parallel_for(tasks, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn parallel_rows_covers_each_row_once() {
        for rows in [0, 1, 31, 32, 33, 200, 513] {
            let mut out = vec![0f32; rows * 3];
            parallel_rows(&mut out, 3, &|r0, chunk| {
                for (i, row) in chunk.chunks_exact_mut(3).enumerate() {
                    row.iter_mut().for_each(|v| *v += (r0 + i) as f32);
                }
            });
            let want: Vec<f32> = (0..rows).flat_map(|r| [r as f32; 3]).collect();
            assert_eq!(out, want, "{rows} rows");
        }
    }

    #[test]
    fn row_ranges_cover_each_row_once() {
        for rows in [0, 1, 31, 32, 33, 200, 513] {
            let hits: Vec<AtomicUsize> = (0..rows).map(|_| AtomicUsize::new(0)).collect();
            parallel_row_ranges(rows, &|r| {
                for i in r {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                }
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "{rows} rows"
            );
        }
    }

    #[test]
    fn only_active_threads_take_part() {
        set_threads(3);
        let all = max_threads();
        let run = || {
            let seen = Mutex::new(std::collections::HashSet::new());
            for _ in 0..50 {
                parallel_for(64, &|_| {
                    seen.lock().unwrap().insert(std::thread::current().id());
                    std::thread::sleep(Duration::from_micros(20));
                });
            }
            seen.into_inner().unwrap().len()
        };
        assert_eq!(set_active_threads(1), 1);
        assert_eq!(threads(), 1);
        assert_eq!(run(), 1, "one active thread: the caller alone");
        assert_eq!(set_active_threads(0), 1, "at least one");
        assert_eq!(set_active_threads(all + 5), all, "at most the team");
        assert!(run() <= all);
        set_active_threads(all);
    }

    #[test]
    fn concurrent_callers_both_finish() {
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..200 {
                        parallel_for(16, &|_| {
                            total.fetch_add(1, Ordering::Relaxed);
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 4 * 200 * 16);
    }
}
