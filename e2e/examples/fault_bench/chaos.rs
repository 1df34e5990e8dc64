//! Chaos between hosts: the link between the prefill and the decode worker (each on its own
//! host, [`crate::chaos_hosts`]) delays with jitter and reorders, loses packets, partitions
//! and goes down, each while clients keep sending greedy requests. Per row: what the clients
//! saw (every request completed or failed with an explicit error, none lost or hung), whether
//! any completed text differs from the aggregated reference (a wrong token), how long after
//! the link healed the router served disaggregated again, and whether any lease or KV block
//! was left on either worker.
//!
//! The rule under test: a stalled transfer ends within the lease timeout, and its request is
//! placed again (aggregated) or fails with an explicit error; never a hang, never a wrong
//! token. Recovery must come within the lease timeout plus 2 s.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tandem_e2e::netem::{Delay, LinkDown, Rules};

use crate::chaos_hosts::{ChaosHosts, LEASE_TIMEOUT};
use crate::client::{Call, Outcome, Rng, RouterClient, Tally, prompt_text};
use crate::report::{parenthesized, secs};

/// Tokens each request asks for (greedy, EOS ignored, so the reference is exact).
const MAX_TOKENS: u32 = 12;
/// A request of a chaos row that takes longer than this counts as hung.
const HUNG_AFTER: Duration = Duration::from_secs(60);
/// What a request caught by a fault may take beyond the lease timeout plus 2 s: its own run,
/// aggregated, on the delayed link.
const STALL_SLACK: Duration = Duration::from_secs(2);
/// Clients sending during a row.
const CLIENTS: usize = 3;
/// The NFQUEUE number of the delay rows.
const QUEUE: u16 = 7;

/// How long each impairment lasts.
#[derive(Debug, Clone, Copy)]
pub struct Durations {
    pub delay: Duration,
    pub loss: Duration,
    pub partition: Duration,
    pub link_down: Duration,
}

impl Durations {
    /// The issue's: 30 s of partition, the others long enough for hundreds of transfers.
    pub const FULL: Self = Self {
        delay: Duration::from_secs(15),
        loss: Duration::from_secs(15),
        partition: Duration::from_secs(30),
        link_down: Duration::from_secs(5),
    };
    /// Every row in seconds (smoke runs).
    pub const QUICK: Self = Self {
        delay: Duration::from_secs(3),
        loss: Duration::from_secs(3),
        partition: Duration::from_secs(5),
        link_down: Duration::from_secs(3),
    };
}

/// One chaos row.
pub struct ChaosRow {
    pub fault: String,
    pub client_saw: String,
    pub wrong: usize,
    pub recovered: String,
    pub left: String,
    pub survived: bool,
    pub tally: Tally,
    pub recovery: Option<Duration>,
    pub longest: Duration,
}

/// The greedy texts of the prompts, from the aggregated router.
struct Reference {
    prompts: Vec<String>,
    texts: Vec<String>,
}

impl Reference {
    async fn take(hosts: &ChaosHosts) -> anyhow::Result<Self> {
        let mut rng = Rng(4242);
        let prompts: Vec<String> = (0..6).map(|i| prompt_text(&mut rng, 12 + 9 * i)).collect();
        let mut texts = Vec::new();
        for p in &prompts {
            match hosts
                .aggregated
                .run(&Call::completion(p, MAX_TOKENS, false), HUNG_AFTER)
                .await
            {
                Outcome::Ok { text, .. } => texts.push(text),
                other => anyhow::bail!("the aggregated reference failed: {other:?}"),
            }
        }
        Ok(Self { prompts, texts })
    }
}

/// What the clients of a row saw: each outcome, with whether its text was the reference's.
struct Seen {
    outcomes: Vec<Outcome>,
    wrong: usize,
    first_wrong: Option<String>,
    /// The longest any request took.
    longest: Duration,
}

/// Clients looping over the reference prompts, streaming and not, until stopped.
struct Load {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<Vec<(usize, Duration, Outcome)>>>,
}

