//! Fault and abuse benchmark: the figures reliability.md asks a serving system to report,
//! measured against a real deployment started by `tandem up` (1 prefill + 1 decode worker,
//! shm transport, the deployment secret in a 0600 file this benchmark also holds):
//!
//! 1. attacks on the internal and public planes ([`attacks`]);
//! 2. malformed and out-of-range requests on every generation route, each of which must get a
//!    4xx naming the field and never a 5xx ([`bad_inputs`]);
//! 3. faults: kill -9 of each worker under load, SIGSTOP of the prefill worker, client
//!    disconnects mid-stream; what the clients saw and how long recovery took ([`faults`]);
//! 4. a soak of mixed requests with cancellations: none lost, KV blocks back to zero when
//!    idle, and each process's resident memory across it ([`soak`]);
//! 5. overload: ten times the measured capacity, open loop ([`overload`]);
//! 6. chaos between hosts: the prefill to decode link delayed, lossy, partitioned and down,
//!    on a second deployment across network namespaces ([`chaos`]; needs root).
//!
//! This file owns the flags, the order of the run and the exit status. Run by
//! `scripts/bench-faults`, which builds the release binaries first. Prints markdown tables,
//! then, last, one JSON line ([`report`]); exits 1 when any check failed (the temporary
//! folder with the deployment's logs is then kept and named on stderr). Progress goes to
//! stderr.
//!
//! This is an outside observer: it talks HTTP to the router, gRPC (as a member or a
//! stranger) and raw TCP to the workers, and reads `/proc`; it never links the serving code.
//! Every loop is bounded in count and time, so a hang in the deployment shows up as a failed
//! row, not as a benchmark that never ends.

/// Progress on stderr, so stdout holds only the tables and the JSON line.
macro_rules! progress {
    ($($t:tt)*) => { eprintln!("[fault-bench] {}", format!($($t)*)) };
}

mod attacks;
mod bad_inputs;
mod chaos;
mod chaos_hosts;
mod client;
mod deployment;
mod faults;
mod overload;
mod report;
mod soak;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;

use crate::client::{Call, Outcome, REQUEST_TIMEOUT};
use crate::deployment::Deployment;
use crate::report::{Chaos, Report, secs};

pub struct Opts {
    pub model: String,
    pub soak_requests: usize,
    pub concurrency: usize,
    keep: bool,
    bin_dir: Option<PathBuf>,
    /// How long the overload row offers ten times the capacity.
    pub overload_burst: std::time::Duration,
    /// Only the chaos rows (`--chaos-only`): the first deployment is not started.
    chaos_only: bool,
    /// Shorter impairments for the chaos rows (`--quick`).
    pub chaos: chaos::Durations,
    /// Extra router flags, after the deployment's own (for A/B runs of a setting).
    pub router_args: Vec<String>,
}

/// The abuse and fault matrix, a soak, an overload burst and chaos between hosts, against a
/// real deployment.
#[derive(clap::Parser)]
struct Flags {
    /// The model the deployment serves (`tiny`, `smollm2`…).
    #[arg(long, default_value = "tiny")]
    model: String,
    /// Requests of the soak (default 300, 60 with `--quick`).
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    soak_requests: Option<u32>,
    /// Requests in flight at once in the soak.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..))]
    concurrency: u16,
    /// Shorter impairments and overload burst, and a 60-request soak.
    #[arg(long)]
    quick: bool,
    /// Only the chaos rows: the first deployment is not started.
    #[arg(long)]
    chaos_only: bool,
    /// Keep the deployments' folders and logs.
    #[arg(long)]
    keep: bool,
    /// Where the tandem binaries are (default: beside this one's build).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// A router flag after the deployment's own (for an A/B of a setting); repeatable.
    #[arg(long = "router-arg", allow_hyphen_values = true)]
    router_args: Vec<String>,
}

