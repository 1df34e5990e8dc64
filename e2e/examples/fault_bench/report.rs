//! What the benchmark prints: the markdown tables (attacks, bad inputs, faults, soak, the
//! deployment's stop) and, last, one JSON line; and the one verdict over all of them. Also
//! the small text helpers the rows are written with.

use std::time::Duration;

use serde_json::json;

use crate::Opts;
use crate::attacks::Attack;
use crate::bad_inputs::BadInputReport;
use crate::chaos::ChaosRow;
use crate::deployment::Ending;
use crate::faults::Fault;
use crate::overload::OverloadReport;
use crate::soak::SoakReport;

pub fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

/// `prefix` and the items joined by `sep`; nothing when there are none, so an optional
/// detail vanishes from its cell.
pub fn listed(prefix: &str, items: &[String], sep: &str) -> String {
    match items {
        [] => String::new(),
        _ => format!("{prefix}{}", items.join(sep)),
    }
}

/// ` (text)`, or nothing for an empty text.
pub fn parenthesized(text: &str) -> String {
    match text {
        "" => String::new(),
        _ => format!(" ({text})"),
    }
}

/// A table cell: a `|` inside it would end the cell.
fn md(s: &str) -> String {
    s.replace('|', "\\|")
}

/// A table's heading and column names.
fn table(title: &str, columns: &[&str]) {
    println!("### {title}");
    println!();
    println!("| {} |", columns.join(" | "));
    println!("|{}", "---|".repeat(columns.len()));
}

fn row(cells: &[&str]) {
    let cells: Vec<String> = cells.iter().map(|c| md(c)).collect();
    println!("| {} |", cells.join(" | "));
}

fn yes_no(pass: bool) -> &'static str {
    if pass { "yes" } else { "**NO**" }
}

/// Everything measured while the deployment ran.
pub struct Report {
    pub attacks: Vec<Attack>,
    pub bad: BadInputReport,
    pub faults: Vec<Fault>,
    pub soak: SoakReport,
    pub overload: OverloadReport,
    pub chaos: Chaos,
}

/// `--chaos-only`: the chaos table and a JSON line of its figures; an error if a row failed.
pub fn print_chaos_only(chaos: &Chaos, opts: &Opts, wall: Duration) -> anyhow::Result<()> {
    chaos.print();
    let pass = chaos.passed();
    let json = json!({
        "model": opts.model,
        "chaos": chaos.json(),
        "wall_seconds": wall.as_secs_f64(),
        "pass": pass,
    });
    println!("{json}");
    anyhow::ensure!(pass, "some chaos rows failed: see the rows marked NO above");
    Ok(())
}

/// The chaos rows, or why they did not run (they need root and iptables).
pub enum Chaos {
    NotRun(String),
    Rows(Vec<ChaosRow>),
}

impl Chaos {
    fn rows(&self) -> &[ChaosRow] {
        match self {
            Chaos::Rows(r) => r,
            Chaos::NotRun(_) => &[],
        }
    }

    fn passed(&self) -> bool {
        self.rows().iter().all(|r| r.survived)
    }

    fn print(&self) {
        println!();
        let columns = [
            "link fault (prefill ↔ decode, separate hosts, KV over TCP)",
            "what the clients saw",
            "recovered",
            "left on the workers",
            "pass",
        ];
        table("Chaos between hosts", &columns);
        match self {
            Chaos::NotRun(why) => row(&["not run", why, "", "", "n/a"]),
            Chaos::Rows(rows) => {
                for r in rows {
                    let pass = yes_no(r.survived);
                    row(&[&r.fault, &r.client_saw, &r.recovered, &r.left, pass]);
                }
            }
        }
    }

    fn json(&self) -> serde_json::Value {
        let rows = self.rows();
        let max_recovery = rows
            .iter()
            .filter_map(|r| r.recovery)
            .map(|d| d.as_secs_f64())
            .fold(0.0, f64::max);
        json!({
            "run": matches!(self, Chaos::Rows(_)),
            "rows": rows.len(),
            "survived": rows.iter().filter(|r| r.survived).count(),
            "requests": rows.iter().map(|r| r.tally.total()).sum::<usize>(),
            "errors": rows.iter().map(|r| r.tally.errors).sum::<usize>(),
            "lost": rows.iter().map(|r| r.tally.lost).sum::<usize>(),
            "wrong_texts": rows.iter().map(|r| r.wrong).sum::<usize>(),
            "max_recovery_seconds": max_recovery,
            "longest_request_seconds": rows
                .iter()
                .map(|r| r.longest.as_secs_f64())
                .fold(0.0, f64::max),
        })
    }
}

