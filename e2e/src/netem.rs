//! A link that misbehaves, between two hosts of a [`Network`](crate::netns::Network): what
//! `tc netem` does — delay with jitter (which reorders packets), random loss — and what a
//! cable does when pulled — a partition, a link down — for the chaos rows of the fault bench.
//!
//! Delay and jitter are done in user space through the kernel's NFQUEUE: an iptables rule in
//! one host hands every packet it sends to the other host to a queue, and a thread inside
//! that host's namespace gives each one its verdict (accept) only when its delay, drawn per
//! packet, has passed, so packets whose draws differ by more than their spacing overtake each
//! other. Why not netem itself: kernels built without `sch_netem` (this build machine's
//! among them) still have netfilter, and the rows must run wherever the harness does. Loss
//! and partitions are plain iptables rules (the `statistic` match, DROP); a link down is
//! `ip link set down` on the host's interface.
//!
//! Every rule is deleted on drop, held packets are released, and the thread is joined:
//! nothing outlives the value (and the namespace itself goes with the `Network`).

use std::collections::{BinaryHeap, HashMap};
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::netns::Host;

/// Packets held at most at once; beyond it the kernel lets packets through undelayed
/// (fail-open), which the counters report.
const QUEUE_MAX_LEN: u32 = 65_536;

