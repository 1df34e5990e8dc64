//! The soak: a seeded mix of requests on every route (streaming and not, greedy and
//! sampled, ~5 % cancelled by their client) at a fixed concurrency. Every request must end
//! complete or with an explicit error, KV blocks must return to zero once idle, no process
//! may restart, and each process's resident memory is measured across it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;

use crate::client::{Call, Outcome, REQUEST_TIMEOUT, Rng, Route, RouterClient, Tally, prompt_text};
use crate::deployment::Deployment;

pub struct SoakReport {
    pub tally: Tally,
    pub took: Duration,
    /// KV blocks still in use (prefill, decode) when idle again, or after 60 s.
    pub leaked: (u32, u32),
    pub idle_after: Option<Duration>,
    /// What the workers were doing when not yet idle 10 s after the last request.
    pub busy_at_10s: Option<String>,
    /// RSS in KiB of (router, prefill, decode).
    pub rss_before: [u64; 3],
    pub rss_after: [u64; 3],
    pub restarted_during: bool,
}

impl SoakReport {
    pub fn passed(&self) -> bool {
        let t = &self.tally;
        t.lost == 0 && t.errors == 0 && self.leaked == (0, 0) && !self.restarted_during
    }

    /// RSS growth in KiB of (router, prefill, decode).
    pub fn rss_growth(&self) -> [i64; 3] {
        [0, 1, 2].map(|i| self.rss_after[i] as i64 - self.rss_before[i] as i64)
    }
}

fn soak_calls(n: usize) -> Vec<Call> {
    let mut rng = Rng(2026);
    (0..n)
        .map(|i| {
            let route = match rng.below(4) {
                0 => Route::Completions,
                1 => Route::Chat,
                2 => Route::Generate,
                _ => Route::GenerateStream,
            };
            let stream = match route {
                Route::Completions | Route::Chat => rng.below(2) == 0,
                Route::Generate => false,
                Route::GenerateStream => true,
            };
            let words = 4 + rng.below(120) as usize;
            let cancel = rng.below(100) < 5;
            Call {
                route,
                stream,
                prompt: prompt_text(&mut rng, words),
                max_tokens: 4 + rng.below(60) as u32,
                ignore_eos: rng.below(2) == 0,
                sample: rng.below(3) == 0,
                cancel_after: cancel.then(|| Duration::from_millis(5 + rng.below(40))),
                request_id: format!("soak-{i}"),
            }
        })
        .collect()
}

/// Runs `calls`, `concurrency` at a time; every 50th finished request is reported when
/// `report_every_50`.
async fn run_calls(
    router: &RouterClient,
    calls: Vec<Call>,
    concurrency: usize,
    report_every_50: bool,
) -> Vec<Outcome> {
    let n = calls.len();
    let done = Arc::new(AtomicUsize::new(0));
    futures::stream::iter(calls)
        .map(|c| {
            let (router, done) = (router.clone(), done.clone());
            async move {
                let o = router.run(&c, REQUEST_TIMEOUT).await;
                let k = done.fetch_add(1, Ordering::Relaxed) + 1;
                if report_every_50 && k % 50 == 0 {
                    progress!("soak: {k}/{n}");
                }
                o
            }
        })
        .buffer_unordered(concurrency)
        .collect()
        .await
}

pub async fn run(dep: &Deployment, n: usize, concurrency: usize) -> anyhow::Result<SoakReport> {
    // Warm up first, so the memory baseline is a warm process's, not a cold one's.
    run_calls(&dep.router, soak_calls(16), concurrency, false).await;
    let _ = dep.wait_idle(Duration::from_secs(5)).await;
    let pids_before = dep.pids();
    let rss_before = pids_before.rss();
    let started = Instant::now();
    let outcomes = run_calls(&dep.router, soak_calls(n), concurrency, true).await;
    let took = started.elapsed();
    // A worker still working off abandoned requests is not idle yet, which is not a leak:
    // what it is doing after 10 s is noted, and only what is left after 60 s counts.
    let settled = dep
        .settle(Duration::from_secs(10), Duration::from_secs(50))
        .await;
    let pids_after = dep.pids();
    Ok(SoakReport {
        tally: Tally::of(&outcomes),
        took,
        leaked: settled.used,
        idle_after: settled.idle_after,
        busy_at_10s: settled.busy,
        rss_before,
        rss_after: pids_after.rss(),
        restarted_during: pids_before != pids_after,
    })
}
