//! Modes and fallbacks: aggregated below the threshold, lease renewal while a prefill waits,
//! a failed KV transfer, no prefill worker, prefill retries, and workers that are never
//! paired.

use super::*;

#[tokio::test]
async fn short_prompts_run_aggregated_below_the_threshold() {
    let (decode, prefill, _ds, _ps, router) = setup_with(|c| c.agg_threshold = 10).await;
    let r = complete(&router.url, 3).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-tandem-mode"), "aggregated");
    assert_eq!(header(&r, "x-tandem-kv-bytes"), "0");
    assert_eq!(header(&r, "x-tandem-transport"), "none");
    assert!(r.headers().get("x-tandem-fallback").is_none());
    let body: Value = r.json().await.unwrap();
    assert_eq!(
        body["usage"]["tandem"],
        json!({"mode": "aggregated", "kv_bytes": 0, "transport": null, "fallback_reason": null, "cached_tokens": 0, "kv_blocks": 0, "decode_cached_tokens": 0, "prefill_pulled_tokens": 0})
    );
    // A prompt at the threshold is disaggregated.
    let r = post(
        &router.url,
        "/v1/completions",
        json!({"prompt": "0123456789", "max_tokens": 3}),
    )
    .await;
    assert_eq!(header(&r, "x-tandem-mode"), "disaggregated");
    let calls = decode.generate_calls();
    assert_eq!(calls[0].mode, Mode::Aggregated as i32);
    assert_eq!(calls[1].mode, Mode::Disaggregated as i32);
    assert_eq!(prefill.calls().len(), 1);
    router.stop().await;
}

/// A decode worker grants a shorter lease than the router asks (its `--max-lease-ttl-ms`):
/// the router renews within what was granted, so a slow prefill still lands.

#[tokio::test]
async fn leases_are_renewed_within_the_period_the_decode_worker_granted() {
    let decode = FakeDecode::new("decode-0");
    decode.set_script(DecodeScript {
        lease_ttl_cap_ms: Some(300),
        ..Default::default()
    });
    let prefill = FakePrefill::new("prefill-0");
    prefill.set_script(PrefillScript {
        delay: Duration::from_millis(1200),
        ..Default::default()
    });
    let ds = FakeServer::decode(&decode);
    let ps = FakeServer::prefill(&prefill);
    let router = TestRouter::start(config(&[&ps], &[&ds])).await;
    let r = complete(&router.url, 2).await;
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
    let renewals = lock(&decode.0.renewals).len();
    assert!(
        renewals >= 3,
        "a 1.2 s prefill under a 300 ms lease needs renewals every 100 ms, got {renewals}"
    );
    router.stop().await;
}

/// A transfer that fails toward the only decode worker (the link between the workers, not the
/// worker): that worker, which the router still reaches, runs the prompt itself, and the
/// response says why.
#[tokio::test]
async fn a_failed_kv_transfer_to_the_only_decode_worker_runs_aggregated_there() {
    let decode = FakeDecode::new("decode-0");
    let ds = FakeServer::decode(&decode);
    let prefill = FakePrefill::new("prefill-0");
    let ps = FakeServer::prefill(&prefill);
    prefill.set_script(PrefillScript {
        abort_for: Some(ds.url.clone()),
        ..Default::default()
    });
    let router = TestRouter::start(config(&[&ps], &[&ds])).await;
    let r = complete(&router.url, 2).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-tandem-mode"], "aggregated");
    assert_eq!(r.headers()["x-tandem-fallback"], "transfer_failed");
    assert_eq!(prefill.calls().len(), 1);
    assert_eq!(
        decode.generate_calls().len(),
        2,
        "the lease, then the aggregated run"
    );
    let series_name = "tandem_router_fallbacks_total{reason=\"transfer_failed\"}";
    assert_eq!(series(&router.url, series_name).await, Some(1.0));
    router.stop().await;
}

/// A prefill worker whose KV could not reach a decode worker answers ABORTED: the request
/// moves to another decode worker, and the prefill worker stays healthy (it was not at fault).

