//! Faults under load: kill -9 of each worker and of the router, SIGSTOP of the prefill
//! worker, and clients that disconnect mid-stream. Each is one row: what the clients saw (every request must
//! end completed or with an explicit error, none lost) and how long recovery took.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::client::{Call, Outcome, Rng, Route, RouterClient, Tally, prompt_text};
use crate::deployment::{Deployment, MAX_LEASE_TTL_MS, Pids, signal};
use crate::report::{parenthesized, secs};

/// Longest a worker restart (backoff, model load, the router's next health poll) may take.
const RECOVERY_TIMEOUT: Duration = Duration::from_secs(90);
/// Longest a request of the fault rows may take before it counts as hung.
const FAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// One fault row.
pub struct Fault {
    pub fault: String,
    pub client_saw: String,
    pub recovered: String,
    pub survived: bool,
}

/// Every fault, in the order of the table, each after the last one's work drained.
pub async fn run(dep: &mut Deployment, context: u32) -> anyhow::Result<Vec<Fault>> {
    let mut faults = vec![kill_prefill(dep).await?];
    dep.wait_idle(Duration::from_secs(5)).await;
    faults.push(kill_decode(dep, context).await?);
    dep.wait_idle(Duration::from_secs(5)).await;
    faults.push(stop_prefill(dep).await?);
    dep.wait_idle(Duration::from_secs(5)).await;
    faults.push(disconnects(dep, context).await?);
    dep.wait_idle(Duration::from_secs(5)).await;
    faults.push(kill_router(dep, context).await?);
    dep.check_launcher()?;
    Ok(faults)
}

fn secs_or_never(d: Option<Duration>) -> String {
    d.map_or("NEVER".into(), secs)
}

/// `2 errors (2×502), 0 lost`, with why the first few were lost.
fn errors_and_lost(t: &Tally) -> String {
    format!(
        "{} errors{}, {} lost{}",
        t.errors,
        parenthesized(&t.statuses()),
        t.lost,
        parenthesized(&t.lost_why.join("; "))
    )
}

/// A short greedy completion of a random prompt, as the load and the SIGSTOP row send.
fn short_call(rng: &mut Rng, words: usize) -> Call {
    Call::completion(&prompt_text(rng, words), 8, false)
}

/// Background clients sending short non-streaming completions until stopped; each
/// outcome with when its request started.
struct Load {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<Vec<(Instant, Outcome)>>>,
}

impl Load {
    fn start(router: &RouterClient, clients: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..clients)
            .map(|c| {
                let (router, stop) = (router.clone(), stop.clone());
                tokio::spawn(async move {
                    let mut rng = Rng(100 + c as u64);
                    let mut out = Vec::new();
                    // Bounded: at most this many requests per client, whatever happens.
                    for _ in 0..2_000 {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        let words = 20 + rng.below(40) as usize;
                        let call = short_call(&mut rng, words);
                        let started = Instant::now();
                        out.push((started, router.run(&call, FAULT_REQUEST_TIMEOUT).await));
                    }
                    out
                })
            })
            .collect();
        Self { stop, tasks }
    }

    async fn finish(self) -> anyhow::Result<Vec<(Instant, Outcome)>> {
        self.stop.store(true, Ordering::Relaxed);
        let mut all = Vec::new();
        for t in self.tasks {
            all.extend(t.await?);
        }
        Ok(all)
    }
}

