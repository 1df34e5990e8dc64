//! Prefix caching as the router sees it: kv-aware routing follows the block names a decode
//! worker reports (load and round robin do not), a decode worker's cached prefix is left out
//! of the KV destination, and a short uncached suffix runs on the decode worker.

use std::sync::atomic::Ordering;

use tandem_kv::prefix::{hashes, names_to_bytes, salt};
use tandem_proto::v1::{BlockEvents, LoadReport};

use super::*;

/// 100 token ids: 6 full blocks and 4 tokens.
fn ids() -> Vec<u32> {
    (0..100).map(|i| 5 + i % 50).collect()
}

/// Makes `decode` report that its cache holds `tokens`' full blocks, with `free` free blocks.
fn report_cached(decode: &FakeDecode, tokens: &[u32], free: u32) {
    let layout_hash = lock(&decode.0.info).kv_layout_hash.clone();
    let names = hashes(salt(&layout_hash), tokens);
    *lock(&decode.0.load) = LoadReport {
        total_blocks: 64,
        free_blocks: free,
        block_events: Some(BlockEvents {
            snapshot: true,
            stored: names_to_bytes(&names),
            removed: Vec::new(),
            next: names.len() as u64,
            next_block: 0,
        }),
        ..Default::default()
    };
}

/// Waits until the router has asked each of `workers` for its load twice more: it asks a
/// worker again only once it has taken the last report in, so the block events of the
/// reports set before this call are in its index.
async fn reports_taken_in(workers: &[&FakeDecode]) {
    let calls = |w: &FakeDecode| w.0.load_calls.load(Ordering::SeqCst);
    let before: Vec<u64> = workers.iter().map(|w| calls(w)).collect();
    let taken_in = eventually(Duration::from_secs(10), || {
        workers.iter().zip(&before).all(|(w, &b)| calls(w) >= b + 2)
    })
    .await;
    assert!(taken_in, "the router did not poll its workers' load");
}

/// A completion of [`ids`].
async fn post_ids(router: &TestRouter) -> reqwest::Response {
    post(
        &router.url,
        "/v1/completions",
        json!({"prompt": ids(), "max_tokens": 2}),
    )
    .await
}