impl Load {
    fn start(router: &RouterClient, prompts: &[String]) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..CLIENTS)
            .map(|c| {
                let (router, stop, prompts) = (router.clone(), stop.clone(), prompts.to_vec());
                tokio::spawn(async move {
                    let mut out = Vec::new();
                    // Bounded in count as well as by the stop flag.
                    for i in 0..5_000 {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        let which = (c + i) % prompts.len();
                        let call = Call::completion(&prompts[which], MAX_TOKENS, i % 2 == 1);
                        let started = Instant::now();
                        let outcome = router.run(&call, HUNG_AFTER).await;
                        if started.elapsed() > LEASE_TIMEOUT + Duration::from_secs(2) + STALL_SLACK
                        {
                            progress!(
                                "chaos: a request took {} ({outcome:?}); stream {}",
                                secs(started.elapsed()),
                                i % 2 == 1
                            );
                        }
                        out.push((which, started.elapsed(), outcome));
                    }
                    out
                })
            })
            .collect();
        Self { stop, tasks }
    }

    async fn finish(self, reference: &Reference) -> anyhow::Result<Seen> {
        self.stop.store(true, Ordering::Relaxed);
        let mut seen = Seen {
            outcomes: Vec::new(),
            wrong: 0,
            first_wrong: None,
            longest: Duration::ZERO,
        };
        for t in self.tasks {
            for (which, took, outcome) in t.await? {
                seen.longest = seen.longest.max(took);
                if let Outcome::Ok { text, .. } = &outcome
                    && *text != reference.texts[which]
                {
                    seen.wrong += 1;
                    seen.first_wrong.get_or_insert_with(|| {
                        format!("{text:?} for {:?}", reference.texts[which])
                    });
                }
                seen.outcomes.push(outcome);
            }
        }
        Ok(seen)
    }
}

/// The impairments, in the order of the table.
#[derive(Debug, Clone, Copy)]
enum Impairment {
    Delay,
    Loss,
    Partition,
    LinkDown,
}

/// Whatever is applied to the link; dropping it heals the link (the link up first, then
/// the rules and the delay go).
#[derive(Default)]
struct Applied {
    _down: Option<LinkDown>,
    _rules: Option<Rules>,
    /// Kept apart from the guards: its counters go in the row.
    delay: Option<Delay>,
}

impl Impairment {
    fn describe(self, hold: Duration) -> String {
        let hold = secs(hold);
        match self {
            Impairment::Delay => {
                format!("prefill → decode delayed 100 ms ± 20 ms per packet (reorders), {hold}")
            }
            Impairment::Loss => format!("5 % of packets lost both ways, {hold}"),
            Impairment::Partition => format!(
                "partition between prefill and decode for {hold}, mid-transfer (transfers slowed by the 100 ms delay)"
            ),
            Impairment::LinkDown => format!(
                "prefill host's link down for {hold} mid-transfer (transfers slowed by the 100 ms delay)"
            ),
        }
    }

    async fn apply(self, hosts: &ChaosHosts) -> anyhow::Result<Applied> {
        let (prefill, decode) = (hosts.host("prefill")?, hosts.host("decode")?.addr);
        let delay = || {
            Delay::start(
                prefill,
                decode,
                QUEUE,
                Duration::from_millis(100),
                Duration::from_millis(20),
            )
        };
        let mut applied = Applied::default();
        match self {
            Impairment::Delay => applied.delay = Some(delay()?),
            Impairment::Loss => applied._rules = Some(Rules::loss(prefill, decode, 0.05)?),
            Impairment::Partition => {
                applied.delay = Some(delay()?);
                // Transfers start under the delay, so the partition cuts some mid-layer.
                tokio::time::sleep(Duration::from_millis(700)).await;
                applied._rules = Some(Rules::partition(prefill, decode)?);
            }
            Impairment::LinkDown => {
                applied.delay = Some(delay()?);
                tokio::time::sleep(Duration::from_millis(700)).await;
                applied._down = Some(LinkDown::new(prefill)?);
            }
        }
        Ok(applied)
    }
}

