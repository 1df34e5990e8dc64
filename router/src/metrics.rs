//! Every metric the router exports, named in one place (`tandem_router_<what>_<unit>`,
//! Dynamo `prometheus_names.rs` style), plus the Prometheus recorder behind `GET /metrics`.
//!
//! The `metrics` crate has one process-wide recorder. The router installs a Prometheus
//! recorder once per process and every router started in that process (tests start many)
//! shares it; if some other component already installed a recorder, the router logs a warning
//! and its `/metrics` shows only the metrics described here with no samples.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Time from request arrival to the first token received from the decode worker, by mode.
pub const TTFT_SECONDS: &str = "tandem_router_ttft_seconds";
/// Gap between consecutive tokens of one request, by mode.
pub const ITL_SECONDS: &str = "tandem_router_itl_seconds";
/// Time from request arrival to the end of its generation, by mode and outcome.
pub const E2E_SECONDS: &str = "tandem_router_e2e_latency_seconds";
/// Requests waiting for a running slot.
pub const QUEUE_DEPTH: &str = "tandem_router_queue_depth";
/// Seconds each request waited for a running slot, by `outcome`: `admitted`, or `refused`
/// after `--max-queue-wait-ms`.
pub const QUEUE_SECONDS: &str = "tandem_router_queue_seconds";
/// Requests holding a running slot.
pub const IN_FLIGHT: &str = "tandem_router_in_flight_requests";
/// Finished requests, by `mode` (disaggregated, aggregated, none) and `outcome`.
pub const REQUESTS_TOTAL: &str = "tandem_router_requests_total";
/// Requests that ran aggregated although disaggregation was wanted, by `reason`.
pub const FALLBACKS_TOTAL: &str = "tandem_router_fallbacks_total";
/// Prefill calls retried on another prefill worker.
pub const PREFILL_RETRIES_TOTAL: &str = "tandem_router_prefill_retries_total";
/// KV bytes moved from prefill to decode workers, by `transport` (from PrefillResponse).
pub const KV_TRANSFER_BYTES_TOTAL: &str = "tandem_router_kv_transfer_bytes_total";
/// KV bytes prefill workers read back from decode workers' cached prefixes (PullKv) instead
/// of computing them.
pub const KV_PULLED_BYTES_TOTAL: &str = "tandem_router_kv_pulled_bytes_total";
/// Disaggregated requests the decode worker ran itself because its prefix cache held all
/// but a suffix shorter than `--agg-threshold`.
pub const LOCAL_PREFILLS_TOTAL: &str = "tandem_router_local_prefills_total";
/// Seconds each KV transfer took, by `transport` (from PrefillResponse).
pub const KV_TRANSFER_SECONDS: &str = "tandem_router_kv_transfer_seconds";
/// Seconds from lease to verified commit as the decode worker saw it, by `transport`.
pub const KV_WAIT_SECONDS: &str = "tandem_router_kv_wait_seconds";
/// 1 when a worker is healthy and routable, else 0; by `worker` (URL) and `role`.
pub const WORKER_HEALTHY: &str = "tandem_router_worker_healthy";
/// KV blocks in use on a worker, by `worker` and `role` (from GetLoad).
pub const WORKER_KV_BLOCKS_IN_USE: &str = "tandem_router_worker_kv_blocks_in_use";
/// KV blocks a worker has in all, by `worker` and `role` (from GetLoad).
pub const WORKER_KV_BLOCKS_TOTAL: &str = "tandem_router_worker_kv_blocks_total";
/// Prompt tokens queued on a prefill worker, by `worker` (from GetLoad).
pub const WORKER_QUEUED_PREFILL_TOKENS: &str = "tandem_router_worker_queued_prefill_tokens";
/// Per worker, from its load reports: its prefix cache's prompt tokens looked up and found,
/// blocks evicted, and blocks cached now.
pub const WORKER_PREFIX_QUERY_TOKENS: &str = "tandem_router_worker_prefix_query_tokens_total";
pub const WORKER_PREFIX_HIT_TOKENS: &str = "tandem_router_worker_prefix_hit_tokens_total";
pub const WORKER_PREFIX_EVICTIONS: &str = "tandem_router_worker_prefix_evictions_total";
pub const WORKER_CACHED_BLOCKS: &str = "tandem_router_worker_cached_blocks";
/// Workers in the pool, by `role`: listed URLs plus the addresses DNS entries resolve to
/// now, each distinct URL counted once, healthy or not.
pub const DISCOVERED_WORKERS: &str = "tandem_router_discovered_workers";
/// Prompt and completion tokens of finished requests, by `kind`.
pub const TOKENS_TOTAL: &str = "tandem_router_tokens_total";
/// Client connections open now.
pub const OPEN_CONNECTIONS: &str = "tandem_router_open_connections";
/// Client connections closed on arrival because `--max-connections` were open.
pub const CONNECTIONS_REFUSED_TOTAL: &str = "tandem_router_connections_refused_total";
/// SSE keep-alive comments sent on streams that had nothing else to send.
pub const SSE_KEEPALIVES_TOTAL: &str = "tandem_router_sse_keepalives_total";

