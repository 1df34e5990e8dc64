//! The router against scripted fake workers: the disaggregated flow end to end, modes and
//! fallbacks, streaming formats, cancellation, failures, overload, bad input, API keys,
//! workers found through DNS, and the binary itself. Everything listens on loopback
//! (127.0.0.1, and 127.0.0.2-3 for DNS names with several addresses); every wait is bounded.

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};
use tandem_proto::v1::{Mode, Transport};
use tandem_router::RoutingPolicy;
use tandem_text::{ChatMessage, ChatTemplate};
use tonic::Code;

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .expect("client")
}

async fn post(url: &str, path: &str, body: Value) -> reqwest::Response {
    client()
        .post(format!("{url}{path}"))
        .json(&body)
        .send()
        .await
        .expect("request")
}

fn header<'a>(r: &'a reqwest::Response, name: &str) -> &'a str {
    r.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

/// One decode and one prefill fake, and a router over them.
async fn setup() -> (FakeDecode, FakePrefill, FakeServer, FakeServer, TestRouter) {
    let decode = FakeDecode::new("decode-0");
    let prefill = FakePrefill::new("prefill-0");
    let ds = FakeServer::start(Service::Decode(decode.clone()));
    let ps = FakeServer::start(Service::Prefill(prefill.clone()));
    let router = TestRouter::start(config(&[&ps], &[&ds])).await;
    (decode, prefill, ds, ps, router)
}

#[tokio::test]
async fn disaggregated_completion_end_to_end() {
    let (decode, prefill, ds, _ps, router) = setup().await;
    let r = client()
        .post(format!("{}/v1/completions", router.url))
        .header("x-request-id", "req-e2e-1")
        .json(&json!({"model": MODEL, "prompt": "Hello", "max_tokens": 5, "temperature": 0.0}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-tandem-mode"), "disaggregated");
    assert_eq!(header(&r, "x-tandem-kv-bytes"), KV_BYTES.to_string());
    assert_eq!(header(&r, "x-tandem-transport"), "shm");
    assert_eq!(header(&r, "x-request-id"), "req-e2e-1");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["choices"][0]["text"], "Hello");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["usage"]["completion_tokens"], 5);
    assert_eq!(body["usage"]["prompt_tokens"], 5);
    assert_eq!(
        body["usage"]["tandem"],
        json!({"mode": "disaggregated", "kv_bytes": KV_BYTES, "transport": "shm", "fallback_reason": null, "cached_tokens": 0, "kv_blocks": 1, "decode_cached_tokens": 0, "prefill_pulled_tokens": 0})
    );

    let prompt = tokenizer().encode("Hello", true).unwrap();
    let calls = decode.generate_calls();
    assert_eq!(calls.len(), 1);
    let g = &calls[0];
    assert_eq!(g.mode, Mode::Disaggregated as i32);
    assert_eq!(g.request_id, "req-e2e-1");
    assert_eq!(g.prompt, prompt);
    assert_eq!(g.lease_ttl_ms, 30_000);
    assert_eq!(g.stop.as_ref().unwrap().max_tokens, 5);
    assert_eq!(g.sampling.as_ref().unwrap().temperature, 0.0);

    let lease = lock(&decode.0.leases)[0].clone();
    let calls = prefill.calls();
    assert_eq!(calls.len(), 1);
    let p = &calls[0];
    assert_eq!(p.request_id, "req-e2e-1");
    assert_eq!(p.prompt, prompt);
    let dest = p.destination.as_ref().unwrap();
    assert_eq!(dest.transport, Transport::Shm as i32);
    assert_eq!(dest.decode_endpoint, ds.url);
    // The prefill worker gets the decode worker and the capability, not addresses: it
    // verifies the decode worker itself and uses what that worker advertises.
    assert_eq!(dest.lease, lease.token);
    assert_eq!(dest.lease.len(), 16);
    assert_eq!(
        dest.decode_instance,
        lock(&decode.0.info).instance_id,
        "the instance the router verified"
    );
    assert_eq!(dest.block_ids, lease.block_ids);
    assert_eq!(dest.kv_layout_hash, "hash-A");
    assert_eq!(lock(&decode.0.commits)[0].lease, lease.token);
    // Only the first decode worker was asked for the tokenizer.
    router.stop().await;
}

