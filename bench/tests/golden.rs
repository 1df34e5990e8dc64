//! Golden bytes: given the metric values of every block in the four seeds (copied from
//! `shared/seeds/` into `tests/seeds/`), the printer reproduces the block byte for byte.
//! Seed 000 lost its trailing spaces in copying, so it is compared modulo trailing space.

use std::collections::BTreeMap;

use tandem_bench::metrics::{BenchmarkMetrics, MetricKind, Stats};
use tandem_bench::report::{BlockOptions, Layout, format_block};

const SEED_000: &str = include_str!("seeds/000_92a110581fe302f6.txt");
const SEED_001: &str = include_str!("seeds/001_902df92d1b3a4732.txt");
const SEED_002: &str = include_str!("seeds/002_64bb5876f73a2969.txt");
const SEED_003: &str = include_str!("seeds/003_8b5b9f497242493f.txt");

const TITLE: &str = "============ Serving Benchmark Result ============";
const END: &str = "==================================================";

/// Every block of a seed, as its exact text (each line ending in `\n`).
fn blocks(seed: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut current: Option<String> = None;
    for line in seed.lines() {
        if line.trim_end() == TITLE {
            current = Some(String::new());
        }
        if let Some(block) = current.as_mut() {
            block.push_str(line);
            block.push('\n');
            if line.trim_end() == END {
                found.extend(current.take());
            }
        }
    }
    found
}

/// What a printed block says: its rows as label → value text, and its section layout.
struct Parsed {
    rows: BTreeMap<String, String>,
    sections: Vec<(MetricKind, Vec<(String, f64)>)>,
}

fn parse(block: &str) -> Parsed {
    let mut rows = BTreeMap::new();
    let mut sections: Vec<(MetricKind, Vec<(String, f64)>)> = Vec::new();
    for line in block.lines().skip(1) {
        if line.starts_with('-') {
            let header = line.trim_matches('-');
            let kind = MetricKind::ALL
                .into_iter()
                .find(|k| k.header() == header)
                .unwrap_or_else(|| panic!("unknown section {header:?}"));
            sections.push((kind, Vec::new()));
            continue;
        }
        if line.starts_with('=') {
            continue;
        }
        let (label, value) = (line[..40].trim_end(), line[41..].trim());
        match sections.last_mut() {
            Some((_, section_rows)) => {
                section_rows.push((label.to_string(), value.parse().unwrap()));
            }
            None => {
                rows.insert(label.to_string(), value.to_string());
            }
        }
    }
    Parsed { rows, sections }
}

/// Rebuilds the metrics a block was printed from, and the options that shaped it.
fn metrics_of(block: &str) -> (BenchmarkMetrics, f64, BlockOptions) {
    let parsed = parse(block);
    let value = |label: &str| parsed.rows.get(label).map(String::as_str);
    let float = |label: &str| value(label).map_or(0.0, |v| v.parse::<f64>().unwrap());
    let int = |label: &str| value(label).map_or(0, |v| v.parse::<usize>().unwrap());
    let layout = if value("Failed requests:").is_some() {
        Layout::New
    } else {
        Layout::Old
    };
    let mut metrics = BenchmarkMetrics {
        completed: int("Successful requests:"),
        failed: int("Failed requests:"),
        total_input: int("Total input tokens:"),
        total_output: int("Total generated tokens:"),
        request_throughput: float("Request throughput (req/s):"),
        request_goodput: value("Request goodput (req/s):").map(|v| v.parse().unwrap()),
        output_throughput: float("Output token throughput (tok/s):"),
        total_token_throughput: float("Total token throughput (tok/s):")
            + float("Total Token throughput (tok/s):"),
        max_output_tokens_per_s: float("Peak output token throughput (tok/s):"),
        max_concurrent_requests: float("Peak concurrent requests:") as usize,
        ..Default::default()
    };
    let mut percentile_metrics = Vec::new();
    for (kind, rows) in &parsed.sections {
        percentile_metrics.push(*kind);
        let percentiles = rows[2..]
            .iter()
            .map(|(label, v)| {
                let p = label[1..]
                    .split(' ')
                    .next()
                    .unwrap()
                    .parse::<f64>()
                    .unwrap();
                (p, *v)
            })
            .collect();
        let stats = Stats {
            mean: rows[0].1,
            median: rows[1].1,
            std: 0.0,
            percentiles,
        };
        metrics.stats.insert(*kind, stats);
    }
    let options = BlockOptions {
        layout,
        max_concurrency: value("Maximum request concurrency:").map(|v| v.parse().unwrap()),
        request_rate: value("Request rate configured (RPS):")
            .map_or(f64::INFINITY, |v| v.parse().unwrap()),
        goodput: metrics.request_goodput.is_some(),
        percentile_metrics,
    };
    (metrics, float("Benchmark duration (s):"), options)
}

fn reprinted(block: &str) -> String {
    let (metrics, duration, options) = metrics_of(block);
    format_block(&metrics, duration, &options)
}