impl Report {
    /// Prints the tables and the JSON line; whether every check passed.
    pub fn print(&self, opts: &Opts, end: &Ending, wall: Duration) -> bool {
        self.print_attacks_and_faults(opts);
        self.print_soak(opts);
        self.print_overload();
        self.chaos.print();
        println!();
        table("Deployment", &["measure", "value"]);
        let restarts = end.restarts.to_string();
        row(&[
            "restarts by the launcher (expected 3: the three kills)",
            &restarts,
        ]);
        row(&["panics in the logs", &end.panics.len().to_string()]);
        for p in end.panics.iter().take(5) {
            row(&["panic", p]);
        }
        let stop = format!("{} after {}", end.stop_status, secs(end.stop_took));
        row(&["stop (SIGTERM to the launcher)", &stop]);
        let survivors = end.survivors.len().to_string();
        row(&["serving processes left after the stop", &survivors]);
        let shm_left = end.shm_left.len().to_string();
        row(&["shared-memory files left after the stop", &shm_left]);
        row(&["wall time", &secs(wall)]);

        let (attacks, faults, soak, bad) = (&self.attacks, &self.faults, &self.soak, &self.bad);
        let attack_rows_passed = attacks.iter().filter(|a| a.passed()).count();
        let survived = faults.iter().filter(|f| f.survived).count();
        let pass = attack_rows_passed == attacks.len()
            && bad.passed()
            && survived == faults.len()
            && soak.passed()
            && self.chaos.passed()
            && self.overload.passed()
            && end.panics.is_empty()
            && end.restarts == 3
            && end.shm_left.is_empty()
            && end.survivors.is_empty()
            && end.stop_status.contains("exit status: 0");
        let t = &soak.tally;
        let growth = soak.rss_growth();
        let json = json!({
            "model": opts.model,
            "router_args": opts.router_args,
            "attacks_tried": attacks.iter().map(|a| a.tried).sum::<usize>(),
            "attacks_refused": attacks.iter().map(|a| a.refused).sum::<usize>(),
            "attack_rows_passed": attack_rows_passed,
            "attack_rows": attacks.len(),
            "faults_tried": faults.len(),
            "faults_survived": survived,
            "bad_inputs_tried": bad.tried,
            "bad_inputs_named_4xx": bad.named_4xx,
            "bad_inputs_5xx": bad.server_errors,
            "soak_requests": t.total(),
            "soak_ok": t.ok,
            "soak_errors": t.errors,
            "soak_cancelled": t.cancelled,
            "soak_lost": t.lost,
            "soak_seconds": soak.took.as_secs_f64(),
            "kv_blocks_leaked": {"prefill": soak.leaked.0, "decode": soak.leaked.1},
            "rss_growth_kib": {"router": growth[0], "prefill": growth[1], "decode": growth[2]},
            "restarts_observed": end.restarts,
            "panics": end.panics.len(),
            "shm_files_left": end.shm_left.len(),
            "processes_left": end.survivors.len(),
            "overload": self.overload.json(),
            "overload_passed": self.overload.passed(),
            "chaos": self.chaos.json(),
            "wall_seconds": wall.as_secs_f64(),
            "pass": pass,
        });
        println!("{json}");
        pass
    }

    fn print_attacks_and_faults(&self, opts: &Opts) {
        let attack_columns = ["attack", "expected", "result", "pass"];
        table(&format!("Attacks ({} model)", opts.model), &attack_columns);
        for a in &self.attacks {
            row(&[&a.what, &a.expected, &a.result, yes_no(a.passed())]);
        }
        let b = &self.bad;
        println!();
        table("Bad inputs", &["measure", "value"]);
        row(&[
            "malformed or out-of-range requests (/v1/completions, /v1/chat/completions, /generate, /generate_stream)",
            &b.tried.to_string(),
        ]);
        row(&[
            "answered 4xx naming the field (or, body-level, with a message)",
            &b.named_4xx.to_string(),
        ]);
        let unnamed = b.unnamed_4xx.to_string();
        row(&["answered 4xx without naming the field", &unnamed]);
        row(&["answered 5xx", &b.server_errors.to_string()]);
        row(&["not refused / no answer", &b.other.to_string()]);
        let rss = format!("{} → {} KiB", b.router_rss.0, b.router_rss.1);
        row(&["router RSS before → after", &rss]);
        for f in &b.failures {
            row(&["not as expected", f]);
        }
        println!();
        let fault_columns = ["fault", "what the client saw", "recovered", "pass"];
        table("Faults", &fault_columns);
        for f in &self.faults {
            row(&[&f.fault, &f.client_saw, &f.recovered, yes_no(f.survived)]);
        }
    }

