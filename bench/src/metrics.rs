//! Metric math of vLLM's serving benchmark (`vllm/benchmarks/serve.py`, 0.13.0): per-request
//! outputs are aggregated into TTFT, TPOT (first token excluded), pooled ITL and E2EL
//! statistics, throughputs, goodput and the one-second-bucket peak metrics.
//!
//! Pure functions only: no I/O, no clock. Statistics follow numpy (`np.mean`, `np.median`,
//! `np.std` with ddof 0, `np.percentile` with the `linear` method), including numpy's rule
//! that an empty list becomes the scalar 0.

use std::collections::BTreeMap;

/// What one request produced, as vLLM's `RequestFuncOutput`. Times are in seconds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestOutput {
    /// Concatenation of the streamed text deltas (TGI: the final `generated_text`).
    pub generated_text: String,
    /// HTTP 200 and (for most backends) at least one token event.
    pub success: bool,
    /// Seconds from just before the POST to the last token event.
    pub latency: f64,
    /// `usage.completion_tokens` when the server reported it; `None` means re-tokenize.
    pub output_tokens: Option<usize>,
    /// Seconds from just before the POST to the first token event.
    pub ttft: f64,
    /// Gaps between consecutive token events.
    pub itl: Vec<f64>,
    /// The client-side prompt length of the sample.
    pub prompt_len: usize,
    /// vLLM's error text; empty on success.
    pub error: String,
    /// When the POST was about to be sent, in seconds on the benchmark's monotonic clock.
    pub start_time: f64,
    /// `usage.prompt_tokens` when the server reported it (the block keeps vLLM's client-side
    /// `prompt_len`; multi-turn uses this for later turns).
    pub server_prompt_tokens: Option<usize>,
    /// Prompt tokens the server took from its prefix cache:
    /// `usage.prompt_tokens_details.cached_tokens`, else tandem's `usage.tandem.cached_tokens`.
    pub cached_tokens: Option<usize>,
    /// tandem: bytes of KV moved from the prefill to the decode worker (`usage.tandem.kv_bytes`).
    pub kv_bytes: Option<u64>,
    /// tandem: KV blocks moved from the prefill to the decode worker (`usage.tandem.kv_blocks`).
    pub kv_blocks: Option<u64>,
    /// tandem: of `cached_tokens`, those the prefill worker read back from the decode worker
    /// rather than found in its own cache (`usage.tandem.prefill_pulled_tokens`).
    pub pulled_tokens: Option<u64>,
    /// tandem's description of how the request ran, when the server sent a `tandem` object.
    pub tandem: Option<TandemRun>,
}

/// The descriptive part of tandem's `usage.tandem` object; every field is optional because
/// servers other than tandem's router send none of it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TandemRun {
    /// `disaggregated` or `aggregated`.
    pub mode: Option<String>,
    /// How KV travelled (e.g. `shm`), when it did.
    pub transport: Option<String>,
    /// Why a disaggregated request fell back to aggregated serving.
    pub fallback_reason: Option<String>,
}

/// Which latency a section or an SLO is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MetricKind {
    Ttft,
    Tpot,
    Itl,
    E2el,
}

impl MetricKind {
    /// All kinds in the fixed print order.
    pub const ALL: [MetricKind; 4] = [Self::Ttft, Self::Tpot, Self::Itl, Self::E2el];

    /// The key used on the command line and in JSON keys (`ttft`, `tpot`, `itl`, `e2el`).
    pub fn key(self) -> &'static str {
        match self {
            Self::Ttft => "ttft",
            Self::Tpot => "tpot",
            Self::Itl => "itl",
            Self::E2el => "e2el",
        }
    }

    /// The short name in row labels (`Mean TTFT (ms):`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Ttft => "TTFT",
            Self::Tpot => "TPOT",
            Self::Itl => "ITL",
            Self::E2el => "E2EL",
        }
    }

    /// The section header text.
    pub fn header(self) -> &'static str {
        match self {
            Self::Ttft => "Time to First Token",
            Self::Tpot => "Time per Output Token (excl. 1st token)",
            Self::Itl => "Inter-token Latency",
            Self::E2el => "End-to-end Latency",
        }
    }

    /// Parses `ttft`/`tpot`/`itl`/`e2el`.
    pub fn from_key(key: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|kind| kind.key() == key)
    }
}

