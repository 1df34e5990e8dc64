//! Writes the crafted hostile model files (e2e's `hostile` module), runs a worker binary on
//! each, and prints a markdown table (file, what is hostile, the refusal, seconds, peak RSS)
//! and one JSON line: `files`, `refused`, `max_seconds`, `max_rss_mib`, and per file its
//! name, verdict, seconds and RSS. Exits 1 when a file is not refused by name.
//! `scripts/bench-hostile-models` runs it on the release binaries.
//!
//! Usage: hostile_models [--bin PATH] [--dir DIR]   (default: tandem-prefill beside this
//! example's own folder, and a fresh temporary folder)

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use tandem_e2e::hostile::{run, table, write_all};

#[derive(Parser)]
struct Args {
    /// The worker binary to run (default: target/<profile>/tandem-prefill).
    #[arg(long)]
    bin: Option<PathBuf>,
    /// Where to write the files (default: a temporary folder, removed after).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Seconds after which a run counts as hung and is killed.
    #[arg(long, default_value_t = 30)]
    hang_guard_s: u64,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let bin = match args.bin {
        Some(b) => b,
        // target/<profile>/examples/hostile_models → target/<profile>/tandem-prefill
        None => std::env::current_exe()?
            .parent()
            .and_then(|d| d.parent())
            .map(|d| d.join("tandem-prefill"))
            .ok_or_else(|| anyhow::anyhow!("no folder above this example"))?,
    };
    let temp = tempfile::tempdir()?;
    let dir = args.dir.unwrap_or_else(|| temp.path().to_path_buf());
    let (_, cases) = write_all(&dir)?;
    let mut rows = Vec::new();
    for case in cases {
        let outcome = run(&bin, &case, Duration::from_secs(args.hang_guard_s))?;
        eprintln!("{}: {:.2} s", case.name, outcome.seconds);
        rows.push((case, outcome));
    }
    print!("{}", table(&rows));
    let refused = rows.iter().filter(|(c, o)| o.problem(c).is_none()).count();
    let max = |f: fn(&tandem_e2e::hostile::Outcome) -> f64| {
        rows.iter().map(|(_, o)| f(o)).fold(0.0, f64::max)
    };
    let per_file: Vec<serde_json::Value> = rows
        .iter()
        .map(|(c, o)| {
            serde_json::json!({
                "file": c.name,
                "refused": o.problem(c).is_none(),
                "error": o.error_line(),
                "seconds": (o.seconds * 1000.0).round() / 1000.0,
                "rss_mib": (o.peak_rss_kib as f64 / 102.4).round() / 10.0,
            })
        })
        .collect();
    let summary = serde_json::json!({
        "files": rows.len(),
        "refused": refused,
        "max_seconds": (max(|o| o.seconds) * 1000.0).round() / 1000.0,
        "max_rss_mib": (max(|o| o.peak_rss_kib as f64) / 102.4).round() / 10.0,
        "binary": bin.display().to_string(),
        "results": per_file,
    });
    println!("\n{summary}");
    if refused < rows.len() {
        std::process::exit(1);
    }
    Ok(())
}