    fn print_overload(&self) {
        let o = &self.overload;
        println!();
        table(
            &format!(
                "Overload: 10x the measured capacity ({:.1} req/s), open loop",
                o.capacity_rps
            ),
            &["measure", "value"],
        );
        let offered = format!(
            "{} requests in {} ({:.0} req/s; {} not sent: client limit)",
            o.sent,
            secs(o.burst),
            o.offered_rps,
            o.skipped
        );
        row(&["offered", &offered]);
        let answers: Vec<String> = o
            .statuses
            .iter()
            .map(|(s, n)| match s {
                0 => format!("{n} lost or hung"),
                s => format!("{n}×{s}"),
            })
            .collect();
        row(&["answers", &answers.join(", ")]);
        row(&["5xx", &o.server_errors().to_string()]);
        row(&["429 without Retry-After", &o.no_retry_after.to_string()]);
        let p99 = o
            .p99_queue
            .map_or("no waits recorded".into(), |q| format!("≤ {q} s"));
        row(&[
            &format!("p99 queue time of the admitted (bound {} s)", o.queue_bound),
            &p99,
        ]);
        for (i, name) in ["router", "prefill", "decode"].iter().enumerate() {
            let rss = format!(
                "{} → {} KiB ({:+} KiB; with the KV pools {:+} KiB)",
                o.heap_before[i],
                o.heap_after[i],
                o.heap_after[i] as i64 - o.heap_before[i] as i64,
                o.rss_after[i] as i64 - o.rss_before[i] as i64
            );
            row(&[
                &format!("RSS {name} outside the KV pools, before → after"),
                &rss,
            ]);
        }
        let after = o.serving_after.map_or("NEVER (60 s)".into(), |d| {
            format!("{} after the burst", secs(d))
        });
        row(&["serving normally (disaggregated) again", &after]);
        row(&["pass", yes_no(o.passed())]);
    }

    fn print_soak(&self, opts: &Opts) {
        let s = &self.soak;
        let t = &s.tally;
        println!();
        table(
            &format!(
                "Soak: {} requests at concurrency {} (OpenAI and TGI, streaming and not, ~5 % cancelled)",
                opts.soak_requests, opts.concurrency
            ),
            &["measure", "value"],
        );
        let rate = t.total() as f64 / s.took.as_secs_f64().max(1e-9);
        let requests = format!("{} in {} ({rate:.1} req/s)", t.total(), secs(s.took));
        row(&["requests", &requests]);
        let unsaid = match t.mode_unsaid {
            0 => String::new(),
            n => format!(", {n} whose response did not say the mode"),
        };
        row(&[
            "ok",
            &format!("{} ({} disaggregated{unsaid})", t.ok, t.disaggregated),
        ]);
        let errors = format!("{}{}", t.errors, parenthesized(&t.statuses()));
        row(&["explicit errors", &errors]);
        row(&["cancelled by the client", &t.cancelled.to_string()]);
        let lost = format!("{}{}", t.lost, parenthesized(&t.lost_why.join("; ")));
        row(&["lost (no [DONE], final event nor error event)", &lost]);
        let idle = s.idle_after.map_or(" (not idle within 60 s)".into(), |d| {
            format!(" (idle {} after the last request)", secs(d))
        });
        let leaked = format!("{}, {}{idle}", s.leaked.0, s.leaked.1);
        row(&[
            "KV blocks in use when idle again (prefill, decode)",
            &leaked,
        ]);
        if let Some(busy) = &s.busy_at_10s {
            row(&["still busy 10 s after the last request", busy]);
        }
        let growth = s.rss_growth();
        for (i, name) in ["router", "prefill", "decode"].iter().enumerate() {
            let rss = format!(
                "{} → {} KiB ({:+} KiB)",
                s.rss_before[i], s.rss_after[i], growth[i]
            );
            row(&[&format!("RSS {name} before → after"), &rss]);
        }
    }
}