/// Mean, median, std and the requested percentiles of one metric, in milliseconds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    pub mean: f64,
    pub median: f64,
    pub std: f64,
    /// `(p, value)` in the order `--metric-percentiles` gave them.
    pub percentiles: Vec<(f64, f64)>,
}

impl Stats {
    /// Statistics of `values_s` (seconds), reported in milliseconds, numpy-style.
    pub fn from_seconds(values_s: &[f64], percentiles: &[f64]) -> Self {
        let mut sorted: Vec<f64> = if values_s.is_empty() {
            // numpy is handed `values or 0`: an empty list becomes the scalar 0.
            vec![0.0]
        } else {
            values_s.to_vec()
        };
        sorted.sort_by(f64::total_cmp);
        let mean = mean(&sorted);
        Stats {
            mean: mean * 1000.0,
            median: percentile_sorted(&sorted, 50.0) * 1000.0,
            std: population_std(&sorted, mean) * 1000.0,
            percentiles: percentiles
                .iter()
                .map(|&p| (p, percentile_sorted(&sorted, p) * 1000.0))
                .collect(),
        }
    }
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len() as f64
}

fn population_std(values: &[f64], mean: f64) -> f64 {
    let variance =
        values.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / values.len() as f64;
    variance.sqrt()
}

/// numpy's `percentile(..., method="linear")` on already sorted, non-empty values.
/// Returns 0 for an empty slice, as numpy does for `[] or 0`.
pub fn percentile_sorted(sorted: &[f64], p: f64) -> f64 {
    let Some(&last) = sorted.last() else {
        return 0.0;
    };
    let n = sorted.len();
    let pos = (n - 1) as f64 * p / 100.0;
    let lo = (pos.floor() as usize).min(n - 1);
    let g = pos - lo as f64;
    let a = sorted[lo];
    let b = sorted.get(lo + 1).copied().unwrap_or(last);
    // numpy's `_lerp` evaluates from the nearer end to stay monotonic.
    if g < 0.5 {
        a + (b - a) * g
    } else {
        b - (b - a) * (1.0 - g)
    }
}

/// numpy-style percentile of unsorted values (sorts a copy).
pub fn percentile(values: &[f64], p: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    percentile_sorted(&sorted, p)
}

/// How the peak concurrency is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PeakMethod {
    /// vLLM 0.11+: one-second buckets, a request occupies every second it touches.
    #[default]
    Buckets,
    /// The exact sweep-line proposed upstream: (start,+1)/(end,−1), departures first on ties.
    SweepLine,
}

/// Everything the block and the result JSON report, as vLLM's `BenchmarkMetrics`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BenchmarkMetrics {
    pub completed: usize,
    pub failed: usize,
    pub total_input: usize,
    pub total_output: usize,
    pub request_throughput: f64,
    /// `Some` only when `--goodput` was given.
    pub request_goodput: Option<f64>,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    /// Per metric kind, statistics in milliseconds.
    pub stats: BTreeMap<MetricKind, Stats>,
    pub max_output_tokens_per_s: f64,
    pub max_concurrent_requests: usize,
}

impl BenchmarkMetrics {
    /// The statistics of `kind` (all zero if it was never computed).
    pub fn stats(&self, kind: MetricKind) -> Stats {
        self.stats.get(&kind).cloned().unwrap_or_default()
    }
}

/// Service-level objectives for goodput, in milliseconds, as `--goodput ttft:300 tpot:50`.
///
/// Beyond vLLM's keys, `ttft_per_token:MS` makes the TTFT limit grow with the request's prompt
/// (`ttft + ttft_per_token × prompt tokens`), the form a serving plane's TTFT targets take
/// (tandem's `[router.slo]`): with prompts of mixed lengths, or turns whose prompts carry a
/// growing conversation, one fixed TTFT would be too strict for the long ones or too loose
/// for the short.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GoodputSlos {
    /// Each metric's limit (`ttft` the fixed part when `ttft_per_token_ms` is set).
    limits: BTreeMap<MetricKind, f64>,
    /// Milliseconds the TTFT limit gains per prompt token (`None`: a fixed limit).
    ttft_per_token_ms: Option<f64>,
}