#[tokio::test]
async fn streaming_completions_with_usage_and_eos() {
    let (_decode, _prefill, _ds, _ps, router) = setup().await;
    let r = post(
        &router.url,
        "/v1/completions",
        json!({"prompt": "Hi", "max_tokens": 100, "stream": true, "stream_options": {"include_usage": true}, "ignore_eos": false}),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "content-type"), "text/event-stream");
    assert_eq!(header(&r, "x-tandem-mode"), "disaggregated");
    let body = r.text().await.unwrap();
    let events = sse_payloads(&body);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, "Hello from tandem!");
    // The EOS token is the last token chunk and carries the finish reason.
    let last_token_chunk = &chunks[chunks.len() - 2];
    assert_eq!(last_token_chunk["choices"][0]["finish_reason"], "stop");
    let usage = &chunks[chunks.len() - 1];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 19);
    assert_eq!(usage["usage"]["tandem"]["mode"], "disaggregated");
    assert_eq!(usage["usage"]["tandem"]["kv_bytes"], KV_BYTES);
    // 18 text tokens + EOS, one chunk each, then the usage chunk.
    assert_eq!(chunks.len(), 20);
    router.stop().await;
}

#[tokio::test]
async fn chat_streaming_and_not() {
    let (decode, _prefill, _ds, _ps, router) = setup().await;
    let messages = json!([{"role": "user", "content": [{"type": "text", "text": "Hey"}]}]);
    let r = post(
        &router.url,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": messages, "max_completion_tokens": 3, "stream": true}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let events = sse_payloads(&r.text().await.unwrap());
    assert_eq!(events.len(), 4, "{events:?}");
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(
        first["choices"][0]["delta"],
        json!({"role": "assistant", "content": "H"})
    );
    let last: Value = serde_json::from_str(&events[2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["tandem"]["mode"], "disaggregated");
    assert!(last.get("usage").is_none());
    assert_eq!(events[3], "[DONE]");

    let r = post(
        &router.url,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "Hey"}], "max_tokens": 4}),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-tandem-mode"), "disaggregated");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"][0]["message"]["content"], "Hell");
    assert_eq!(body["usage"]["tandem"]["transport"], "shm");

    // The prompt is the template's rendering, encoded without extra special tokens.
    let tok = tokenizer();
    let template = ChatTemplate::new(
        tok.info().chat_template.as_deref().unwrap(),
        tok.info().bos_token.as_deref(),
        tok.info().eos_token.as_deref(),
    )
    .unwrap();
    let rendered = template
        .render(&[ChatMessage::new("user", "Hey")], true)
        .unwrap();
    let want = tok.encode(&rendered, false).unwrap();
    for call in decode.generate_calls() {
        assert_eq!(call.prompt, want);
    }
    router.stop().await;
}

