//! The printed "Serving Benchmark Result" block and the `--save-result` JSON, byte-compatible
//! with vLLM's (`vllm/benchmarks/serve.py` 0.13.0 for the new layout, the legacy
//! `benchmarks/benchmark_serving.py` 0.6–0.10 for the old one).
//!
//! Rust's `{:<10.2}` and `{:=^50}` give the same bytes as Python's `{:<10.2f}` and
//! `{s:{c}^{n}}` for every value printed here (bench-spec §1.1), trailing spaces included.

use std::fmt::Write as _;

use serde_json::{Map, Value, json};

use crate::metrics::{BenchmarkMetrics, MetricKind, RequestOutput};

/// Which block layout to print.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Layout {
    /// vLLM ≥ 0.13.0: failed requests, configured limits, peak rows, `Total token throughput`.
    #[default]
    New,
    /// The legacy script (0.6–0.10): `Total Token throughput`, no failed or peak rows.
    Old,
}

/// What decides the optional rows and the sections of a block.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockOptions {
    pub layout: Layout,
    /// `--max-concurrency`, printed in the new layout when given.
    pub max_concurrency: Option<usize>,
    /// `--request-rate`; printed in the new layout when finite.
    pub request_rate: f64,
    /// Whether `--goodput` was given (prints the goodput row).
    pub goodput: bool,
    /// `--percentile-metrics`, in any order; printed ttft → tpot → itl → e2el.
    pub percentile_metrics: Vec<MetricKind>,
}

/// Python's `"{:<40} {:<10}"` for integers.
fn int_row(out: &mut String, label: &str, value: impl std::fmt::Display) {
    let _ = writeln!(out, "{label:<40} {value:<10}");
}

/// Python's `"{:<40} {:<10.2f}"`.
fn float_row(out: &mut String, label: &str, value: f64) {
    let _ = writeln!(out, "{label:<40} {value:<10.2}");
}

/// Percentile label as vLLM writes it: `str(int(p))` when whole, else `str(p)`.
pub fn percentile_word(p: f64) -> String {
    if p.fract() == 0.0 && p.is_finite() {
        format!("{}", p as i64)
    } else {
        format!("{p}")
    }
}

/// Renders one block, every line ending in `\n`, the last one the `=`×50 end line.
pub fn format_block(metrics: &BenchmarkMetrics, duration: f64, options: &BlockOptions) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{:=^50}", " Serving Benchmark Result ");
    int_row(&mut out, "Successful requests:", metrics.completed);
    let new = options.layout == Layout::New;
    if new {
        int_row(&mut out, "Failed requests:", metrics.failed);
        if let Some(max_concurrency) = options.max_concurrency {
            int_row(&mut out, "Maximum request concurrency:", max_concurrency);
        }
        if options.request_rate.is_finite() {
            float_row(
                &mut out,
                "Request rate configured (RPS):",
                options.request_rate,
            );
        }
    }
    float_row(&mut out, "Benchmark duration (s):", duration);
    int_row(&mut out, "Total input tokens:", metrics.total_input);
    int_row(&mut out, "Total generated tokens:", metrics.total_output);
    float_row(
        &mut out,
        "Request throughput (req/s):",
        metrics.request_throughput,
    );
    if options.goodput {
        float_row(
            &mut out,
            "Request goodput (req/s):",
            metrics.request_goodput.unwrap_or(0.0),
        );
    }
    float_row(
        &mut out,
        "Output token throughput (tok/s):",
        metrics.output_throughput,
    );
    if new {
        float_row(
            &mut out,
            "Peak output token throughput (tok/s):",
            metrics.max_output_tokens_per_s,
        );
        // vLLM formats this integer with .2f, giving `512.00`.
        float_row(
            &mut out,
            "Peak concurrent requests:",
            metrics.max_concurrent_requests as f64,
        );
        float_row(
            &mut out,
            "Total token throughput (tok/s):",
            metrics.total_token_throughput,
        );
    } else {
        float_row(
            &mut out,
            "Total Token throughput (tok/s):",
            metrics.total_token_throughput,
        );
    }
    for kind in MetricKind::ALL {
        if !options.percentile_metrics.contains(&kind) {
            continue;
        }
        let stats = metrics.stats(kind);
        let name = kind.name();
        let _ = writeln!(out, "{:-^50}", kind.header());
        float_row(&mut out, &format!("Mean {name} (ms):"), stats.mean);
        float_row(&mut out, &format!("Median {name} (ms):"), stats.median);
        for (p, value) in &stats.percentiles {
            float_row(
                &mut out,
                &format!("P{} {name} (ms):", percentile_word(*p)),
                *value,
            );
        }
    }
    let _ = writeln!(out, "{}", "=".repeat(50));
    out
}

