//! Overload: the deployment's capacity measured closed loop, then ten times that offered
//! open loop (requests sent on a schedule, whatever the answers) for a while. Admission must
//! answer what it cannot queue with 429 and `Retry-After`, keep every admitted request's wait
//! within the configured bound (`--max-queue-wait-ms`, read from the router's queue-time
//! histogram), keep memory flat (each process's resident memory outside its KV pools, which
//! are allocated whole at startup and become resident as blocks are first used), answer no
//! 5xx and lose nothing, and serve normally within seconds of the burst's end.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::client::{Call, Outcome, Rng, RouterClient, prompt_text};
use crate::deployment::{Deployment, MAX_QUEUE_WAIT_MS};
use crate::report::secs;

/// Tokens each request asks for.
const MAX_TOKENS: u32 = 16;
/// Clients of the closed-loop capacity measure.
const CAPACITY_CLIENTS: usize = 16;
/// Requests of the burst in flight at most on the client side, one connection each: half the
/// router's `--max-connections` (1024, beyond which it closes connections unanswered), as a
/// load balancer's pool in front of it would keep to. A send beyond is skipped and counted:
/// on a machine the client shares with the deployment, the client is then the limit.
const CLIENT_IN_FLIGHT: usize = 512;
/// A request of the burst that takes longer than this counts as hung.
const HUNG_AFTER: Duration = Duration::from_secs(60);

/// What the overload row measured.
pub struct OverloadReport {
    pub capacity_rps: f64,
    pub offered_rps: f64,
    pub burst: Duration,
    pub sent: usize,
    pub skipped: usize,
    /// Answers by status (0: no answer in time or a broken connection).
    pub statuses: BTreeMap<u16, usize>,
    /// 429s without a `Retry-After` header.
    pub no_retry_after: usize,
    /// The upper bound of the queue-time histogram bucket holding the admitted requests'
    /// 99th percentile.
    pub p99_queue: Option<f64>,
    pub queue_bound: f64,
    pub rss_before: [u64; 3],
    pub rss_after: [u64; 3],
    /// The same outside the KV pools, whose pages become resident as blocks are first used.
    pub heap_before: [u64; 3],
    pub heap_after: [u64; 3],
    /// From the burst's end to a normal request served disaggregated.
    pub serving_after: Option<Duration>,
}

impl OverloadReport {
    pub fn server_errors(&self) -> usize {
        self.statuses.range(500..600).map(|(_, n)| n).sum()
    }

    pub fn lost(&self) -> usize {
        self.statuses.get(&0).copied().unwrap_or(0)
    }

    /// Largest RSS growth outside the KV pools of the three processes, KiB.
    pub fn rss_growth_kib(&self) -> i64 {
        (0..3)
            .map(|i| self.heap_after[i] as i64 - self.heap_before[i] as i64)
            .max()
            .unwrap_or(0)
    }

    pub fn passed(&self) -> bool {
        self.server_errors() == 0
            && self.lost() == 0
            && self.no_retry_after == 0
            && self.p99_queue.is_some_and(|q| q <= self.queue_bound)
            && self.rss_growth_kib() < 50 * 1024
            && self
                .serving_after
                .is_some_and(|d| d < Duration::from_secs(10))
    }

    pub fn json(&self) -> serde_json::Value {
        json!({
            "capacity_rps": self.capacity_rps,
            "offered_rps": self.offered_rps,
            "burst_seconds": self.burst.as_secs_f64(),
            "sent": self.sent,
            "skipped_by_client": self.skipped,
            "ok": self.statuses.get(&200).copied().unwrap_or(0),
            "refused_429": self.statuses.get(&429).copied().unwrap_or(0),
            "server_errors": self.server_errors(),
            "lost": self.lost(),
            "no_retry_after": self.no_retry_after,
            "p99_queue_seconds_bucket": self.p99_queue,
            "queue_bound_seconds": self.queue_bound,
            "max_rss_growth_kib": self.rss_growth_kib(),
            "rss_growth_with_kv_pools_kib": (0..3)
                .map(|i| self.rss_after[i] as i64 - self.rss_before[i] as i64)
                .collect::<Vec<_>>(),
            "serving_after_seconds": self.serving_after.map(|d| d.as_secs_f64()),
        })
    }
}

/// One request of the burst: its status (0 for none), whether a 429 said when to retry.
async fn one(router: &RouterClient, body: serde_json::Value) -> (u16, bool) {
    let send = router
        .http
        .post(router.url("/v1/completions"))
        .json(&body)
        .send();
    let answer = async {
        let r = send.await.map_err(|e| format!("sending: {e:?}"))?;
        let status = r.status().as_u16();
        let retry_after = r.headers().contains_key("retry-after");
        r.bytes()
            .await
            .map_err(|e| format!("reading the body: {e}"))?;
        Ok::<_, String>((status, retry_after))
    };
    match tokio::time::timeout(HUNG_AFTER, answer).await {
        Ok(Ok(a)) => a,
        Ok(Err(why)) => {
            static SHOWN: AtomicUsize = AtomicUsize::new(0);
            if SHOWN.fetch_add(1, Ordering::Relaxed) < 3 {
                progress!("overload: a request failed: {why}");
            }
            (0, false)
        }
        Err(_) => (0, false),
    }
}

fn body(rng: &mut Rng) -> serde_json::Value {
    let words = 20 + rng.below(20) as usize;
    let prompt = prompt_text(rng, words);
    json!({"model": crate::client::SERVED, "prompt": prompt, "max_tokens": MAX_TOKENS,
           "temperature": 0.0, "ignore_eos": true})
}