#[tokio::test]
async fn tgi_generate_and_stream() {
    let (_decode, _prefill, _ds, _ps, router) = setup().await;
    // vLLM's tgi backend body, unchanged.
    let body = json!({"inputs": "Hello", "parameters": {"max_new_tokens": 4, "do_sample": true, "temperature": 0.01, "top_p": 0.99, "truncate": 5, "ignore_eos_token": false}});
    let r = post(&router.url, "/generate_stream", body).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-tandem-mode"), "disaggregated");
    let text = r.text().await.unwrap();
    assert!(
        text.starts_with("data:{\"index\":1,\"token\":{\"id\":"),
        "{text}"
    );
    let events: Vec<Value> = sse_payloads(&text)
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(events.len(), 4);
    for (k, e) in events.iter().enumerate() {
        assert_eq!(e["index"], k + 1);
        assert_eq!(e["token"]["special"], false);
        assert!(e["token"]["logprob"].is_number());
    }
    assert_eq!(events[0]["generated_text"], Value::Null);
    assert_eq!(events[3]["generated_text"], "Hell");
    assert_eq!(events[3]["details"], Value::Null);

    let r = post(
        &router.url,
        "/generate",
        json!({"inputs": "Hello", "parameters": {"max_new_tokens": 100, "details": true, "seed": 42}}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["generated_text"], "Hello from tandem!");
    let details = &body["details"];
    assert_eq!(
        (
            &details["finish_reason"],
            &details["generated_tokens"],
            &details["seed"],
            &details["prefill"]
        ),
        (&json!("eos_token"), &json!(19), &json!(42), &json!([]))
    );
    // Every generated token, as TGI's client parses them: the text's bytes, then EOS.
    let tokens = details["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 19);
    let text: String = tokens
        .iter()
        .filter(|t| t["special"] == false)
        .map(|t| t["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, "Hello from tandem!");
    assert!(
        tokens
            .iter()
            .all(|t| t["id"].is_u64() && t["logprob"].is_number())
    );
    assert_eq!(tokens[18]["id"], EOS);

    let r = post(
        &router.url,
        "/generate_stream",
        json!({"inputs": "Hello", "parameters": {"max_new_tokens": 2, "details": true}}),
    )
    .await;
    let events = sse_payloads(&r.text().await.unwrap());
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["details"]["finish_reason"], "length");
    assert_eq!(last["details"]["generated_tokens"], 2);
    router.stop().await;
}

#[tokio::test]
async fn short_prompts_run_aggregated_below_the_threshold() {
    let decode = FakeDecode::new("decode-0");
    let prefill = FakePrefill::new("prefill-0");
    let ds = FakeServer::start(Service::Decode(decode.clone()));
    let ps = FakeServer::start(Service::Prefill(prefill.clone()));
    let mut c = config(&[&ps], &[&ds]);
    c.agg_threshold = 10;
    let router = TestRouter::start(c).await;
    let r = post(
        &router.url,
        "/v1/completions",
        json!({"prompt": "Hello", "max_tokens": 3}),
    )
    .await;
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

/// The value of one series in the router's `/metrics`, or None when the series is absent.
async fn series(router_url: &str, name: &str) -> Option<f64> {
    let text = client()
        .get(format!("{router_url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
}

/// A counter's value (0 before its first increment).
async fn metric_value(router_url: &str, name: &str) -> f64 {
    series(router_url, name).await.unwrap_or(0.0)
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
    let ds = FakeServer::start(Service::Decode(decode.clone()));
    let ps = FakeServer::start(Service::Prefill(prefill.clone()));
    let router = TestRouter::start(config(&[&ps], &[&ds])).await;
    let r = post(
        &router.url,
        "/v1/completions",
        json!({"prompt": "Hello", "max_tokens": 2}),
    )
    .await;
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
    let renewals = lock(&decode.0.renewals).len();
    assert!(
        renewals >= 3,
        "a 1.2 s prefill under a 300 ms lease needs renewals every 100 ms, got {renewals}"
    );
    router.stop().await;
}

/// A prefill worker whose KV could not reach a decode worker answers ABORTED: the request
/// moves to another decode worker, and the prefill worker stays healthy (it was not at fault).
#[tokio::test]
async fn a_failed_kv_transfer_counts_against_the_decode_worker_not_the_prefill_worker() {
    let (a, b) = (FakeDecode::new("decode-a"), FakeDecode::new("decode-b"));
    lock(&a.0.load).free_blocks = 64;
    lock(&b.0.load).free_blocks = 32;
    let sa = FakeServer::start(Service::Decode(a.clone()));
    let sb = FakeServer::start(Service::Decode(b.clone()));
    let prefill = FakePrefill::new("prefill-0");
    let ps = FakeServer::start(Service::Prefill(prefill.clone()));
    prefill.set_script(PrefillScript {
        abort_for: Some(sa.url.clone()),
        ..Default::default()
    });
    let router = TestRouter::start(config(&[&ps], &[&sa, &sb])).await;
    let r = post(
        &router.url,
        "/v1/completions",
        json!({"prompt": "Hello", "max_tokens": 2}),
    )
    .await;
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
    let r = post(
        &router.url,
        "/v1/completions",
        json!({"prompt": "Hello", "max_tokens": 2}),
    )
    .await;
    assert_eq!(r.headers()["x-tandem-mode"], "disaggregated");
    router.stop().await;
}

#[tokio::test]
async fn no_prefill_worker_falls_back_visibly_or_refuses() {
    let decode = FakeDecode::new("decode-0");
    let ds = FakeServer::start(Service::Decode(decode.clone()));
    let mut c = config(&[], &[&ds]);
    c.prefill_urls = vec![dead_url()];
    let router = TestRouter::start_unready(c.clone()).await;
    router.wait_healthy(1, 0).await;
    let series = "tandem_router_fallbacks_total{reason=\"no_prefill_worker\"}";
    let before = metric_value(&router.url, series).await;
    let r = post(
        &router.url,
        "/v1/completions",
        json!({"prompt": "Hello", "max_tokens": 2}),
    )
    .await;
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
    let r = post(
        &router.url,
        "/v1/completions",
        json!({"prompt": "Hello", "max_tokens": 2}),
    )
    .await;
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
    let ds = FakeServer::start(Service::Decode(decode.clone()));
    let s0 = FakeServer::start(Service::Prefill(p0.clone()));
    let s1 = FakeServer::start(Service::Prefill(p1.clone()));
    let router = TestRouter::start(config(&[&s0, &s1], &[&ds])).await;
    let r = post(
        &router.url,
        "/v1/completions",
        json!({"prompt": "Hello", "max_tokens": 2}),
    )
    .await;
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
    let r = post(
        &router.url,
        "/v1/completions",
        json!({"prompt": "Hello", "max_tokens": 2}),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-tandem-mode"), "aggregated");
    assert_eq!(header(&r, "x-tandem-fallback"), "prefill_failed");
    router.stop().await;

    // With --fallback error, the client gets the failure's status.
    let mut c = config(&[&s0, &s1], &[&ds]);
    c.fallback = tandem_router::FallbackPolicy::Error;
    let router = TestRouter::start(c).await;
    let r = post(
        &router.url,
        "/v1/completions",
        json!({"prompt": "Hello", "max_tokens": 2}),
    )
    .await;
    assert_eq!(r.status(), 429);
    assert_eq!(header(&r, "retry-after"), "1");
    router.stop().await;
}

#[tokio::test]
async fn api_key_guards_generation_routes_only() {
    let decode = FakeDecode::new("decode-0");
    let ds = FakeServer::start(Service::Decode(decode.clone()));
    let mut c = config(&[], &[&ds]);
    c.api_key = Some(tandem_router::auth::ApiKey::new("s3cret-Key").unwrap());
    let router = TestRouter::start(c).await;
    let routes = [
        ("/v1/completions", json!({"prompt": "Hi", "max_tokens": 1})),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
        ),
        (
            "/generate",
            json!({"inputs": "Hi", "parameters": {"max_new_tokens": 1}}),
        ),
        (
            "/generate_stream",
            json!({"inputs": "Hi", "parameters": {"max_new_tokens": 1}}),
        ),
    ];
    for (path, body) in &routes {
        for auth in [
            None,
            Some("Bearer wrong"),
            Some("Bearer S3CRET-KEY"),
            Some("Bearer s3cret-key"),
            // (Surrounding whitespace is stripped by HTTP itself, so inner padding is tried.)
            Some("Bearer  s3cret-Key"),
            Some("Bearer s3cret-Ke"),
            Some("s3cret-Key"),
        ] {
            let mut req = client().post(format!("{}{path}", router.url)).json(body);
            if let Some(a) = auth {
                req = req.header("authorization", a);
            }
            let r = req.send().await.unwrap();
            assert_eq!(r.status(), 401, "{path} {auth:?}");
            let err: Value = r.json().await.unwrap();
            if path.starts_with("/v1") {
                assert_eq!(err["error"]["type"], "authentication_error");
            } else {
                assert_eq!(err["error_type"], "authentication");
            }
        }
    }
    assert!(decode.generate_calls().is_empty(), "a 401 reached a worker");
    for (path, body) in &routes {
        let r = client()
            .post(format!("{}{path}", router.url))
            .bearer_auth("s3cret-Key")
            .json(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
    }
    let r = client()
        .get(format!("{}/v1/models", router.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    for open in ["/health", "/metrics"] {
        let r = client()
            .get(format!("{}{open}", router.url))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{open}");
    }
    router.stop().await;
}

#[tokio::test]
async fn models_health_and_metrics() {
    let (_decode, _prefill, _ds, _ps, router) = setup().await;
    let models: Value = client()
        .get(format!("{}/v1/models", router.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], MODEL);
    assert_eq!(models["data"][0]["max_model_len"], CONTEXT);
    let health: Value = client()
        .get(format!("{}/health", router.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(health["status"], "ok");
    assert_eq!(health["decode_workers_healthy"], 1);
    assert_eq!(health["prefill_workers_healthy"], 1);
    let r = client()
        .get(format!("{}/v1/completions", router.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
    let err: Value = r.json().await.unwrap();
    assert!(err["error"]["message"].is_string());
    let r = client()
        .get(format!("{}/nope", router.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert!(r.headers().get("x-request-id").is_some());
    let err: Value = r.json().await.unwrap();
    assert!(err["error"]["message"].is_string());
    let r = post(
        &router.url,
        "/v1/completions",
        json!({"prompt": "Hello", "max_tokens": 3, "stream": true}),
    )
    .await;
    r.text().await.unwrap();
    let text = client()
        .get(format!("{}/metrics", router.url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for name in [
        "tandem_router_ttft_seconds",
        "tandem_router_itl_seconds",
        "tandem_router_e2e_latency_seconds",
        "tandem_router_queue_depth",
        "tandem_router_in_flight_requests",
        "tandem_router_requests_total",
        "tandem_router_fallbacks_total",
        "tandem_router_kv_transfer_bytes_total",
        "tandem_router_kv_transfer_seconds",
        "tandem_router_worker_healthy",
        "tandem_router_worker_kv_blocks_in_use",
        "tandem_router_worker_kv_blocks_total",
    ] {
        assert!(text.contains(name), "/metrics lacks {name}");
    }
    assert!(text.contains("tandem_router_requests_total{mode=\"disaggregated\",outcome=\"ok\"}"));
    router.stop().await;
}

#[tokio::test]
async fn router_starts_before_its_workers() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let mut c = common::config(&[], &[]);
    c.decode_urls = vec![url];
    let router = TestRouter::start_unready(c).await;
    let r = client()
        .get(format!("{}/health", router.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    let r = post(&router.url, "/v1/completions", json!({"prompt": "Hi"})).await;
    assert_eq!(r.status(), 503);
    assert_eq!(header(&r, "retry-after"), "1");
    let decode = FakeDecode::new("late");
    let _server = FakeServer::start_on(listener, Service::Decode(decode.clone()));
    router.wait_healthy(1, 0).await;
    let r = post(
        &router.url,
        "/v1/completions",
        json!({"prompt": "Hi", "max_tokens": 2}),
    )
    .await;
    assert_eq!(r.status(), 200);
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
    let ds = FakeServer::start(Service::Decode(decode.clone()));
    let old = FakeServer::start(Service::Decode(old_protocol.clone()));
    let ps = FakeServer::start(Service::Prefill(other_layout.clone()));
    let router = TestRouter::start_unready(config(&[&ps], &[&old, &ds])).await;
    // The old-protocol decode worker never becomes healthy; the prefill worker does, but is
    // never paired with the decode worker.
    router.wait_healthy(1, 1).await;
    for _ in 0..2 {
        let r = post(
            &router.url,
            "/v1/completions",
            json!({"prompt": "Hello", "max_tokens": 2}),
        )
        .await;
        assert_eq!(r.status(), 200);
        assert_eq!(header(&r, "x-tandem-mode"), "aggregated");
        assert_eq!(header(&r, "x-tandem-fallback"), "no_prefill_worker");
    }
    assert!(other_layout.calls().is_empty());
    assert!(old_protocol.generate_calls().is_empty());
    assert_eq!(decode.generate_calls().len(), 2);
    router.stop().await;
}

#[tokio::test]
async fn the_binary_serves_and_stops_on_sigterm() {
    let decode = FakeDecode::new("decode-0");
    let ds = FakeServer::start(Service::Decode(decode.clone()));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tandem-router"))
        .args([
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--decode",
            &ds.url,
        ])
        .args([
            "--health-interval-ms",
            "50",
            "--served-model-name",
            "served",
        ])
        .env_remove("TANDEM_API_KEY")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let url = format!("http://127.0.0.1:{port}");
    let mut ready = false;
    for _ in 0..200 {
        if let Ok(r) = client().get(format!("{url}/health")).send().await
            && r.status() == 200
        {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    if !ready {
        let _ = child.kill();
        panic!("binary never became healthy");
    }
    let r = post(
        &url,
        "/v1/completions",
        json!({"model": "served", "prompt": "Hi", "max_tokens": 2}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let r = post(
        &url,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
    )
    .await;
    assert_eq!(r.status(), 404);
    let status = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(code) = child.try_wait().unwrap() {
            assert!(code.success(), "exit {code:?}");
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("binary did not stop on SIGTERM");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[path = "cases/validation.rs"]
mod validation;

#[path = "cases/failures.rs"]
mod failures;

#[path = "cases/sampling_api.rs"]
mod sampling_api;

#[path = "cases/discovery.rs"]
mod discovery;

#[path = "cases/prefix_routing.rs"]
mod prefix_routing;

#[tokio::test]
async fn model_tokenizer_and_tgi_compat_routes() {
    let (_decode, _prefill, _ds, _ps, router) = setup().await;
    let get = |path: &str| client().get(format!("{}{path}", router.url)).send();
    let one: Value = get(&format!("/v1/models/{MODEL}"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        (one["id"].clone(), one["object"].clone()),
        (json!(MODEL), json!("model"))
    );
    let r = get("/v1/models/gpt-5").await.unwrap();
    assert_eq!(r.status(), 404);
    let err: Value = r.json().await.unwrap();
    assert_eq!(err["error"]["code"], "model_not_found");

    // vLLM's /tokenize and /detokenize (the byte-level test tokenizer: id = 3 + byte).
    let r: Value = post(
        &router.url,
        "/tokenize",
        json!({"prompt": "Hi", "return_token_strs": true}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(
        r,
        json!({"count": 2, "max_model_len": CONTEXT, "tokens": [75, 108], "token_strs": ["H", "i"]})
    );
    let chat: Value = post(
        &router.url,
        "/tokenize",
        json!({"messages": [{"role": "user", "content": "Hi"}]}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(
        chat["tokens"][0], 1,
        "the ChatML template opens with <|im_start|>: {chat}"
    );
    assert!(chat["count"].as_u64().unwrap() > 2);
    let r = post(
        &router.url,
        "/tokenize",
        json!({"model": "other", "prompt": "Hi"}),
    )
    .await;
    assert_eq!(r.status(), 404);
    let r = post(&router.url, "/tokenize", json!({"max_tokens": 3})).await;
    assert_eq!(r.status(), 400);
    let r: Value = post(&router.url, "/detokenize", json!({"tokens": [75, 108]}))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(r, json!({"prompt": "Hi"}));
    let r = post(&router.url, "/detokenize", json!({"tokens": [75, 99999]})).await;
    assert_eq!(r.status(), 400);
    let err: Value = r.json().await.unwrap();
    assert_eq!(err["error"]["param"], "tokens");

    // TGI's /tokenize, /info and the compatibility route its Client(base_url) posts to.
    let r: Value = post(&router.url, "/tokenize", json!({"inputs": "Hi"}))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        r,
        json!([{"id": 75, "text": "H", "start": 0, "stop": 1}, {"id": 108, "text": "i", "start": 1, "stop": 2}])
    );
    let info: Value = get("/info").await.unwrap().json().await.unwrap();
    assert_eq!(info["model_id"], MODEL);
    assert_eq!(info["max_total_tokens"], CONTEXT);
    assert_eq!(info["max_best_of"], 16);
    let r = post(
        &router.url,
        "/",
        json!({"inputs": "Hello", "parameters": {"max_new_tokens": 100, "details": true}, "stream": false}),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-tandem-mode"), "disaggregated");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body[0]["generated_text"], "Hello from tandem!");
    assert_eq!(body[0]["details"]["finish_reason"], "eos_token");
    let r = post(
        &router.url,
        "/",
        json!({"inputs": "Hello", "parameters": {"max_new_tokens": 3}, "stream": true}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let events = sse_payloads(&r.text().await.unwrap());
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["generated_text"], "Hel");
    // TGI's errors keep TGI's shape on this route too.
    let r = post(&router.url, "/", json!({"inputs": ""})).await;
    assert_eq!(r.status(), 422);
    let err: Value = r.json().await.unwrap();
    assert!(
        err["error"].is_string() && err["error_type"].is_string(),
        "{err}"
    );
    router.stop().await;
}