/// Python's `str(float)` for the few numbers that reach file names and JSON strings.
pub fn python_float(value: f64) -> String {
    if value.is_infinite() {
        if value > 0.0 { "inf" } else { "-inf" }.to_string()
    } else if value.fract() == 0.0 && value.abs() < 1e16 {
        format!("{value:.1}")
    } else {
        format!("{value}")
    }
}

/// Run-level facts that go into the result JSON besides the metrics.
#[derive(Debug, Clone)]
pub struct ResultHeader {
    /// `%Y%m%d-%H%M%S`, local time as vLLM's `datetime.now()` (UTC here, see [`timestamp`]).
    pub date: String,
    pub backend: String,
    pub label: Option<String>,
    pub model_id: String,
    pub tokenizer_id: String,
    pub num_prompts: usize,
    /// `--metadata KEY=VALUE` pairs, in order.
    pub metadata: Vec<(String, String)>,
    pub request_rate: f64,
    pub burstiness: f64,
    pub max_concurrency: Option<usize>,
}

/// Builds the result JSON with vLLM's keys in vLLM's order.
pub fn result_json(
    header: &ResultHeader,
    metrics: &BenchmarkMetrics,
    duration: f64,
    outputs: &[RequestOutput],
    output_lens: &[usize],
    percentile_metrics: &[MetricKind],
    save_detailed: bool,
) -> Value {
    let mut map = Map::new();
    map.insert("date".into(), json!(header.date));
    map.insert("endpoint_type".into(), json!(header.backend));
    map.insert("backend".into(), json!(header.backend));
    map.insert("label".into(), json!(header.label));
    map.insert("model_id".into(), json!(header.model_id));
    map.insert("tokenizer_id".into(), json!(header.tokenizer_id));
    map.insert("num_prompts".into(), json!(header.num_prompts));
    for (key, value) in &header.metadata {
        map.insert(key.clone(), json!(value));
    }
    let rate = if header.request_rate.is_finite() {
        json!(header.request_rate)
    } else {
        json!("inf")
    };
    map.insert("request_rate".into(), rate);
    let burstiness = if header.burstiness.is_finite() {
        json!(header.burstiness)
    } else {
        json!("inf")
    };
    map.insert("burstiness".into(), burstiness);
    map.insert("max_concurrency".into(), json!(header.max_concurrency));
    map.insert("duration".into(), json!(duration));
    map.insert("completed".into(), json!(metrics.completed));
    map.insert("failed".into(), json!(metrics.failed));
    map.insert("total_input_tokens".into(), json!(metrics.total_input));
    map.insert("total_output_tokens".into(), json!(metrics.total_output));
    map.insert(
        "request_throughput".into(),
        json!(metrics.request_throughput),
    );
    map.insert("request_goodput".into(), json!(metrics.request_goodput));
    map.insert("output_throughput".into(), json!(metrics.output_throughput));
    map.insert(
        "total_token_throughput".into(),
        json!(metrics.total_token_throughput),
    );
    if save_detailed {
        let input_lens: Vec<usize> = outputs.iter().map(|o| o.prompt_len).collect();
        let ttfts: Vec<f64> = outputs.iter().map(|o| o.ttft).collect();
        let itls: Vec<&Vec<f64>> = outputs.iter().map(|o| &o.itl).collect();
        let texts: Vec<&str> = outputs.iter().map(|o| o.generated_text.as_str()).collect();
        let errors: Vec<&str> = outputs.iter().map(|o| o.error.as_str()).collect();
        map.insert("input_lens".into(), json!(input_lens));
        map.insert("output_lens".into(), json!(output_lens));
        map.insert("ttfts".into(), json!(ttfts));
        map.insert("itls".into(), json!(itls));
        map.insert("generated_texts".into(), json!(texts));
        map.insert("errors".into(), json!(errors));
    }
    insert_server_accounting(&mut map, outputs);
    map.insert(
        "max_output_tokens_per_s".into(),
        json!(metrics.max_output_tokens_per_s),
    );
    map.insert(
        "max_concurrent_requests".into(),
        json!(metrics.max_concurrent_requests),
    );
    for kind in MetricKind::ALL {
        if !percentile_metrics.contains(&kind) {
            continue;
        }
        let stats = metrics.stats(kind);
        let key = kind.key();
        map.insert(format!("mean_{key}_ms"), json!(stats.mean));
        map.insert(format!("median_{key}_ms"), json!(stats.median));
        map.insert(format!("std_{key}_ms"), json!(stats.std));
        for (p, value) in &stats.percentiles {
            map.insert(format!("p{}_{key}_ms", percentile_word(*p)), json!(value));
        }
    }
    Value::Object(map)
}