#[tokio::test]
async fn a_failed_kv_transfer_counts_against_the_decode_worker_not_the_prefill_worker() {
    let (a, b) = (FakeDecode::new("decode-a"), FakeDecode::new("decode-b"));
    lock(&a.0.load).free_blocks = 64;
    lock(&b.0.load).free_blocks = 32;
    let sa = FakeServer::decode(&a);
    let sb = FakeServer::decode(&b);
    let prefill = FakePrefill::new("prefill-0");
    let ps = FakeServer::prefill(&prefill);
    prefill.set_script(PrefillScript {
        abort_for: Some(sa.url.clone()),
        ..Default::default()
    });
    let router = TestRouter::start(config(&[&ps], &[&sa, &sb])).await;
    let r = complete(&router.url, 2).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-tandem-mode"], "disaggregated");
    assert_eq!(prefill.calls().len(), 2, "once toward a, once toward b");
    assert_eq!((a.generate_calls().len(), b.generate_calls().len()), (1, 1));
    let healthy = format!(
        "tandem_router_worker_healthy{{worker=\"{}\",role=\"prefill\"}}",
        ps.url
    );
    assert_eq!(series(&router.url, &healthy).await, Some(1.0));
    // And the next request still goes disaggregated (the prefill worker was not marked down).
    let r = complete(&router.url, 2).await;
    assert_eq!(r.headers()["x-tandem-mode"], "disaggregated");
    router.stop().await;
}

#[tokio::test]
async fn no_prefill_worker_falls_back_visibly_or_refuses() {
    let decode = FakeDecode::new("decode-0");
    let ds = FakeServer::decode(&decode);
    let mut c = config(&[], &[&ds]);
    c.prefill_urls = vec![dead_url()];
    let router = TestRouter::start_unready(c.clone()).await;
    router.wait_healthy(1, 0).await;
    let series = "tandem_router_fallbacks_total{reason=\"no_prefill_worker\"}";
    let before = metric_value(&router.url, series).await;
    let r = complete(&router.url, 2).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-tandem-mode"), "aggregated");
    assert_eq!(header(&r, "x-tandem-fallback"), "no_prefill_worker");
    let body: Value = r.json().await.unwrap();
    assert_eq!(
        body["usage"]["tandem"]["fallback_reason"],
        "no_prefill_worker"
    );
    assert!(metric_value(&router.url, series).await >= before + 1.0);
    router.stop().await;

    c.fallback = tandem_router::FallbackPolicy::Error;
    let router = TestRouter::start_unready(c).await;
    router.wait_healthy(1, 0).await;
    let calls_before = decode.generate_calls().len();
    let r = complete(&router.url, 2).await;
    assert_eq!(r.status(), 503);
    assert_eq!(header(&r, "retry-after"), "1");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["type"], "service_unavailable_error");
    assert_eq!(decode.generate_calls().len(), calls_before);
    router.stop().await;
}

#[tokio::test]
async fn prefill_failure_retries_on_another_worker_then_falls_back() {
    let decode = FakeDecode::new("decode-0");
    let (p0, p1) = (FakePrefill::new("p0"), FakePrefill::new("p1"));
    p0.set_script(PrefillScript {
        error: Some(Code::ResourceExhausted),
        ..Default::default()
    });
    let ds = FakeServer::decode(&decode);
    let s0 = FakeServer::prefill(&p0);
    let s1 = FakeServer::prefill(&p1);
    let router = TestRouter::start(config(&[&s0, &s1], &[&ds])).await;
    let r = complete(&router.url, 2).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-tandem-mode"), "disaggregated");
    assert_eq!((p0.calls().len(), p1.calls().len()), (1, 1));
    // The first reservation was dropped (its stream closed), a second one was made.
    assert_eq!(decode.generate_calls().len(), 2);
    assert!(eventually(Duration::from_secs(1), || !decode.closed_early().is_empty()).await);

    // Both fail: aggregated, counted as prefill_failed.
    p1.set_script(PrefillScript {
        error: Some(Code::ResourceExhausted),
        ..Default::default()
    });
    let r = complete(&router.url, 2).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-tandem-mode"), "aggregated");
    assert_eq!(header(&r, "x-tandem-fallback"), "prefill_failed");
    router.stop().await;

    // With --fallback error, the client gets the failure's status.
    let mut c = config(&[&s0, &s1], &[&ds]);
    c.fallback = tandem_router::FallbackPolicy::Error;
    let router = TestRouter::start(c).await;
    let r = complete(&router.url, 2).await;
    assert_eq!(r.status(), 429);
    assert_eq!(header(&r, "retry-after"), "1");
    router.stop().await;
}

