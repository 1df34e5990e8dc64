//! "A model file that cannot hurt": each crafted hostile model file (e2e's `hostile` module:
//! oversized counts and strings, tensor directories that lie, looping and exploding chat
//! templates, huge vocabularies, safetensors headers and configs that lie) given to the real
//! prefill worker as `--model`. Each must be refused by name (exit status 1, the expected
//! words on stderr, no panic, abort or kill) with a peak RSS under 200 MiB. The time is
//! recorded and printed, and held only to a generous hang guard: timings here are noisy.
//! `scripts/bench-hostile-models` runs the same files on release binaries.

use std::time::Duration;

use tandem_e2e::hostile::{run, table, write_all};
use tandem_engine::{LoadOptions, ModelSource, load_model};

/// Peak resident memory a refusal may take.
const MAX_RSS_MIB: f64 = 200.0;
/// Past this a run counts as hung (a refusal takes well under a second).
const HANG_GUARD: Duration = Duration::from_secs(30);

#[test]
fn every_hostile_model_file_is_refused_by_name_in_bounded_memory() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (bases, cases) = write_all(dir.path()).expect("writing the files");
    assert!(cases.len() >= 20, "{} hostile files", cases.len());
    // Each hostile file is one defect away from one of these, which load.
    for base in bases {
        let loaded = load_model(&ModelSource::Path(base.clone()), &LoadOptions::default());
        assert!(loaded.is_ok(), "{}: {:?}", base.display(), loaded.err());
    }
    let bin = tandem_e2e::binary("tandem-prefill").expect("the prefill worker");
    let mut rows = Vec::new();
    for case in cases {
        let outcome = run(&bin, &case, HANG_GUARD).expect("running the worker");
        rows.push((case, outcome));
    }
    println!("{}", table(&rows));
    let failures: Vec<String> = rows
        .iter()
        .filter_map(|(case, o)| {
            let rss = o.peak_rss_kib as f64 / 1024.0;
            let problem = o
                .problem(case)
                .or_else(|| (rss >= MAX_RSS_MIB).then(|| format!("peak RSS {rss:.0} MiB")))?;
            Some(format!("{}: {problem}\n{}", case.name, o.stderr))
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