/// The deployment's latency targets, by target (`ttft`, `ttft_per_token`, `tpot`).
pub const SLO_TARGET_MS: &str = "tandem_router_slo_target_ms";
/// Finished requests by target (`ttft`, `tpot`) and whether they met it (`yes`, `no`).
pub const SLO_REQUESTS_TOTAL: &str = "tandem_router_slo_requests_total";
/// How close each side (`role`: prefill, decode) runs to its targets: a running average of
/// measured over target (above 1: missing them); the autoscalers' signal.
pub const SLO_PRESSURE: &str = "tandem_router_slo_pressure";
/// Requests SLO placement placed, by placement and whether the prediction met both targets.
pub const PLACEMENTS_TOTAL: &str = "tandem_router_placements_total";
/// Prompt tokens of split prompts, by the `side` (prefill, decode) that computed them.
pub const SPLIT_PROMPT_TOKENS_TOTAL: &str = "tandem_router_split_prompt_tokens_total";
/// Compute threads the elastic thread planner gives each worker (`--elastic-threads`).
pub const COMPUTE_THREADS: &str = "tandem_router_compute_threads";
/// The planner's moves of compute threads, by the `role` of the worker whose count changed.
pub const COMPUTE_THREAD_MOVES_TOTAL: &str = "tandem_router_compute_thread_moves_total";
/// |predicted − measured| / measured of SLO placement's predictions, by metric and placement.
pub const PREDICTION_ERROR: &str = "tandem_router_placement_prediction_error";

/// Histogram buckets (seconds) shared by the latency metrics: 1 ms to 5 minutes.
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
];

/// Buckets (seconds) of the queue wait: finer around the usual `--max-queue-wait-ms` values,
/// so an operator reads the bound's percentile off them.
const QUEUE_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 15.0, 20.0,
    30.0, 60.0, 120.0, 300.0, 600.0,
];

/// Buckets of relative prediction errors: 2 % to 5 times off.
const ERROR_BUCKETS: &[f64] = &[0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// The process-wide Prometheus handle, installing the recorder on first use.
pub fn prometheus() -> PrometheusHandle {
    HANDLE.get_or_init(install).clone()
}

fn install() -> PrometheusHandle {
    let builder = match PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
        .and_then(|b| {
            b.set_buckets_for_metric(Matcher::Full(PREDICTION_ERROR.into()), ERROR_BUCKETS)
        })
        .and_then(|b| b.set_buckets_for_metric(Matcher::Full(QUEUE_SECONDS.into()), QUEUE_BUCKETS))
    {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!(error = %e, "invalid histogram buckets; using summaries");
            PrometheusBuilder::new()
        }
    };
    let recorder = builder.build_recorder();
    let handle = recorder.handle();
    if metrics::set_global_recorder(recorder).is_err() {
        tracing::warn!("a metrics recorder is already installed; /metrics will show no samples");
    }
    describe();
    handle
}

fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_histogram!(TTFT_SECONDS, Unit::Seconds, "Time to first token, by mode");
    describe_histogram!(ITL_SECONDS, Unit::Seconds, "Inter-token latency, by mode");
    describe_histogram!(E2E_SECONDS, Unit::Seconds, "End-to-end request latency");
    describe_gauge!(QUEUE_DEPTH, "Requests waiting for a running slot");
    describe_histogram!(
        QUEUE_SECONDS,
        Unit::Seconds,
        "Time each request waited for a running slot, by outcome (admitted, refused)"
    );
    describe_gauge!(IN_FLIGHT, "Requests holding a running slot");
    describe_counter!(REQUESTS_TOTAL, "Finished requests by mode and outcome");
    describe_counter!(
        FALLBACKS_TOTAL,
        "Requests run aggregated instead of disaggregated"
    );
    describe_counter!(
        PREFILL_RETRIES_TOTAL,
        "Prefill calls retried on another worker"
    );
    describe_counter!(KV_TRANSFER_BYTES_TOTAL, Unit::Bytes, "KV bytes moved");
    describe_counter!(
        KV_PULLED_BYTES_TOTAL,
        Unit::Bytes,
        "KV bytes prefill workers read back from decode workers' cached prefixes"
    );
    describe_counter!(
        LOCAL_PREFILLS_TOTAL,
        "Requests a decode worker prefilled itself: its prefix cache held all but a short suffix"
    );
    describe_histogram!(KV_TRANSFER_SECONDS, Unit::Seconds, "KV transfer time");
    describe_histogram!(KV_WAIT_SECONDS, Unit::Seconds, "Lease to commit on decode");
    describe_gauge!(
        DISCOVERED_WORKERS,
        "Workers in the pool (listed or found through DNS), by role"
    );
    describe_counter!(TOKENS_TOTAL, "Tokens of finished requests by kind");
    describe_gauge!(
        SLO_TARGET_MS,
        "The deployment's latency targets in milliseconds"
    );
    describe_counter!(
        SLO_REQUESTS_TOTAL,
        "Finished requests by latency target and whether they met it"
    );
    describe_gauge!(
        SLO_PRESSURE,
        "Measured over target latency, running average per side (above 1: missing targets)"
    );
    describe_counter!(
        PLACEMENTS_TOTAL,
        "Requests placed by SLO placement, by placement and predicted outcome"
    );
    describe_counter!(
        SPLIT_PROMPT_TOKENS_TOTAL,
        "Prompt tokens of prompts split between a prefill and a decode worker, by side"
    );
    describe_gauge!(
        COMPUTE_THREADS,
        "Compute threads the elastic thread planner gives each worker"
    );
    describe_counter!(
        COMPUTE_THREAD_MOVES_TOTAL,
        "Moves of compute threads by the elastic thread planner, by role"
    );
    describe_histogram!(
        PREDICTION_ERROR,
        "Relative error of SLO placement's TTFT and TPOT predictions"
    );
}

/// Exports the deployment's latency targets (at startup; they do not change).
pub fn register_slo(slo: &crate::routing::SloTargets) {
    for (target, ms) in [
        ("ttft", slo.ttft_ms),
        ("ttft_per_token", slo.ttft_per_token_ms),
        ("tpot", slo.tpot_ms),
    ] {
        metrics::gauge!(SLO_TARGET_MS, "target" => target).set(ms);
    }
    for role in ["prefill", "decode"] {
        metrics::gauge!(SLO_PRESSURE, "role" => role).set(0.0);
    }
}

/// Registers the series that exist before any request, so `/metrics` lists them at once.
pub fn register_static_series() {
    metrics::gauge!(QUEUE_DEPTH).increment(0.0);
    metrics::gauge!(IN_FLIGHT).increment(0.0);
    for reason in ["no_prefill_worker", "prefill_failed", "transfer_failed"] {
        metrics::counter!(FALLBACKS_TOTAL, "reason" => reason).increment(0);
    }
    metrics::counter!(PREFILL_RETRIES_TOTAL).increment(0);
    metrics::gauge!(OPEN_CONNECTIONS).increment(0.0);
    metrics::counter!(CONNECTIONS_REFUSED_TOTAL).increment(0);
    metrics::counter!(SSE_KEEPALIVES_TOTAL).increment(0);
}

/// One worker's samples for the per-worker families, read from the pool at scrape time.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerSamples {
    pub worker: String,
    pub role: &'static str,
    pub healthy: bool,
    /// `(total, in use)` KV blocks, once the worker has reported its load.
    pub kv_blocks: Option<(u32, u32)>,
    /// Prefill workers, once they have reported their load.
    pub queued_prefill_tokens: Option<u64>,
    /// The prefix cache's `(query tokens, hit tokens, evictions, cached blocks)`, once the
    /// worker has reported its load.
    pub prefix: Option<(u64, u64, u64, u32)>,
}

