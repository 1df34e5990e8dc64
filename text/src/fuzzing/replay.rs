//! The short fuzzing run every crate's tests make of its fuzz targets (the `fuzzing` modules
//! of tandem-text, -engine, -transfer, -worker and -router): replay each target's committed
//! corpus (`fuzz/corpus/<target>/`, seeds and what fuzzing runs kept) and the inputs that once
//! broke it (`fuzz/regressions/<target>/`), then a bounded, seeded mutation loop over them,
//! which is what CI can afford without libFuzzer.
//!
//! Here once, for every crate: built for this crate's own tests and, behind the `fuzz-replay`
//! feature, for the other crates' (their dev-dependency on tandem-text turns it on). It needs
//! no dependency: the mutations draw from a splitmix64 generator of a fixed seed, so a run is
//! the same on every machine and an input it finds replays.

use std::path::{Path, PathBuf};

/// Mutated inputs per target and run.
pub const MUTATIONS: usize = 300;

/// The cargo-fuzz project (`fuzz/` at the workspace root, beside every crate).
pub fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

/// Whether this run regenerates the generated seeds (`TANDEM_BLESS=1`).
pub fn blessing() -> bool {
    std::env::var_os("TANDEM_BLESS").is_some()
}

/// Writes a generated seed into the target's committed corpus.
pub fn write_seed(target: &str, name: &str, bytes: &[u8]) {
    let dir = fuzz_dir().join("corpus").join(target);
    let written =
        std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(dir.join(name), bytes));
    if let Err(e) = written {
        panic!(
            "cannot write the seed {name} of {target} in {}: {e}",
            dir.display()
        );
    }
}

/// Every file of the target's corpus, then of its regressions, each in name order.
pub fn inputs(target: &str) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for kind in ["corpus", "regressions"] {
        let Ok(entries) = std::fs::read_dir(fuzz_dir().join(kind).join(target)) else {
            continue;
        };
        let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort();
        for path in paths {
            match std::fs::read(&path) {
                Ok(bytes) => out.push(bytes),
                Err(e) => panic!("cannot read the fuzz input {}: {e}", path.display()),
            }
        }
    }
    out
}

/// splitmix64: a fixed stream of numbers from a seed, with no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n` > 0; the bias is irrelevant here).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn byte(&mut self) -> u8 {
        self.next() as u8
    }
}

/// Flips, sets, inserts, deletes and splices bytes of `seed` (never more than doubling it).
fn mutate(seed: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut out = seed.to_vec();
    for _ in 0..1 + rng.below(7) {
        let at = if out.is_empty() {
            0
        } else {
            rng.below(out.len())
        };
        match rng.below(5) {
            0 if !out.is_empty() => out[at] ^= 1 << rng.below(8),
            1 if !out.is_empty() => out[at] = rng.byte(),
            2 if out.len() < 2 * seed.len() + 16 => out.insert(at, rng.byte()),
            3 if !out.is_empty() => {
                out.remove(at);
            }
            // A run of 0xff: counts and lengths at their largest.
            _ if out.len() >= at + 8 => out[at..at + 8].fill(0xff),
            _ => {}
        }
    }
    out
}

/// Runs `body` on `input`; an input that makes it panic is written out (to commit under
/// `fuzz/regressions/<target>/` once fixed) and fails the test.
fn one(target: &str, body: fn(&[u8]), input: &[u8]) {
    if std::panic::catch_unwind(|| body(input)).is_err() {
        let dir = std::env::temp_dir().join("tandem-fuzz-found");
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join(format!("{target}-{:016x}", super::fnv(input)));
        let _ = std::fs::write(&path, input);
        panic!(
            "{target} panicked on an input, written to {}",
            path.display()
        );
    }
}

/// The corpus and regressions, then [`MUTATIONS`] mutations of them; the corpus must not be
/// empty (seeds are committed).
pub fn run(target: &str, body: fn(&[u8])) {
    let corpus = inputs(target);
    assert!(
        !corpus.is_empty(),
        "no corpus for {target} in {}",
        fuzz_dir().display()
    );
    for input in &corpus {
        one(target, body, input);
    }
    let mut rng = Rng(0x5eed);
    for i in 0..MUTATIONS {
        let input = mutate(&corpus[i % corpus.len()], &mut rng);
        one(target, body, &input);
    }
}