/// Polls with one short completion every 100 ms from `since` until one succeeds
/// disaggregated; when that request started, relative to `since`.
async fn wait_serving(dep: &Deployment, since: Instant) -> Option<Duration> {
    let call = Call::completion(
        "the river carried seven paper boats past the mill",
        4,
        false,
    );
    while since.elapsed() < RECOVERY_TIMEOUT {
        let started = Instant::now();
        let outcome = dep.router.run(&call, Duration::from_secs(20)).await;
        if let Outcome::Ok {
            disaggregated: true,
            ..
        } = outcome
        {
            return Some(started.duration_since(since));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// How a killed worker came back, both from the kill: the launcher ran a replacement, and
/// the router served disaggregated again.
struct Recovery {
    restarted: Result<Duration, String>,
    serving: Option<Duration>,
}

impl Recovery {
    async fn after_kill(
        dep: &mut Deployment,
        role: fn(&Pids) -> Option<u32>,
        old: u32,
        killed: Instant,
    ) -> Self {
        let restarted = dep.wait_new_pid(role, old, RECOVERY_TIMEOUT).await;
        Self {
            restarted: restarted
                .map(|_| killed.elapsed())
                .map_err(|e| e.to_string()),
            serving: wait_serving(dep, killed).await,
        }
    }

    fn ok(&self) -> bool {
        self.restarted.is_ok() && self.serving.is_some()
    }

    fn describe(&self, serving_again: &str) -> String {
        let restarted = match &self.restarted {
            Ok(d) => secs(*d),
            Err(e) => format!("NEVER ({e})"),
        };
        format!(
            "restarted after {restarted}; {serving_again} after {}",
            secs_or_never(self.serving)
        )
    }
}

async fn kill_prefill(dep: &mut Deployment) -> anyhow::Result<Fault> {
    let old = dep.pids().prefill.context("no prefill worker")?;
    let load = Load::start(&dep.router, 3);
    tokio::time::sleep(Duration::from_secs(1)).await;
    signal(old, "KILL")?;
    let killed = Instant::now();
    progress!("killed the prefill worker (pid {old})");
    let recovery = Recovery::after_kill(dep, |p| p.prefill, old, killed).await;
    // A little more load after the recovery, so "disaggregated again" is seen under load.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let outcomes = load.finish().await?;
    // From two seconds before the kill: the requests in flight when it came.
    let after = Tally::of(
        outcomes
            .iter()
            .filter(|(started, _)| *started + Duration::from_secs(2) >= killed)
            .map(|(_, o)| o),
    );
    Ok(Fault {
        fault: "kill -9 of the prefill worker under load (3 clients)".into(),
        client_saw: format!(
            "{} requests from the kill on: {} ok ({} disaggregated, the rest aggregated fallback), {}",
            after.total(),
            after.ok,
            after.disaggregated,
            errors_and_lost(&after)
        ),
        recovered: recovery.describe("disaggregated again"),
        survived: recovery.ok() && after.errors == 0 && after.lost == 0,
    })
}

/// `n` long streams alternating between `routes`, each asking `max_tokens`.
fn streams(n: usize, routes: [Route; 2], prompt: &str, max_tokens: u32) -> Vec<Call> {
    (0..n)
        .map(|i| Call {
            route: routes[i % 2],
            ..Call::completion(prompt, max_tokens, true)
        })
        .collect()
}

async fn kill_decode(dep: &mut Deployment, context: u32) -> anyhow::Result<Fault> {
    let old = dep.pids().decode.context("no decode worker")?;
    let old_pool = std::path::PathBuf::from(dep.decode_info().await?.shm_path);
    // Long streams, so they are all mid-flight at the kill.
    let routes = [Route::Completions, Route::GenerateStream];
    let calls = streams(6, routes, "Once upon a time", (context / 2).min(20_000));
    let mut running = Vec::new();
    let mut firsts = Vec::new();
    for call in calls {
        let (tx, rx) = tokio::sync::oneshot::channel();
        firsts.push(rx);
        let router = dep.router.clone();
        running.push(tokio::spawn(async move {
            let o = router
                .run_telling(&call, FAULT_REQUEST_TIMEOUT, Some(tx))
                .await;
            (o, Instant::now())
        }));
    }
    let mut streaming = 0;
    for rx in firsts {
        let first = tokio::time::timeout(Duration::from_secs(30), rx).await;
        streaming += usize::from(first.is_ok_and(|r| r.is_ok()));
    }
    signal(old, "KILL")?;
    let killed = Instant::now();
    progress!("killed the decode worker (pid {old}) under {streaming} streams");
    let mut ended = Tally::default();
    let (mut last_end, mut hung) = (Duration::ZERO, 0);
    for s in running {
        let (o, at) = s.await?;
        hung += usize::from(matches!(&o, Outcome::Lost(why) if why.contains("hung")));
        last_end = last_end.max(at.saturating_duration_since(killed));
        ended.add(&o);
    }
    let recovery = Recovery::after_kill(dep, |p| p.decode, old, killed).await;
    let swept = !old_pool.exists() && !tandem_kv::shm::tags_path(&old_pool).exists();
    let in_stream_errors = ended.stream_errors;
    Ok(Fault {
        fault: format!("kill -9 of the decode worker under {streaming} streams (3 OpenAI, 3 TGI)"),
        client_saw: format!(
            "{in_stream_errors}/6 streams ended with an explicit error event (the last {} after the kill), {} completed, {} lost ({hung} hung); the dead worker's shm files swept at restart: {}",
            secs(last_end),
            ended.ok,
            ended.lost,
            if swept { "yes" } else { "NO" }
        ),
        recovered: recovery.describe("serving (disaggregated) again"),
        survived: streaming == 6
            && in_stream_errors == 6
            && ended.lost == 0
            && recovery.ok()
            && swept,
    })
}

async fn stop_prefill(dep: &mut Deployment) -> anyhow::Result<Fault> {
    let pid = dep.pids().prefill.context("no prefill worker")?;
    let mut rng = Rng(7);
    let spawn = |rng: &mut Rng| {
        let (router, call) = (dep.router.clone(), short_call(rng, 30));
        tokio::spawn(async move {
            let started = Instant::now();
            let o = router.run(&call, FAULT_REQUEST_TIMEOUT).await;
            (o, started.elapsed())
        })
    };
    // In flight at the stop, and arriving during it.
    let mut calls: Vec<_> = (0..3).map(|_| spawn(&mut rng)).collect();
    signal(pid, "STOP")?;
    let stopped = Instant::now();
    progress!("stopped the prefill worker (pid {pid}) for 3 s");
    for _ in 0..9 {
        calls.push(spawn(&mut rng));
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    tokio::time::sleep(Duration::from_secs(3).saturating_sub(stopped.elapsed())).await;
    signal(pid, "CONT")?;
    let resumed = Instant::now();
    let mut tally = Tally::default();
    let mut slowest = Duration::ZERO;
    for c in calls {
        let (o, took) = c.await?;
        slowest = slowest.max(took);
        tally.add(&o);
    }
    let recovered = wait_serving(dep, resumed).await;
    let same = dep.pids().prefill == Some(pid);
    Ok(Fault {
        fault: "SIGSTOP of the prefill worker for 3 s, then SIGCONT (12 requests around it)".into(),
        client_saw: format!(
            "{}/12 completed ({} disaggregated), slowest {}; {}; same process: {}",
            tally.ok,
            tally.disaggregated,
            secs(slowest),
            errors_and_lost(&tally),
            if same { "yes" } else { "no (restarted)" }
        ),
        recovered: format!(
            "disaggregated again {} after SIGCONT",
            secs_or_never(recovered)
        ),
        survived: tally.ok == 12 && recovered.is_some(),
    })
}

async fn disconnects(dep: &Deployment, context: u32) -> anyhow::Result<Fault> {
    let routes = [Route::Chat, Route::GenerateStream];
    let prompt = "It was a dark and stormy night";
    let calls = streams(20, routes, prompt, (context / 2).min(2_000));
    let running: Vec<_> = calls
        .into_iter()
        .map(|call| {
            let call = Call {
                cancel_after: Some(Duration::ZERO),
                ..call
            };
            let router = dep.router.clone();
            tokio::spawn(async move { router.run(&call, FAULT_REQUEST_TIMEOUT).await })
        })
        .collect();
    let mut tally = Tally::default();
    for s in running {
        tally.add(&s.await?);
    }
    // Slower than the 2 s asked for: how much slower, and what the workers are doing.
    let settled = dep
        .settle(Duration::from_secs(2), Duration::from_secs(28))
        .await;
    Ok(Fault {
        fault: "20 clients disconnect mid-stream (after their first event)".into(),
        client_saw: format!(
            "{}/20 dropped mid-stream ({} finished first, {} errors, {} lost)",
            tally.cancelled, tally.ok, tally.errors, tally.lost
        ),
        recovered: match settled.promptly {
            Some(d) => format!(
                "KV blocks back to 0 on both workers {} after the last disconnect",
                secs(d)
            ),
            None => format!(
                "blocks (prefill, decode) {:?} still in use after 2 s ({}); idle {}",
                settled.used_then,
                settled.busy.unwrap_or_default(),
                settled
                    .idle_after
                    .map_or("not within 30 s".into(), |d| format!("after {}", secs(d)))
            ),
        },
        survived: tally.cancelled == 20 && settled.promptly.is_some(),
    })
}

/// kill -9 of the router under short requests and long streams: its clients' connections
/// break at once (no request may hang), the launcher starts a new router, and the workers
/// free every lease and block the dead router's requests held, within the lease timeout
/// plus 2 s (its Generate streams close with its sockets).
async fn kill_router(dep: &mut Deployment, context: u32) -> anyhow::Result<Fault> {
    let old = dep.pids().router.context("no router")?;
    let load = Load::start(&dep.router, 3);
    let routes = [Route::Completions, Route::GenerateStream];
    let long = streams(2, routes, "Once upon a time", (context / 2).min(20_000));
    let running: Vec<_> = long
        .into_iter()
        .map(|call| {
            let router = dep.router.clone();
            tokio::spawn(async move { router.run(&call, FAULT_REQUEST_TIMEOUT).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    signal(old, "KILL")?;
    let killed = Instant::now();
    progress!("killed the router (pid {old}) under load");
    let restarted = dep
        .wait_new_pid(|p| p.router, old, RECOVERY_TIMEOUT)
        .await
        .map(|_| killed.elapsed());
    let bound = Duration::from_millis(MAX_LEASE_TTL_MS) + Duration::from_secs(2);
    // Leases and blocks are freed by the workers alone: the new router holds nothing yet.
    let (idle, left) = dep.wait_idle(bound.saturating_sub(killed.elapsed())).await;
    let idle_after = idle.map(|_| killed.elapsed());
    let serving = wait_serving(dep, killed).await;
    let mut outcomes: Vec<Outcome> = load.finish().await?.into_iter().map(|(_, o)| o).collect();
    for r in running {
        outcomes.push(r.await?);
    }
    let hung = outcomes
        .iter()
        .filter(
            |o| matches!(o, Outcome::Lost(why) if why.contains("hung") || why.contains("in time")),
        )
        .count();
    let tally = Tally::of(&outcomes);
    Ok(Fault {
        fault: "kill -9 of the router under load (3 clients, 2 long streams)".into(),
        client_saw: format!(
            "{} requests: {} ok, {} errors, {} cut when the router died (connection closed), {hung} hung",
            tally.total(),
            tally.ok,
            tally.errors,
            tally.lost.saturating_sub(hung),
        ),
        recovered: format!(
            "restarted after {}; leases and blocks on both workers {}; serving again after {}",
            restarted
                .as_ref()
                .map_or_else(|e| format!("NEVER ({e})"), |d| secs(*d)),
            match idle_after {
                Some(d) => format!("0 within {} of the kill", secs(d)),
                None => format!(
                    "NOT freed ({} on prefill, {} on decode after {})",
                    left.0,
                    left.1,
                    secs(bound)
                ),
            },
            secs_or_never(serving)
        ),
        survived: hung == 0 && restarted.is_ok() && idle_after.is_some() && serving.is_some(),
    })
}