impl GoodputSlos {
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether no objective was given (goodput not requested).
    pub fn is_empty(&self) -> bool {
        self.limits.is_empty() && self.ttft_per_token_ms.is_none()
    }

    /// The limit of `kind`, in ms, for a request of `prompt_len` tokens (`None`: no limit).
    pub fn limit(&self, kind: MetricKind, prompt_len: usize) -> Option<f64> {
        let fixed = self.limits.get(&kind).copied();
        match self.ttft_per_token_ms {
            Some(per_token) if kind == MetricKind::Ttft => {
                Some(fixed.unwrap_or(0.0) + per_token * prompt_len as f64)
            }
            _ => fixed,
        }
    }

    /// Whether a request of `prompt_len` tokens with these values (seconds) meets every
    /// objective.
    fn met(&self, prompt_len: usize, ttft: f64, tpot: f64, e2el: f64) -> bool {
        [
            (MetricKind::Ttft, ttft),
            (MetricKind::Tpot, tpot),
            (MetricKind::E2el, e2el),
        ]
        .into_iter()
        .all(|(kind, value)| {
            self.limit(kind, prompt_len)
                .is_none_or(|limit_ms| value <= limit_ms / 1000.0)
        })
    }
}

/// Inputs of [`calculate_metrics`] that are not per-request outputs.
#[derive(Debug, Clone)]
pub struct MetricsOptions<'a> {
    /// Seconds, from the first dispatch to the last response (§2.4).
    pub duration: f64,
    /// `--metric-percentiles`.
    pub percentiles: &'a [f64],
    /// `--goodput`; empty means not requested.
    pub goodput: &'a GoodputSlos,
    pub peak_method: PeakMethod,
}

/// Aggregates per-request outputs exactly as vLLM's `calculate_metrics`.
///
/// `prompt_lens[i]` is the dataset's count for request i; `count_tokens` re-tokenizes a
/// generated text without special tokens when the server reported no usage. Returns the
/// metrics and the per-request output lengths (0 for failures), the JSON's `output_lens`.
pub fn calculate_metrics(
    outputs: &[RequestOutput],
    count_tokens: &dyn Fn(&str) -> usize,
    options: &MetricsOptions<'_>,
) -> (BenchmarkMetrics, Vec<usize>) {
    let mut output_lens = Vec::with_capacity(outputs.len());
    let (mut completed, mut failed, mut total_input) = (0usize, 0usize, 0usize);
    let mut ttfts = Vec::new();
    let mut tpots = Vec::new();
    let mut all_tpots = Vec::new();
    let mut itls = Vec::new();
    let mut e2els = Vec::new();
    // Completed requests' prompt lengths, for TTFT limits that grow with the prompt.
    let mut prompt_lens = Vec::new();
    for output in outputs {
        if !output.success {
            output_lens.push(0);
            failed += 1;
            continue;
        }
        let output_len = match output.output_tokens {
            Some(n) if n > 0 => n,
            _ => count_tokens(&output.generated_text),
        };
        output_lens.push(output_len);
        total_input += output.prompt_len;
        prompt_lens.push(output.prompt_len);
        let mut tpot = 0.0;
        if output_len > 1 {
            tpot = (output.latency - output.ttft) / (output_len - 1) as f64;
            tpots.push(tpot);
        }
        // A one-token output counts as TPOT 0 for goodput.
        all_tpots.push(tpot);
        itls.extend_from_slice(&output.itl);
        ttfts.push(output.ttft);
        e2els.push(output.latency);
        completed += 1;
    }
    if completed == 0 {
        tracing::warn!(
            "All requests failed. This is likely due to a misconfiguration on the benchmark arguments."
        );
    }

    let request_goodput = (!options.goodput.is_empty()).then(|| {
        let good = (0..completed)
            .filter(|&i| {
                options
                    .goodput
                    .met(prompt_lens[i], ttfts[i], all_tpots[i], e2els[i])
            })
            .count();
        good as f64 / options.duration
    });

    let total_output: usize = output_lens.iter().sum();
    let (max_output_tokens_per_s, max_concurrent_requests) =
        peak_metrics(outputs, options.peak_method);
    let stats = [
        (MetricKind::Ttft, &ttfts),
        (MetricKind::Tpot, &tpots),
        (MetricKind::Itl, &itls),
        (MetricKind::E2el, &e2els),
    ]
    .into_iter()
    .map(|(kind, values)| (kind, Stats::from_seconds(values, options.percentiles)))
    .collect();
    let metrics = BenchmarkMetrics {
        completed,
        failed,
        total_input,
        total_output,
        request_throughput: completed as f64 / options.duration,
        request_goodput,
        output_throughput: total_output as f64 / options.duration,
        total_token_throughput: (total_input + total_output) as f64 / options.duration,
        stats,
        max_output_tokens_per_s,
        max_concurrent_requests,
    };
    (metrics, output_lens)
}