/// Completed requests per second of `CAPACITY_CLIENTS` closed-loop clients over `span`.
async fn capacity(router: &RouterClient, span: Duration) -> f64 {
    let started = Instant::now();
    let tasks: Vec<_> = (0..CAPACITY_CLIENTS)
        .map(|c| {
            let router = router.clone();
            tokio::spawn(async move {
                let mut rng = Rng(900 + c as u64);
                let mut done = 0usize;
                // Bounded in count as well as time.
                for _ in 0..100_000 {
                    if started.elapsed() >= span {
                        break;
                    }
                    done += usize::from(one(&router, body(&mut rng)).await.0 == 200);
                }
                done
            })
        })
        .collect();
    let mut done = 0;
    for t in tasks {
        done += t.await.unwrap_or(0);
    }
    done as f64 / started.elapsed().as_secs_f64()
}

/// The admitted requests' queue-time histogram: cumulative bucket counts, by upper bound.
async fn queue_buckets(router: &RouterClient) -> Vec<(f64, f64)> {
    let Ok(r) = router.http.get(router.url("/metrics")).send().await else {
        return Vec::new();
    };
    let text = r.text().await.unwrap_or_default();
    text.lines()
        .filter_map(|l| l.strip_prefix("tandem_router_queue_seconds_bucket{"))
        .filter(|l| l.contains("outcome=\"admitted\""))
        .filter_map(|rest| {
            let (_, rest) = rest.split_once("le=\"")?;
            let (le, count) = rest.split_once("\"} ")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, count.trim().parse().ok()?))
        })
        .collect()
}

/// The bucket bound under which 99 % of the waits between two readings fell.
fn p99(before: &[(f64, f64)], after: &[(f64, f64)]) -> Option<f64> {
    let delta: Vec<(f64, f64)> = after
        .iter()
        .map(|&(le, n)| {
            let was = before.iter().find(|b| b.0 == le).map_or(0.0, |b| b.1);
            (le, n - was)
        })
        .collect();
    let total = delta.last()?.1;
    if total <= 0.0 {
        return None;
    }
    delta.iter().find(|(_, n)| *n >= 0.99 * total).map(|b| b.0)
}

pub async fn run(dep: &Deployment, burst: Duration) -> anyhow::Result<OverloadReport> {
    let router = &dep.router;
    let capacity_rps = capacity(router, Duration::from_secs(3)).await.max(1.0);
    dep.wait_idle(Duration::from_secs(10)).await;
    let offered_rps = 10.0 * capacity_rps;
    progress!(
        "overload: capacity {capacity_rps:.1} req/s; offering {offered_rps:.0} req/s for {}",
        secs(burst)
    );
    let (rss_before, heap_before) = (dep.pids().rss(), dep.pids().rss_outside_kv_pools());
    let buckets_before = queue_buckets(router).await;
    let in_flight = Arc::new(AtomicUsize::new(0));
    let interval = Duration::from_secs_f64(1.0 / offered_rps);
    let started = Instant::now();
    let total = (offered_rps * burst.as_secs_f64()).ceil() as usize;
    let (mut tasks, mut skipped, mut rng) = (Vec::with_capacity(total), 0, Rng(31));
    for i in 0..total {
        // Open loop: request i leaves at i × interval, whatever came back.
        tokio::time::sleep_until((started + interval.mul_f64(i as f64)).into()).await;
        if in_flight.load(Ordering::Relaxed) >= CLIENT_IN_FLIGHT {
            skipped += 1;
            continue;
        }
        in_flight.fetch_add(1, Ordering::Relaxed);
        let (router, counter, body) = (router.clone(), in_flight.clone(), body(&mut rng));
        tasks.push(tokio::spawn(async move {
            let answer = one(&router, body).await;
            counter.fetch_sub(1, Ordering::Relaxed);
            answer
        }));
    }
    let burst_took = started.elapsed();
    let ended = Instant::now();
    let serving_after = serving_again(router, ended).await;
    let (mut statuses, mut no_retry_after) = (BTreeMap::new(), 0);
    let sent = tasks.len();
    for t in tasks {
        let (status, retry_after) = t.await.unwrap_or((0, false));
        *statuses.entry(status).or_insert(0) += 1;
        no_retry_after += usize::from(status == 429 && !retry_after);
    }
    dep.wait_idle(Duration::from_secs(30)).await;
    let buckets_after = queue_buckets(router).await;
    Ok(OverloadReport {
        capacity_rps,
        offered_rps: sent as f64 / burst_took.as_secs_f64(),
        burst: burst_took,
        sent,
        skipped,
        statuses,
        no_retry_after,
        p99_queue: p99(&buckets_before, &buckets_after),
        queue_bound: MAX_QUEUE_WAIT_MS as f64 / 1000.0,
        rss_before,
        rss_after: dep.pids().rss(),
        heap_before,
        heap_after: dep.pids().rss_outside_kv_pools(),
        serving_after,
    })
}

/// From `since`, one normal request at a time until one runs disaggregated (60 s at most).
async fn serving_again(router: &RouterClient, since: Instant) -> Option<Duration> {
    let call = Call::completion("the mill by the river", 4, false);
    while since.elapsed() < Duration::from_secs(60) {
        if let Outcome::Ok {
            disaggregated: true,
            ..
        } = router.run(&call, HUNG_AFTER).await
        {
            return Some(since.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}