/// Runs `iptables ARGS` inside `host`'s namespace.
fn iptables(host: &Host, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip")
        .args(["netns", "exec", &host.netns, "iptables", "-w"])
        .args(args)
        .output()
        .context("running iptables (is the iptables package installed?)")?;
    if !out.status.success() {
        bail!(
            "iptables {} in {} failed: {}",
            args.join(" "),
            host.name,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Whether iptables with the NFQUEUE target and the statistic match can be used here.
pub fn unavailable() -> Option<String> {
    match Command::new("iptables").arg("--version").output() {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!("`iptables --version` failed ({})", o.status)),
        Err(e) => Some(format!("iptables is not installed ({e})")),
    }
}

/// iptables rules in one host, deleted (in reverse) on drop.
#[derive(Debug)]
pub struct Rules {
    host: Host,
    /// Each rule as appended, without the `-A`/`-D`.
    rules: Vec<Vec<String>>,
}

impl Rules {
    pub fn new(host: &Host) -> Self {
        Self {
            host: host.clone(),
            rules: Vec::new(),
        }
    }

    /// Inserts `rule` (a chain, then match and target arguments) at the head of its chain.
    pub fn insert(&mut self, rule: &[&str]) -> anyhow::Result<()> {
        let (chain, rest) = rule.split_first().context("a rule needs a chain")?;
        let mut args = vec!["-I", chain, "1"];
        args.extend_from_slice(rest);
        iptables(&self.host, &args)?;
        self.rules
            .push(rule.iter().map(|s| s.to_string()).collect());
        Ok(())
    }

    /// Drops every packet between this host and `peer`, both ways: a partition.
    pub fn partition(host: &Host, peer: Ipv4Addr) -> anyhow::Result<Self> {
        let mut rules = Self::new(host);
        let peer = peer.to_string();
        rules.insert(&["OUTPUT", "-d", &peer, "-j", "DROP"])?;
        rules.insert(&["INPUT", "-s", &peer, "-j", "DROP"])?;
        Ok(rules)
    }

    /// Drops each packet between this host and `peer` with probability `p`, both ways.
    pub fn loss(host: &Host, peer: Ipv4Addr, p: f64) -> anyhow::Result<Self> {
        let mut rules = Self::new(host);
        let (peer, p) = (peer.to_string(), format!("{p}"));
        for (chain, dir) in [("OUTPUT", "-d"), ("INPUT", "-s")] {
            rules.insert(&[
                chain,
                dir,
                &peer,
                "-m",
                "statistic",
                "--mode",
                "random",
                "--probability",
                &p,
                "-j",
                "DROP",
            ])?;
        }
        Ok(rules)
    }
}

impl Drop for Rules {
    fn drop(&mut self) {
        for rule in self.rules.drain(..).rev() {
            let mut args: Vec<&str> = vec!["-D"];
            args.extend(rule.iter().map(String::as_str));
            if let Err(e) = iptables(&self.host, &args) {
                eprintln!("cleanup: {e:#}");
            }
        }
    }
}

/// Sets `host`'s interface down (a pulled cable), up again on drop.
#[derive(Debug)]
pub struct LinkDown {
    host: Host,
    link: String,
}

impl LinkDown {
    pub fn new(host: &Host) -> anyhow::Result<Self> {
        let link = host_link(host)?;
        ip_in(host, &["link", "set", &link, "down"])?;
        Ok(Self {
            host: host.clone(),
            link,
        })
    }
}

impl Drop for LinkDown {
    fn drop(&mut self) {
        if let Err(e) = ip_in(&self.host, &["link", "set", &self.link, "up"]) {
            eprintln!("cleanup: {e:#}");
        }
    }
}

fn ip_in(host: &Host, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("ip")
        .args(["-n", &host.netns])
        .args(args)
        .output()
        .context("running ip")?;
    if !out.status.success() {
        bail!(
            "ip {} in {} failed: {}",
            args.join(" "),
            host.name,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The interface that carries `host`'s address.
fn host_link(host: &Host) -> anyhow::Result<String> {
    let listing = ip_in(host, &["-4", "-o", "addr", "show"])?;
    let needle = format!("inet {}/", host.addr);
    listing
        .lines()
        .find(|l| l.contains(&needle))
        .and_then(|l| l.split_whitespace().nth(1))
        .map(|name| name.split('@').next().unwrap_or(name).to_string())
        .with_context(|| format!("no interface of {} has {}", host.name, host.addr))
}

/// What [`Delay`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DelayStats {
    /// Packets held and then let through.
    pub delayed: u64,
    /// Packets that left before one queued ahead of them.
    pub reordered: u64,
}

/// Delays every packet `host` sends to `peer` by `delay` ± up to `jitter` (uniform, drawn
/// per packet): netem's `delay D J`, which reorders whenever two draws differ by more than
/// the packets' spacing.
#[derive(Debug)]
pub struct Delay {
    stop: Arc<AtomicBool>,
    delayed: Arc<AtomicU64>,
    reordered: Arc<AtomicU64>,
    thread: Option<JoinHandle<anyhow::Result<()>>>,
    /// The NFQUEUE rule; `Drop` deletes it before stopping the thread, so that no packet is
    /// queued with nobody left to release it.
    rules: Option<Rules>,
}

impl Delay {
    pub fn start(
        host: &Host,
        peer: Ipv4Addr,
        queue: u16,
        delay: Duration,
        jitter: Duration,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(jitter <= delay, "jitter larger than the delay");
        let stop = Arc::new(AtomicBool::new(false));
        let delayed = Arc::new(AtomicU64::new(0));
        let reordered = Arc::new(AtomicU64::new(0));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let netns = host.netns.clone();
        let (s, d, r) = (stop.clone(), delayed.clone(), reordered.clone());
        let thread = std::thread::Builder::new()
            .name(format!("netem-{}", host.name))
            .spawn(move || match open_queue_in(&netns, queue) {
                Ok(q) => {
                    let _ = ready_tx.send(Ok(()));
                    hold_and_release(q, queue, delay, jitter, &s, &d, &r)
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(format!("{e:#}")));
                    Ok(())
                }
            })
            .context("starting the delay thread")?;
        let mut me = Self {
            stop,
            delayed,
            reordered,
            thread: Some(thread),
            rules: None,
        };
        match ready_rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => bail!("opening NFQUEUE {queue} in {}: {e}", host.name),
            Err(_) => bail!("the delay thread did not start"),
        }
        let mut rules = Rules::new(host);
        let (peer, queue) = (peer.to_string(), queue.to_string());
        // --queue-bypass: should the thread be gone, packets pass instead of being dropped.
        rules.insert(&[
            "OUTPUT",
            "-d",
            &peer,
            "-j",
            "NFQUEUE",
            "--queue-num",
            &queue,
            "--queue-bypass",
        ])?;
        me.rules = Some(rules);
        Ok(me)
    }

    pub fn stats(&self) -> DelayStats {
        DelayStats {
            delayed: self.delayed.load(Ordering::Relaxed),
            reordered: self.reordered.load(Ordering::Relaxed),
        }
    }
}

impl Drop for Delay {
    fn drop(&mut self) {
        // The rule first, so that no packet is queued after the thread stops releasing them.
        self.rules.take();
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            match t.join() {
                Ok(Err(e)) => eprintln!("netem: {e:#}"),
                Err(_) => eprintln!("netem: the delay thread panicked"),
                Ok(Ok(())) => {}
            }
        }
    }
}

/// Enters `netns` (this thread only: network namespaces are per thread) and binds NFQUEUE
/// `queue` there, metadata only (the verdict re-injects the packet as it was).
fn open_queue_in(netns: &str, queue: u16) -> anyhow::Result<nfq::Queue> {
    let path = format!("/var/run/netns/{netns}");
    let file = std::fs::File::open(&path).with_context(|| format!("opening {path}"))?;
    // SAFETY: setns on a namespace file descriptor we hold open; it changes only this
    // thread's network namespace, which is this thread's whole purpose.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error()).context("setns into the host's namespace");
    }
    let mut q = nfq::Queue::open().context("opening a netfilter queue socket")?;
    q.bind(queue).context("binding the queue")?;
    q.set_copy_range(queue, 0).context("metadata-only copies")?;
    q.set_queue_max_len(queue, QUEUE_MAX_LEN)
        .context("the queue's length")?;
    q.set_fail_open(queue, true).context("fail-open")?;
    q.set_nonblocking(true);
    Ok(q)
}