fn strip_trailing(text: &str) -> String {
    text.lines()
        .map(|l| format!("{}\n", l.trim_end()))
        .collect()
}

#[test]
fn seed_002_prefill_and_decode_blocks_byte_for_byte() {
    let found = blocks(SEED_002);
    assert_eq!(found.len(), 2);
    for block in &found {
        assert_eq!(reprinted(block), *block);
    }
    // The whole file is the two blocks under their headings, as the presets print them.
    let composed = format!("# Prefill\n\n{}\n\n# Decode\n\n{}", found[0], found[1]);
    assert_eq!(
        composed.trim_end_matches('\n'),
        SEED_002.trim_end_matches('\n')
    );
}

#[test]
fn seed_002_prefill_block_from_unrounded_values() {
    let mut metrics = BenchmarkMetrics {
        completed: 512,
        failed: 0,
        total_input: 4_193_792,
        total_output: 512,
        request_throughput: 512.0 / 50.869_68,
        output_throughput: 512.0 / 50.869_68,
        total_token_throughput: (4_193_792.0 + 512.0) / 50.869_68,
        max_output_tokens_per_s: 11.0,
        max_concurrent_requests: 512,
        ..Default::default()
    };
    let ttft = Stats {
        mean: 25_793.187_4,
        median: 25_786.619_9,
        std: 14_000.0,
        percentiles: vec![(99.0, 50_212.608)],
    };
    metrics.stats.insert(MetricKind::Ttft, ttft);
    for kind in [MetricKind::Tpot, MetricKind::Itl] {
        metrics
            .stats
            .insert(kind, Stats::from_seconds(&[], &[99.0]));
    }
    let options = BlockOptions {
        layout: Layout::New,
        max_concurrency: None,
        request_rate: f64::INFINITY,
        goodput: false,
        percentile_metrics: vec![MetricKind::Ttft, MetricKind::Tpot, MetricKind::Itl],
    };
    assert_eq!(
        format_block(&metrics, 50.869_68, &options),
        blocks(SEED_002)[0]
    );
}

#[test]
fn seed_001_blocks_old_layout_byte_for_byte() {
    let found = blocks(SEED_001);
    assert_eq!(found.len(), 23);
    for block in &found {
        assert_eq!(reprinted(block), *block);
    }
}

#[test]
fn seed_003_blocks_old_layout_byte_for_byte() {
    let found = blocks(SEED_003);
    assert_eq!(found.len(), 13);
    for block in &found {
        assert_eq!(reprinted(block), *block);
    }
    // The capped book run: fewer successes than the 4096 asked for.
    assert!(found[12].contains("Successful requests:                     2537      \n"));
}

#[test]
fn seed_000_blocks_modulo_trailing_space() {
    let found = blocks(SEED_000);
    assert_eq!(found.len(), 9);
    for block in &found {
        let printed = reprinted(block);
        assert_ne!(
            printed, *block,
            "seed 000 has no trailing spaces, the printer does"
        );
        assert_eq!(strip_trailing(&printed), strip_trailing(block));
    }
}

#[test]
fn optional_rows_and_sections_follow_the_options() {
    let (mut metrics, duration, mut options) = metrics_of(&blocks(SEED_002)[1]);
    options.max_concurrency = Some(64);
    options.request_rate = 10.0;
    options.goodput = true;
    metrics.request_goodput = Some(12.5);
    // Given out of order, with E2EL: printed ttft → tpot → itl → e2el.
    options.percentile_metrics = vec![
        MetricKind::E2el,
        MetricKind::Itl,
        MetricKind::Ttft,
        MetricKind::Tpot,
    ];
    metrics.stats.insert(
        MetricKind::E2el,
        Stats {
            mean: 1.0,
            median: 2.0,
            std: 0.0,
            percentiles: vec![(50.0, 3.0), (99.9, 4.0)],
        },
    );
    let printed = format_block(&metrics, duration, &options);
    let lines: Vec<&str> = printed.lines().collect();
    assert_eq!(
        lines[3],
        "Maximum request concurrency:             64        "
    );
    assert_eq!(
        lines[4],
        "Request rate configured (RPS):           10.00     "
    );
    assert_eq!(
        lines[9],
        "Request goodput (req/s):                 12.50     "
    );
    let tail: Vec<&str> = lines[lines.len() - 6..].to_vec();
    assert_eq!(
        tail,
        [
            "----------------End-to-end Latency----------------",
            "Mean E2EL (ms):                          1.00      ",
            "Median E2EL (ms):                        2.00      ",
            "P50 E2EL (ms):                           3.00      ",
            "P99.9 E2EL (ms):                         4.00      ",
            "==================================================",
        ]
    );
    // The old layout drops failed, limits and peaks, and spells `Total Token`.
    options.layout = Layout::Old;
    let old = format_block(&metrics, duration, &options);
    assert!(!old.contains("Failed requests") && !old.contains("Peak") && !old.contains("Maximum"));
    assert!(old.contains("Total Token throughput (tok/s):          2148.29   \n"));
    assert!(old.contains("Request goodput (req/s):"));
}