fn parse_opts() -> Opts {
    let flags: Flags = clap::Parser::parse();
    let (chaos, overload_burst, soak) = if flags.quick {
        (
            chaos::Durations::QUICK,
            std::time::Duration::from_secs(5),
            60,
        )
    } else {
        (
            chaos::Durations::FULL,
            std::time::Duration::from_secs(60),
            300,
        )
    };
    Opts {
        model: flags.model,
        soak_requests: flags.soak_requests.map_or(soak, |n| n as usize),
        concurrency: usize::from(flags.concurrency),
        keep: flags.keep,
        bin_dir: flags.bin_dir,
        overload_burst,
        chaos_only: flags.chaos_only,
        chaos,
        router_args: flags.router_args,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> std::process::ExitCode {
    // The error chain, without a backtrace: a failed check is a finding, not a crash.
    match bench().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fault_bench: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn bench() -> anyhow::Result<()> {
    let opts = parse_opts();
    let started = Instant::now();
    let bin_dir = match &opts.bin_dir {
        Some(d) => d.clone(),
        // target/<profile>/examples/fault_bench → target/<profile>
        None => std::env::current_exe()?
            .parent()
            .and_then(Path::parent)
            .context("cannot locate the target folder; pass --bin-dir")?
            .to_path_buf(),
    };
    for b in ["tandem", "tandem-router", "tandem-prefill", "tandem-decode"] {
        anyhow::ensure!(
            bin_dir.join(b).exists(),
            "{} is missing: build the release binaries (scripts/bench-faults does)",
            bin_dir.join(b).display()
        );
    }
    if opts.chaos_only {
        let chaos = run_chaos(&bin_dir, &opts).await?;
        return report::print_chaos_only(&chaos, &opts, started.elapsed());
    }
    let mut dep = Deployment::start(&bin_dir, &opts.model, &opts.router_args).await?;
    let measured = run_all(&mut dep, &opts, started).await;
    let ending = dep.finish();
    let mut report = match measured {
        Ok(r) => r,
        Err(e) => {
            // The logs are what explains a failure: they outlive this run.
            dep.keep_files("failed");
            return Err(e);
        }
    };
    // After the first deployment is gone: its own hosts, and the two cores to itself.
    report.chaos = run_chaos(&bin_dir, &opts).await?;
    let pass = report.print(&opts, &ending, started.elapsed());
    if !pass {
        dep.keep_files("some checks failed");
    } else if opts.keep {
        dep.keep_files("--keep");
    }
    anyhow::ensure!(pass, "some checks failed: see the rows marked NO above");
    Ok(())
}

async fn run_all(dep: &mut Deployment, opts: &Opts, started: Instant) -> anyhow::Result<Report> {
    let info = dep.decode_info().await?;
    progress!(
        "deployment up after {} (model {}, vocabulary {}, context {})",
        secs(started.elapsed()),
        info.model_name,
        info.vocab_size,
        info.context_length
    );
    // A first request, so every later figure is about a deployment that has served.
    let first = dep
        .router
        .run(&Call::completion("hello", 4, false), REQUEST_TIMEOUT)
        .await;
    anyhow::ensure!(
        matches!(
            first,
            Outcome::Ok {
                disaggregated: true,
                ..
            }
        ),
        "the first request did not run disaggregated: {first:?}"
    );
    progress!("attacks");
    let attacks = attacks::run(dep).await?;
    progress!("bad inputs");
    let bad = bad_inputs::run(dep, info.vocab_size, info.context_length).await?;
    progress!("faults");
    let faults = faults::run(dep, info.context_length).await?;
    progress!(
        "soak: {} requests at concurrency {}",
        opts.soak_requests,
        opts.concurrency
    );
    let soak = soak::run(dep, opts.soak_requests, opts.concurrency).await?;
    progress!("overload");
    let overload = overload::run(dep, opts.overload_burst).await?;
    dep.check_launcher()?;
    Ok(Report {
        attacks,
        bad,
        faults,
        soak,
        overload,
        chaos: Chaos::NotRun("not yet".into()),
    })
}

/// The chaos rows on a deployment across network namespaces, or why they cannot run here.
async fn run_chaos(bin_dir: &Path, opts: &Opts) -> anyhow::Result<Chaos> {
    if let Some(why) = chaos_hosts::unavailable() {
        progress!("chaos rows not run: {why}");
        return Ok(Chaos::NotRun(why));
    }
    progress!("chaos: starting router, prefill and decode on three hosts");
    let hosts = chaos_hosts::ChaosHosts::start(bin_dir, &opts.model).await?;
    Ok(Chaos::Rows(chaos::run(&hosts, opts.chaos).await?))
}