/// A splitmix64 stream: the jitter draws (seeded, so a run repeats its schedule).
struct Draws(u64);

impl Draws {
    fn unit(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The thread's loop: takes packets as they come, releases each when its time has come, and
/// on stop releases whatever it still holds.
fn hold_and_release(
    mut q: nfq::Queue,
    queue: u16,
    delay: Duration,
    jitter: Duration,
    stop: &AtomicBool,
    delayed: &AtomicU64,
    reordered: &AtomicU64,
) -> anyhow::Result<()> {
    let mut draws = Draws(u64::from(queue) + 1);
    // (release time, arrival order) in a min-heap; the packets by arrival order.
    let mut due: BinaryHeap<std::cmp::Reverse<(Instant, u64)>> = BinaryHeap::new();
    let mut held: HashMap<u64, nfq::Message> = HashMap::new();
    let (mut arrived, mut released_upto) = (0u64, 0u64);
    loop {
        let stopping = stop.load(Ordering::Relaxed);
        let mut idle = true;
        // Take what has arrived (nothing once stopping: the rule is gone).
        if !stopping {
            loop {
                match q.recv() {
                    Ok(mut msg) => {
                        idle = false;
                        let spread = jitter.as_secs_f64() * (2.0 * draws.unit() - 1.0);
                        let wait = Duration::from_secs_f64((delay.as_secs_f64() + spread).max(0.0));
                        msg.set_verdict(nfq::Verdict::Accept);
                        arrived += 1;
                        due.push(std::cmp::Reverse((Instant::now() + wait, arrived)));
                        held.insert(arrived, msg);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    // The answer to a verdict on a packet the kernel no longer holds (its
                    // interface went down): nothing to do.
                    Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                    Err(e) => return Err(e).context("receiving from the queue"),
                }
            }
        }
        let now = Instant::now();
        while let Some(std::cmp::Reverse((at, order))) = due.peek().copied() {
            if at > now && !stopping {
                break;
            }
            due.pop();
            if let Some(msg) = held.remove(&order) {
                idle = false;
                if order < released_upto {
                    reordered.fetch_add(1, Ordering::Relaxed);
                }
                released_upto = released_upto.max(order);
                q.verdict(msg).context("releasing a packet")?;
                delayed.fetch_add(1, Ordering::Relaxed);
            }
        }
        if stopping {
            let _ = q.unbind(queue);
            return Ok(());
        }
        if idle {
            std::thread::sleep(Duration::from_micros(500));
        }
    }
}