impl Applied {
    fn packets(&self) -> String {
        self.delay.as_ref().map_or_else(String::new, |d| {
            let s = d.stats();
            format!(
                " ({} packets delayed, {} reordered)",
                s.delayed, s.reordered
            )
        })
    }
}

/// Every chaos row, each on a deployment that has drained the last one's work.
pub async fn run(hosts: &ChaosHosts, durations: Durations) -> anyhow::Result<Vec<ChaosRow>> {
    let reference = Reference::take(hosts).await?;
    let mut rows = Vec::new();
    for (impairment, hold) in [
        (Impairment::Delay, durations.delay),
        (Impairment::Loss, durations.loss),
        (Impairment::Partition, durations.partition),
        (Impairment::LinkDown, durations.link_down),
    ] {
        progress!("chaos: {}", impairment.describe(hold));
        rows.push(row(hosts, &reference, impairment, hold).await?);
    }
    Ok(rows)
}

async fn row(
    hosts: &ChaosHosts,
    reference: &Reference,
    impairment: Impairment,
    hold: Duration,
) -> anyhow::Result<ChaosRow> {
    let load = Load::start(&hosts.router, &reference.prompts);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let applied = impairment.apply(hosts).await?;
    tokio::time::sleep(hold).await;
    let packets = applied.packets();
    drop(applied);
    let healed = Instant::now();
    let recovery = serving_disaggregated(&hosts.router, &reference.prompts[0], healed).await;
    // A moment of load on the healed link, then the clients stop.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let seen = load.finish(reference).await?;
    let bound = LEASE_TIMEOUT + Duration::from_secs(2);
    let (clean_after, left) = hosts.wait_clean(bound).await;
    let tally = Tally::of(&seen.outcomes);
    let recovered_in_time = recovery.is_some_and(|d| d <= bound);
    // Where the link stops (a partition, a link down), a request caught by it waits out the
    // lease at most, then runs aggregated. A link that is slow but moving (delay, loss) may
    // slow a large transfer down without bound other than the client's: not a stall.
    let stall_bound = bound + STALL_SLACK;
    let stalls = matches!(impairment, Impairment::Partition | Impairment::LinkDown);
    let survived = tally.lost == 0
        && seen.wrong == 0
        && recovered_in_time
        && clean_after.is_some()
        && (!stalls || seen.longest <= stall_bound);
    let wrong = match &seen.first_wrong {
        Some(w) => format!("{} wrong texts (first: {w})", seen.wrong),
        None => "0 wrong texts".into(),
    };
    Ok(ChaosRow {
        fault: format!("{}{packets}", impairment.describe(hold)),
        client_saw: format!(
            "{} requests: {} ok ({} disaggregated), {} errors{}, {} lost or hung{}; {wrong}; longest {}{}",
            tally.total(),
            tally.ok,
            tally.disaggregated,
            tally.errors,
            parenthesized(&tally.statuses()),
            tally.lost,
            parenthesized(&tally.lost_why.join("; ")),
            secs(seen.longest),
            if stalls {
                format!(" (bound {})", secs(stall_bound))
            } else {
                String::new()
            },
        ),
        wrong: seen.wrong,
        recovered: match recovery {
            Some(d) => format!("disaggregated again {} after the link healed", secs(d)),
            None => "NEVER disaggregated again".into(),
        },
        left: match clean_after {
            Some(d) => format!("0 leases or blocks (clean {} after the load)", secs(d)),
            None => format!(
                "{} on prefill, {} on decode, {} after the load",
                left.0,
                left.1,
                secs(bound)
            ),
        },
        survived,
        tally,
        recovery,
        longest: seen.longest,
    })
}

/// From `healed`, one short request at a time until one runs disaggregated (30 s at most):
/// how long after `healed` that request started.
async fn serving_disaggregated(
    router: &RouterClient,
    prompt: &str,
    healed: Instant,
) -> Option<Duration> {
    let call = Call::completion(prompt, 2, false);
    while healed.elapsed() < Duration::from_secs(30) {
        let started = Instant::now();
        if let Outcome::Ok {
            disaggregated: true,
            ..
        } = router.run(&call, HUNG_AFTER).await
        {
            return Some(started.duration_since(healed));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}