/// Peak output-token events per second and peak concurrent requests (vLLM 0.11+).
///
/// Token buckets count token *events* (SSE chunks), not usage tokens, as upstream does.
pub fn peak_metrics(outputs: &[RequestOutput], method: PeakMethod) -> (f64, usize) {
    let successful: Vec<&RequestOutput> = outputs.iter().filter(|o| o.success).collect();
    if successful.is_empty() {
        return (0.0, 0);
    }
    let t0 = successful
        .iter()
        .map(|o| o.start_time)
        .fold(f64::INFINITY, f64::min);
    let t_end = successful
        .iter()
        .map(|o| o.start_time + o.latency)
        .fold(f64::NEG_INFINITY, f64::max);
    let buckets = (t_end - t0).ceil().max(0.0) as usize + 1;
    let mut tokens = vec![0u64; buckets];
    let mut concurrent = vec![0u64; buckets];
    for output in &successful {
        let mut token_time = output.start_time + output.ttft;
        let mut add_token = |ts: f64| {
            let bucket = (ts - t0).trunc();
            if bucket >= 0.0 && (bucket as usize) < buckets {
                tokens[bucket as usize] += 1;
            }
        };
        add_token(token_time);
        for gap in &output.itl {
            token_time += gap;
            add_token(token_time);
        }
        let first = (output.start_time - t0).trunc().max(0.0) as usize;
        let last = (output.start_time + output.latency - t0).trunc().max(0.0) as usize;
        for slot in concurrent
            .iter_mut()
            .take(last.min(buckets - 1) + 1)
            .skip(first)
        {
            *slot += 1;
        }
    }
    let peak_tokens = tokens.iter().copied().max().unwrap_or(0) as f64;
    let peak_concurrency = match method {
        PeakMethod::Buckets => concurrent.iter().copied().max().unwrap_or(0) as usize,
        PeakMethod::SweepLine => sweep_line_peak(&successful),
    };
    (peak_tokens, peak_concurrency)
}

/// Exact peak of simultaneously open requests: departures sort before arrivals on ties.
fn sweep_line_peak(outputs: &[&RequestOutput]) -> usize {
    let mut events: Vec<(f64, i64)> = outputs
        .iter()
        .flat_map(|o| [(o.start_time, 1), (o.start_time + o.latency, -1)])
        .collect();
    events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let (mut open, mut peak) = (0i64, 0i64);
    for (_, delta) in events {
        open += delta;
        peak = peak.max(open);
    }
    peak.max(0) as usize
}