#[tokio::test]
async fn incompatible_workers_are_never_paired() {
    let decode = FakeDecode::new("decode-0");
    let other_layout = FakePrefill::new("prefill-b");
    lock(&other_layout.0.info).kv_layout_hash = "hash-B".into();
    let old_protocol = FakeDecode::new("decode-old");
    lock(&old_protocol.0.info).protocol_version = 99;
    lock(&old_protocol.0.load).free_blocks = 1_000;
    let ds = FakeServer::decode(&decode);
    let old = FakeServer::decode(&old_protocol);
    let ps = FakeServer::prefill(&other_layout);
    let router = TestRouter::start_unready(config(&[&ps], &[&old, &ds])).await;
    // The old-protocol decode worker never becomes healthy; the prefill worker does, but is
    // never paired with the decode worker.
    router.wait_healthy(1, 1).await;
    for _ in 0..2 {
        let r = complete(&router.url, 2).await;
        assert_eq!(r.status(), 200);
        assert_eq!(header(&r, "x-tandem-mode"), "aggregated");
        assert_eq!(header(&r, "x-tandem-fallback"), "no_prefill_worker");
    }
    assert!(other_layout.calls().is_empty());
    assert!(old_protocol.generate_calls().is_empty());
    assert_eq!(decode.generate_calls().len(), 2);
    router.stop().await;
}

/// `--elastic-threads`: while the prefill worker has a prompt queued, the decode worker whose
/// 16 streams step in 20 ms on its two threads (40 ms on one, within 0.9 x 60) is asked to run
/// on one and the prefill worker on the other; with nothing queued, the decode worker gets
/// both back. Each plan reaches the worker with its next load poll, and is exported.
#[tokio::test]
async fn the_elastic_planner_moves_threads_by_the_tpot_target() {
    let decode = FakeDecode::new("decode-0");
    let prefill = FakePrefill::new("prefill-0");
    *lock(&decode.0.load) = tandem_proto::v1::LoadReport {
        total_blocks: 64,
        free_blocks: 64,
        running: 16,
        compute_threads: 2,
        max_compute_threads: 2,
        step_cost: Some(tandem_proto::v1::StepCost {
            base_ms: 4.0,
            per_row_ms: 1.0,
            passes: 100,
            decode_rows: 16,
            ..Default::default()
        }),
        ..Default::default()
    };
    *lock(&prefill.0.load) = tandem_proto::v1::LoadReport {
        queued_prefill_tokens: 2048,
        compute_threads: 2,
        max_compute_threads: 2,
        ..Default::default()
    };
    let (ds, ps) = (FakeServer::decode(&decode), FakeServer::prefill(&prefill));
    let mut c = config(&[&ps], &[&ds]);
    c.elastic_threads = true;
    let router = TestRouter::start(c).await;
    let last = |asked: &std::sync::Mutex<Vec<u32>>| lock(asked).last().copied();
    let moved = eventually(Duration::from_secs(5), || {
        last(&decode.0.threads_asked) == Some(1) && last(&prefill.0.threads_asked) == Some(1)
    })
    .await;
    assert!(moved, "decode asked {:?}", lock(&decode.0.threads_asked));
    let metrics = get(&router.url, "/metrics").await.text().await.unwrap();
    assert!(
        metrics.contains(&format!(
            "tandem_router_compute_threads{{worker=\"{}\"}} 1",
            ds.url
        )),
        "{metrics}"
    );
    // The prompt is done: the streams get both threads again.
    lock(&prefill.0.load).queued_prefill_tokens = 0;
    let back = eventually(Duration::from_secs(5), || {
        last(&decode.0.threads_asked) == Some(2)
    })
    .await;
    assert!(back, "decode asked {:?}", lock(&decode.0.threads_asked));
    let metrics = get(&router.url, "/metrics").await.text().await.unwrap();
    assert!(
        metrics.contains("tandem_router_compute_thread_moves_total{role=\"decode\"}"),
        "{metrics}"
    );
    router.stop().await;
}