/// tandem's additions, present only when at least one response carried server accounting
/// (so results against vLLM or TGI keep vLLM's exact keys): totals over the requests that
/// reported each count (null when none did) and per-request lists in dataset order (null
/// where a request reported nothing).
fn insert_server_accounting(map: &mut Map<String, Value>, outputs: &[RequestOutput]) {
    let reported = outputs
        .iter()
        .any(|o| o.cached_tokens.is_some() || o.kv_bytes.is_some() || o.kv_blocks.is_some());
    if !reported {
        return;
    }
    fn total(values: impl Iterator<Item = Option<u64>>) -> Value {
        values
            .flatten()
            .fold(None, |sum: Option<u64>, n| {
                Some(sum.unwrap_or(0).saturating_add(n))
            })
            .map_or(Value::Null, |n| json!(n))
    }
    let cached = || outputs.iter().map(|o| o.cached_tokens.map(|n| n as u64));
    map.insert("total_cached_tokens".into(), total(cached()));
    map.insert(
        "total_kv_bytes".into(),
        total(outputs.iter().map(|o| o.kv_bytes)),
    );
    map.insert(
        "total_kv_blocks".into(),
        total(outputs.iter().map(|o| o.kv_blocks)),
    );
    map.insert(
        "total_pulled_tokens".into(),
        total(outputs.iter().map(|o| o.pulled_tokens)),
    );
    map.insert("cached_tokens".into(), json!(cached().collect::<Vec<_>>()));
    let kv_bytes: Vec<Option<u64>> = outputs.iter().map(|o| o.kv_bytes).collect();
    map.insert("kv_bytes".into(), json!(kv_bytes));
}

/// vLLM's default result file name:
/// `{label|backend}-{rate}qps[-concurrency{N}]-{model basename}-{date}.json`.
pub fn default_result_filename(header: &ResultHeader) -> String {
    let label = header.label.as_deref().unwrap_or(&header.backend);
    let concurrency = header
        .max_concurrency
        .map(|n| format!("-concurrency{n}"))
        .unwrap_or_default();
    let model = header
        .model_id
        .rsplit('/')
        .next()
        .unwrap_or(&header.model_id);
    format!(
        "{label}-{}qps{concurrency}-{model}-{}.json",
        python_float(header.request_rate),
        header.date
    )
}