/// Parses `--goodput` arguments (`ttft:300 tpot:50`), with vLLM's validation, and tandem's
/// `ttft_per_token:MS` (see [`GoodputSlos`]).
pub fn parse_goodput(items: &[String]) -> Result<GoodputSlos, String> {
    let mut slos = GoodputSlos::new();
    for item in items {
        let (key, value) = item.split_once(':').ok_or_else(|| {
            "Invalid format found for service level objectives. Specify service level objectives for goodput as \"KEY:VALUE\" pairs, where the key is a metric name, and the value is a number in milliseconds.".to_string()
        })?;
        let key = key.trim();
        let per_token = key == "ttft_per_token";
        let kind = MetricKind::from_key(key).filter(|k| *k != MetricKind::Itl);
        if kind.is_none() && !per_token {
            return Err(format!(
                "Invalid metric name found, {key}. The service level objective name should be one of ttft, tpot, e2el (or ttft_per_token)."
            ));
        }
        let value: f64 = value
            .trim()
            .parse()
            .map_err(|_| format!("Invalid value found for {key}: {value}"))?;
        // vLLM's check, and a per-token limit must be finite to add up.
        if value < 0.0 || value.is_nan() || (per_token && value.is_infinite()) {
            return Err(format!(
                "Invalid value found, {key}: {value}. The service level objective value should be non-negative (and finite for ttft_per_token)."
            ));
        }
        match kind {
            Some(kind) => {
                slos.limits.insert(kind, value);
            }
            None => slos.ttft_per_token_ms = Some(value),
        }
    }
    Ok(slos)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(start: f64, ttft: f64, itl: &[f64], tokens: Option<usize>) -> RequestOutput {
        RequestOutput {
            success: true,
            start_time: start,
            ttft,
            latency: ttft + itl.iter().sum::<f64>(),
            itl: itl.to_vec(),
            output_tokens: tokens,
            prompt_len: 10,
            ..Default::default()
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn percentile_matches_numpy_linear() {
        // np.percentile([1,2,3,4], [0,25,50,99,100]) = 1, 1.75, 2.5, 3.97, 4
        let v = [4.0, 1.0, 3.0, 2.0];
        assert!(close(percentile(&v, 0.0), 1.0));
        assert!(close(percentile(&v, 25.0), 1.75));
        assert!(close(percentile(&v, 50.0), 2.5));
        assert!(close(percentile(&v, 99.0), 3.97));
        assert!(close(percentile(&v, 100.0), 4.0));
        // np.percentile([10, 20, 40], 90) = 36.0
        assert!(close(percentile(&[10.0, 20.0, 40.0], 90.0), 36.0));
    }

    #[test]
    fn percentile_of_one_value_and_of_nothing() {
        assert!(close(percentile(&[0.25], 99.0), 0.25));
        assert!(close(percentile(&[0.25], 0.0), 0.25));
        assert_eq!(percentile(&[], 99.0), 0.0);
        let stats = Stats::from_seconds(&[], &[50.0, 99.0]);
        assert_eq!(stats.mean, 0.0);
        assert_eq!(stats.median, 0.0);
        assert_eq!(stats.std, 0.0);
        assert_eq!(stats.percentiles, vec![(50.0, 0.0), (99.0, 0.0)]);
    }

    #[test]
    fn stats_are_in_milliseconds_with_population_std() {
        // np.std([0.1, 0.2, 0.3, 0.4]) = 0.1118033988749895
        let stats = Stats::from_seconds(&[0.3, 0.1, 0.4, 0.2], &[99.0]);
        assert!(close(stats.mean, 250.0));
        assert!(close(stats.median, 250.0));
        assert!((stats.std - 111.803_398_874_989_5).abs() < 1e-9);
        assert!(close(stats.percentiles[0].1, 397.0));
    }

    fn options<'a>(duration: f64, goodput: &'a GoodputSlos) -> MetricsOptions<'a> {
        MetricsOptions {
            duration,
            percentiles: &[99.0],
            goodput,
            peak_method: PeakMethod::Buckets,
        }
    }

    #[test]
    fn tpot_excludes_first_token_and_skips_one_token_outputs() {
        let outputs = vec![
            // 5 tokens: ttft 0.1 then 4 gaps of 0.02 -> tpot = 0.08 / 4 = 0.02
            ok(0.0, 0.1, &[0.02; 4], Some(5)),
            // one-token output (prefill-only): no TPOT sample, no ITL
            ok(0.0, 0.3, &[], Some(1)),
        ];
        let none = GoodputSlos::new();
        let (m, lens) = calculate_metrics(&outputs, &|_| 0, &options(2.0, &none));
        assert_eq!(lens, vec![5, 1]);
        let tpot = m.stats(MetricKind::Tpot);
        assert!(close(tpot.mean, 20.0), "tpot mean {}", tpot.mean);
        assert!(close(tpot.percentiles[0].1, 20.0));
        let itl = m.stats(MetricKind::Itl);
        assert!(close(itl.mean, 20.0));
        let ttft = m.stats(MetricKind::Ttft);
        assert!(close(ttft.mean, 200.0));
        assert!(close(ttft.median, 200.0));
        assert_eq!(m.total_output, 6);
        assert!(close(m.output_throughput, 3.0));
    }

    #[test]
    fn prefill_only_run_reports_zero_tpot_and_itl() {
        let outputs: Vec<_> = (0..4)
            .map(|i| ok(0.0, 0.1 * (i + 1) as f64, &[], Some(1)))
            .collect();
        let none = GoodputSlos::new();
        let (m, _) = calculate_metrics(&outputs, &|_| 0, &options(1.0, &none));
        assert_eq!(m.stats(MetricKind::Tpot), Stats::from_seconds(&[], &[99.0]));
        assert_eq!(m.stats(MetricKind::Itl).mean, 0.0);
        assert!(m.stats(MetricKind::Ttft).mean > 0.0);
    }

    #[test]
    fn failed_requests_are_excluded_everywhere_but_output_lens() {
        let mut failed = ok(0.0, 9.0, &[9.0], Some(99));
        failed.success = false;
        failed.error = "Internal Server Error".into();
        let outputs = vec![ok(0.0, 0.1, &[0.1], Some(2)), failed];
        let none = GoodputSlos::new();
        let (m, lens) = calculate_metrics(&outputs, &|_| 0, &options(1.0, &none));
        assert_eq!(lens, vec![2, 0]);
        assert_eq!((m.completed, m.failed), (1, 1));
        assert_eq!(m.total_input, 10);
        assert!(close(m.stats(MetricKind::Ttft).mean, 100.0));
        assert!(close(m.stats(MetricKind::E2el).mean, 200.0));
        assert!(close(m.request_throughput, 1.0));
        assert!(close(m.total_token_throughput, 12.0));
    }

    #[test]
    fn missing_usage_falls_back_to_retokenizing_the_text() {
        let mut out = ok(0.0, 0.1, &[0.1, 0.1], None);
        out.generated_text = "a b c d".into();
        let none = GoodputSlos::new();
        let count = |text: &str| text.split_whitespace().count();
        let (m, lens) = calculate_metrics(&[out], &count, &options(1.0, &none));
        assert_eq!(lens, vec![4]);
        // tpot = (0.3 - 0.1) / 3
        assert!(close(m.stats(MetricKind::Tpot).mean, 200.0 / 3.0));
    }

    #[test]
    fn all_failed_gives_zero_statistics() {
        let mut out = ok(0.0, 0.1, &[], Some(1));
        out.success = false;
        let none = GoodputSlos::new();
        let (m, _) = calculate_metrics(&[out], &|_| 0, &options(1.0, &none));
        assert_eq!(m.completed, 0);
        assert_eq!(m.stats(MetricKind::Ttft).mean, 0.0);
        assert_eq!(
            (m.max_output_tokens_per_s, m.max_concurrent_requests),
            (0.0, 0)
        );
    }

    #[test]
    fn peak_buckets_count_token_events_per_second() {
        // Request A: starts 0.0, tokens at 0.5, 0.9, 1.2 (latency 1.2).
        // Request B: starts 0.8, tokens at 1.1, 1.3, 2.4 (latency 1.6, ends 2.4).
        let a = ok(0.0, 0.5, &[0.4, 0.3], Some(3));
        let b = ok(0.8, 0.3, &[0.2, 1.1], Some(3));
        let (tokens, concurrency) = peak_metrics(&[a.clone(), b.clone()], PeakMethod::Buckets);
        // buckets: [0.5, 0.9] -> 2; [1.2, 1.1, 1.3] -> 3; [2.4] -> 1
        assert_eq!(tokens, 3.0);
        // A covers seconds 0..=1, B covers 0..=2 -> bucket 0 and 1 both hold 2.
        assert_eq!(concurrency, 2);
        assert_eq!(peak_metrics(&[a, b], PeakMethod::SweepLine).1, 2);
    }

    #[test]
    fn sweep_line_does_not_count_back_to_back_requests_as_overlapping() {
        // A ends exactly when B starts; buckets count both in second 0, the sweep does not.
        let a = ok(0.0, 0.2, &[0.2], Some(2));
        let b = ok(0.4, 0.2, &[0.2], Some(2));
        assert_eq!(
            peak_metrics(&[a.clone(), b.clone()], PeakMethod::Buckets).1,
            2
        );
        assert_eq!(peak_metrics(&[a, b], PeakMethod::SweepLine).1, 1);
    }

    #[test]
    fn goodput_counts_requests_within_every_slo() {
        let outputs = vec![
            ok(0.0, 0.1, &[0.01; 4], Some(5)), // ttft 100 ms, tpot 10 ms
            ok(0.0, 0.5, &[0.01; 4], Some(5)), // ttft 500 ms: bad
            ok(0.0, 0.1, &[0.1; 4], Some(5)),  // tpot 100 ms: bad
            ok(0.0, 0.2, &[], Some(1)),        // one token: tpot counts as 0, good
        ];
        let slos = parse_goodput(&["ttft:300".into(), "tpot:50".into()]).unwrap();
        let (m, _) = calculate_metrics(&outputs, &|_| 0, &options(2.0, &slos));
        assert_eq!(m.request_goodput, Some(1.0));
        let none = GoodputSlos::new();
        let (m, _) = calculate_metrics(&outputs, &|_| 0, &options(2.0, &none));
        assert_eq!(m.request_goodput, None);
    }

    #[test]
    fn goodput_parsing_rejects_bad_keys_and_values() {
        assert!(parse_goodput(&["ttft".into()]).is_err());
        assert!(parse_goodput(&["itl:5".into()]).is_err());
        assert!(parse_goodput(&["ttft:-1".into()]).is_err());
        assert!(parse_goodput(&["ttft:abc".into()]).is_err());
        assert!(parse_goodput(&["ttft_per_token:inf".into()]).is_err());
        assert!(parse_goodput(&["tpot_per_token:1".into()]).is_err());
        let slos = parse_goodput(&["e2el:1000".into()]).unwrap();
        assert_eq!(slos.limit(MetricKind::E2el, 7), Some(1000.0));
        assert_eq!(slos.limit(MetricKind::Ttft, 7), None);
    }

    #[test]
    fn a_ttft_limit_per_prompt_token_follows_each_prompt() {
        let mut short = ok(0.0, 0.5, &[0.01; 4], Some(5));
        short.prompt_len = 100;
        let mut long = ok(0.0, 2.5, &[0.01; 4], Some(5));
        long.prompt_len = 2000;
        let mut too_slow = ok(0.0, 2.5, &[0.01; 4], Some(5));
        too_slow.prompt_len = 100;
        let outputs = vec![short, long, too_slow];
        // 1000 ms + 1.5 ms a token: 1150 ms for 100 tokens, 4000 ms for 2000.
        let slos = parse_goodput(&[
            "ttft:1000".into(),
            "ttft_per_token:1.5".into(),
            "tpot:50".into(),
        ])
        .unwrap();
        assert_eq!(slos.limit(MetricKind::Ttft, 2000), Some(4000.0));
        let (m, _) = calculate_metrics(&outputs, &|_| 0, &options(1.0, &slos));
        assert_eq!(m.request_goodput, Some(2.0));
        // Alone, the per-token part is the whole limit: 2600 ms for the long prompt only.
        let slos = parse_goodput(&["ttft_per_token:1.3".into()]).unwrap();
        assert!(!slos.is_empty());
        let (m, _) = calculate_metrics(&outputs, &|_| 0, &options(1.0, &slos));
        assert_eq!(m.request_goodput, Some(1.0));
    }
}