async fn complete_ids(router: &TestRouter) -> Value {
    let r = post_ids(router).await;
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// Which of `decodes` each of `n` identical requests went to.
async fn destinations(router: &TestRouter, decodes: &[&FakeDecode], n: usize) -> Vec<usize> {
    let mut seen = vec![0; decodes.len()];
    let mut out = Vec::new();
    for _ in 0..n {
        complete_ids(router).await;
        let now: Vec<usize> = decodes.iter().map(|d| d.generate_calls().len()).collect();
        let i = (0..decodes.len()).find(|&i| now[i] > seen[i]).unwrap();
        out.push(i);
        seen = now;
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_aware_routing_follows_the_reported_prefix_and_the_other_policies_do_not() {
    let (d0, d1) = (FakeDecode::new("decode-0"), FakeDecode::new("decode-1"));
    // decode-1 is busier but holds the prompt's 6 full blocks: 60 - 2 × 1 beats 64 - 2 × 7.
    *lock(&d0.0.load) = LoadReport {
        total_blocks: 64,
        free_blocks: 64,
        ..Default::default()
    };
    report_cached(&d1, &ids(), 60);
    let s0 = FakeServer::decode(&d0);
    let s1 = FakeServer::decode(&d1);
    let mut picks = Vec::new();
    for policy in [
        RoutingPolicy::KvAware,
        RoutingPolicy::Load,
        RoutingPolicy::RoundRobin,
    ] {
        let mut c = config(&[], &[&s0, &s1]);
        c.routing = policy;
        let router = TestRouter::start(c).await;
        reports_taken_in(&[&d0, &d1]).await;
        picks.push(destinations(&router, &[&d0, &d1], 4).await);
        router.stop().await;
    }
    assert_eq!(picks[0], [1, 1, 1, 1], "kv-aware: where the prefix is");
    // Load: the freer worker. Only the first pick is certain: the 7 blocks each request adds
    // to decode-0 until its next report (every 50 ms) leave it 57 free against 60, so a
    // request before that report goes to decode-1.
    assert_eq!(picks[1][0], 0, "load: the freer worker");
    assert_eq!(picks[2], [0, 1, 0, 1], "round robin: in turn");

    // Weight 0 prices a missing block at nothing: load decides again.
    let mut c = config(&[], &[&s0, &s1]);
    c.kv_overlap_weight = 0.0;
    let router = TestRouter::start(c).await;
    reports_taken_in(&[&d0, &d1]).await;
    assert_eq!(destinations(&router, &[&d0, &d1], 1).await, [0]);
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_conversation_turn_follows_its_first_turn_before_any_report() {
    let (d0, d1) = (FakeDecode::new("decode-0"), FakeDecode::new("decode-1"));
    let s0 = FakeServer::decode(&d0);
    let s1 = FakeServer::decode(&d1);
    let router = TestRouter::start(config(&[], &[&s0, &s1])).await;
    // Two conversations; each later turn extends its first (the router noted what it sent
    // where, and the fakes never report blocks).
    let first_a: Vec<u32> = (0..64).map(|i| 7 + i % 30).collect();
    let first_b: Vec<u32> = (0..64).map(|i| 40 + i % 30).collect();
    let mut where_went = Vec::new();
    for turn in 0..3u32 {
        for first in [&first_a, &first_b] {
            let mut prompt = first.clone();
            prompt.extend((0..turn * 20).map(|i| 3 + i % 9));
            let before = (d0.generate_calls().len(), d1.generate_calls().len());
            let r = post(
                &router.url,
                "/v1/completions",
                json!({"prompt": prompt, "max_tokens": 1}),
            )
            .await;
            assert_eq!(r.status(), 200);
            where_went.push(usize::from(d1.generate_calls().len() > before.1));
        }
    }
    // Conversation a went to one worker and stayed; b likewise.
    assert_eq!(where_went[0], where_went[2]);
    assert_eq!(where_went[2], where_went[4]);
    assert_eq!(where_went[1], where_went[3]);
    assert_eq!(where_went[3], where_went[5]);
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decode_workers_cached_prefix_is_not_sent_and_a_short_rest_runs_there() {
    let prefill = FakePrefill::new("prefill-0");
    let decode = FakeDecode::new("decode-0");
    decode.set_script(DecodeScript {
        cached_tokens: 96,
        ..DecodeScript::default()
    });
    // The prefill worker held 32 of those tokens and read the other 64 back (PullKv).
    prefill.set_script(PrefillScript {
        cached_tokens: 96,
        pulled_tokens: 64,
        pulled_bytes: 4096,
        ..PrefillScript::default()
    });
    let ps = FakeServer::prefill(&prefill);
    let ds = FakeServer::decode(&decode);
    let router = TestRouter::start(config(&[&ps], &[&ds])).await;
    let body = complete_ids(&router).await;
    let call = prefill.calls().pop().unwrap();
    let dest = call.destination.unwrap();
    assert_eq!((dest.first_block, dest.block_ids.len()), (6, 1));
    assert_eq!(decode.generate_calls()[0].local_prefill_below, 0);
    assert_eq!(body["usage"]["tandem"]["mode"], "disaggregated");
    assert_eq!(body["usage"]["tandem"]["kv_blocks"], 1);
    assert_eq!(body["usage"]["tandem"]["decode_cached_tokens"], 96);
    assert_eq!(body["usage"]["tandem"]["cached_tokens"], 96);
    assert_eq!(body["usage"]["tandem"]["prefill_pulled_tokens"], 64);
    assert_eq!(
        metric_value(&router.url, "tandem_router_kv_pulled_bytes_total").await,
        4096.0
    );
    router.stop().await;

    // With --agg-threshold 10 the 4 uncached tokens run on the decode worker.
    let mut c = config(&[&ps], &[&ds]);
    c.agg_threshold = 10;
    let router = TestRouter::start(c).await;
    let calls_before = prefill.calls().len();
    let r = post_ids(&router).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-tandem-mode"), "aggregated");
    assert!(r.headers().get("x-tandem-fallback").is_none());
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["usage"]["tandem"]["kv_blocks"], 0);
    assert_eq!(prefill.calls().len(), calls_before, "no prefill");
    let sent = decode.generate_calls().pop().unwrap();
    assert_eq!(
        (sent.mode, sent.local_prefill_below),
        (Mode::Disaggregated as i32, 10)
    );
    assert_eq!(
        metric_value(&router.url, "tandem_router_local_prefills_total").await,
        1.0
    );
    router.stop().await;
}