/// The current time as `%Y%m%d-%H%M%S` in UTC.
///
/// vLLM uses local time; the bench avoids a time-zone database and containers run on UTC.
pub fn timestamp(now: std::time::SystemTime) -> String {
    let secs = now
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = civil_from_days(days as i64);
    format!(
        "{year:04}{month:02}{day:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Howard Hinnant's days-to-civil conversion (proleptic Gregorian calendar).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_words_follow_python() {
        assert_eq!(percentile_word(99.0), "99");
        assert_eq!(percentile_word(50.0), "50");
        assert_eq!(percentile_word(99.9), "99.9");
        assert_eq!(percentile_word(0.5), "0.5");
    }

    #[test]
    fn python_floats_in_file_names() {
        assert_eq!(python_float(f64::INFINITY), "inf");
        assert_eq!(python_float(10.0), "10.0");
        assert_eq!(python_float(2.5), "2.5");
    }

    #[test]
    fn long_values_are_printed_whole() {
        let mut out = String::new();
        float_row(&mut out, "Total token throughput (tok/s):", 10_000_000.123);
        assert_eq!(
            out,
            format!("{:<40} 10000000.12\n", "Total token throughput (tok/s):")
        );
    }

    #[test]
    fn halfway_values_round_like_python() {
        let mut out = String::new();
        float_row(&mut out, "x", 0.125);
        float_row(&mut out, "y", 10.065);
        assert!(out.contains(" 0.12      \n"), "{out:?}");
        assert!(out.contains(" 10.06     \n"), "{out:?}");
    }

    #[test]
    fn timestamps_are_calendar_dates() {
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000);
        assert_eq!(timestamp(t), "20231114-221320");
        assert_eq!(timestamp(std::time::UNIX_EPOCH), "19700101-000000");
    }

    #[test]
    fn detailed_results_keep_per_request_lists() {
        let header = ResultHeader {
            date: "20250101-000000".into(),
            backend: "tgi".into(),
            label: Some("run".into()),
            model_id: "m".into(),
            tokenizer_id: "t".into(),
            num_prompts: 2,
            metadata: vec![("gpu".into(), "none".into())],
            request_rate: 4.0,
            burstiness: f64::INFINITY,
            max_concurrency: None,
        };
        let outputs = vec![
            RequestOutput {
                success: true,
                prompt_len: 3,
                ttft: 0.5,
                itl: vec![0.1],
                generated_text: "ab".into(),
                ..Default::default()
            },
            RequestOutput {
                prompt_len: 4,
                error: "Not Found".into(),
                ..Default::default()
            },
        ];
        let metrics = BenchmarkMetrics::default();
        let kinds = [MetricKind::Ttft];
        let json = result_json(&header, &metrics, 1.0, &outputs, &[2, 0], &kinds, true);
        assert_eq!(json["input_lens"], serde_json::json!([3, 4]));
        assert_eq!(json["output_lens"], serde_json::json!([2, 0]));
        assert_eq!(json["itls"], serde_json::json!([[0.1], []]));
        assert_eq!(json["errors"], serde_json::json!(["", "Not Found"]));
        assert_eq!(json["generated_texts"][0], "ab");
        assert_eq!(json["request_rate"], 4.0);
        assert_eq!(json["burstiness"], "inf");
        assert_eq!(json["gpu"], "none");
        assert!(json.get("mean_tpot_ms").is_none());
        let brief = result_json(&header, &metrics, 1.0, &outputs, &[2, 0], &kinds, false);
        assert!(brief.get("ttfts").is_none() && brief.get("errors").is_none());
        assert!(
            brief.get("p99_ttft_ms").is_none(),
            "no percentiles were computed"
        );
        assert!(
            brief.get("total_cached_tokens").is_none() && brief.get("kv_bytes").is_none(),
            "no server accounting, no tandem keys"
        );
    }

    #[test]
    fn server_accounting_is_totalled_and_listed_when_reported() {
        let header = ResultHeader {
            date: "20250101-000000".into(),
            backend: "openai".into(),
            label: None,
            model_id: "m".into(),
            tokenizer_id: "t".into(),
            num_prompts: 3,
            metadata: vec![],
            request_rate: f64::INFINITY,
            burstiness: 1.0,
            max_concurrency: None,
        };
        let outputs = vec![
            RequestOutput {
                success: true,
                cached_tokens: Some(3),
                kv_bytes: Some(4096),
                ..Default::default()
            },
            RequestOutput {
                success: true,
                cached_tokens: Some(5),
                kv_bytes: Some(1024),
                ..Default::default()
            },
            RequestOutput::default(),
        ];
        let metrics = BenchmarkMetrics::default();
        let json = result_json(&header, &metrics, 1.0, &outputs, &[1, 1, 0], &[], false);
        assert_eq!(json["total_cached_tokens"], 8);
        assert_eq!(json["total_kv_bytes"], 5120);
        assert_eq!(json["total_kv_blocks"], Value::Null);
        assert_eq!(json["total_pulled_tokens"], Value::Null);
        assert_eq!(json["cached_tokens"], json!([3, 5, null]));
        assert_eq!(json["kv_bytes"], json!([4096, 1024, null]));
        let keys: Vec<&String> = json.as_object().unwrap().keys().collect();
        let at = |k: &str| keys.iter().position(|x| *x == k).unwrap();
        assert!(at("total_token_throughput") < at("total_cached_tokens"));
        assert!(at("kv_bytes") < at("max_output_tokens_per_s"));
    }

    #[test]
    fn default_file_name_matches_vllm() {
        let header = ResultHeader {
            date: "20250101-000000".into(),
            backend: "openai".into(),
            label: None,
            model_id: "org/Model-7B".into(),
            tokenizer_id: "org/Model-7B".into(),
            num_prompts: 10,
            metadata: vec![],
            request_rate: f64::INFINITY,
            burstiness: 1.0,
            max_concurrency: Some(8),
        };
        assert_eq!(
            default_result_filename(&header),
            "openai-infqps-concurrency8-Model-7B-20250101-000000.json"
        );
    }
}