/// Escapes a label value for the Prometheus text format.
fn label_value(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The per-worker families in Prometheus text, for the workers in the pool now.
///
/// These are not kept in the recorder, because the recorder cannot delete a series: a worker
/// that left the pool (a pod scaled down, or restarted with a new address) would linger as a
/// zero forever, and under DNS discovery the series would only ever grow. Rendered from the
/// pool at each scrape, a worker's series end when it leaves.
pub fn render_worker_families(samples: &[WorkerSamples]) -> String {
    use std::fmt::Write;
    type Value = fn(&WorkerSamples) -> Option<String>;
    let families: [(&str, &str, &str, Value); 8] = [
        (
            WORKER_HEALTHY,
            "1 if the worker is healthy and routable",
            "gauge",
            |s| Some(u8::from(s.healthy).to_string()),
        ),
        (
            WORKER_KV_BLOCKS_IN_USE,
            "KV blocks in use on the worker",
            "gauge",
            |s| s.kv_blocks.map(|(_, used)| used.to_string()),
        ),
        (
            WORKER_KV_BLOCKS_TOTAL,
            "KV blocks on the worker",
            "gauge",
            |s| s.kv_blocks.map(|(total, _)| total.to_string()),
        ),
        (
            WORKER_QUEUED_PREFILL_TOKENS,
            "Prompt tokens queued on the worker",
            "gauge",
            |s| s.queued_prefill_tokens.map(|n| n.to_string()),
        ),
        (
            WORKER_PREFIX_QUERY_TOKENS,
            "Prompt tokens the worker looked up in its prefix cache",
            "counter",
            |s| s.prefix.map(|p| p.0.to_string()),
        ),
        (
            WORKER_PREFIX_HIT_TOKENS,
            "Prompt tokens the worker found in its prefix cache (not computed)",
            "counter",
            |s| s.prefix.map(|p| p.1.to_string()),
        ),
        (
            WORKER_PREFIX_EVICTIONS,
            "Cached KV blocks the worker evicted to make room",
            "counter",
            |s| s.prefix.map(|p| p.2.to_string()),
        ),
        (
            WORKER_CACHED_BLOCKS,
            "KV blocks in the worker's prefix cache",
            "gauge",
            |s| s.prefix.map(|p| p.3.to_string()),
        ),
    ];
    let mut out = String::new();
    for (name, help, kind, value) in families {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for s in samples {
            if let Some(v) = value(s) {
                let _ = writeln!(
                    out,
                    "{name}{{worker=\"{}\",role=\"{}\"}} {v}",
                    label_value(&s.worker),
                    s.role
                );
            }
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_families_render_only_what_each_worker_reported() {
        let samples = [
            WorkerSamples {
                worker: "http://10.0.0.1:7201".into(),
                role: "decode",
                healthy: true,
                kv_blocks: Some((64, 4)),
                queued_prefill_tokens: None,
                prefix: Some((100, 32, 1, 5)),
            },
            WorkerSamples {
                worker: "http://p\"q".into(),
                role: "prefill",
                healthy: false,
                kv_blocks: None,
                queued_prefill_tokens: None,
                prefix: None,
            },
        ];
        let text = render_worker_families(&samples);
        let expected = "\
# HELP tandem_router_worker_healthy 1 if the worker is healthy and routable
# TYPE tandem_router_worker_healthy gauge
tandem_router_worker_healthy{worker=\"http://10.0.0.1:7201\",role=\"decode\"} 1
tandem_router_worker_healthy{worker=\"http://p\\\"q\",role=\"prefill\"} 0

# HELP tandem_router_worker_kv_blocks_in_use KV blocks in use on the worker
# TYPE tandem_router_worker_kv_blocks_in_use gauge
tandem_router_worker_kv_blocks_in_use{worker=\"http://10.0.0.1:7201\",role=\"decode\"} 4

# HELP tandem_router_worker_kv_blocks_total KV blocks on the worker
# TYPE tandem_router_worker_kv_blocks_total gauge
tandem_router_worker_kv_blocks_total{worker=\"http://10.0.0.1:7201\",role=\"decode\"} 64

# HELP tandem_router_worker_queued_prefill_tokens Prompt tokens queued on the worker
# TYPE tandem_router_worker_queued_prefill_tokens gauge

# HELP tandem_router_worker_prefix_query_tokens_total Prompt tokens the worker looked up in its prefix cache
# TYPE tandem_router_worker_prefix_query_tokens_total counter
tandem_router_worker_prefix_query_tokens_total{worker=\"http://10.0.0.1:7201\",role=\"decode\"} 100

# HELP tandem_router_worker_prefix_hit_tokens_total Prompt tokens the worker found in its prefix cache (not computed)
# TYPE tandem_router_worker_prefix_hit_tokens_total counter
tandem_router_worker_prefix_hit_tokens_total{worker=\"http://10.0.0.1:7201\",role=\"decode\"} 32

# HELP tandem_router_worker_prefix_evictions_total Cached KV blocks the worker evicted to make room
# TYPE tandem_router_worker_prefix_evictions_total counter
tandem_router_worker_prefix_evictions_total{worker=\"http://10.0.0.1:7201\",role=\"decode\"} 1

# HELP tandem_router_worker_cached_blocks KV blocks in the worker's prefix cache
# TYPE tandem_router_worker_cached_blocks gauge
tandem_router_worker_cached_blocks{worker=\"http://10.0.0.1:7201\",role=\"decode\"} 5

";
        assert_eq!(text, expected);
    }
}
