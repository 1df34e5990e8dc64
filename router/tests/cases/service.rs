//! The router as a service: the API key, the models, health and metrics routes, a router
//! that starts before its workers, and the binary itself.

use super::*;

#[tokio::test]
async fn api_key_guards_generation_routes_only() {
    let decode = FakeDecode::new("decode-0");
    let ds = FakeServer::decode(&decode);
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
    let r = get(&router.url, "/v1/models").await;
    assert_eq!(r.status(), 401);
    for open in ["/health", "/metrics"] {
        let r = get(&router.url, open).await;
        assert_eq!(r.status(), 200, "{open}");
    }
    router.stop().await;
}

#[tokio::test]
async fn models_health_and_metrics() {
    let (_decode, _prefill, _ds, _ps, router) = setup().await;
    let models: Value = get_json(&router.url, "/v1/models").await;
    assert_eq!(models["data"][0]["id"], MODEL);
    assert_eq!(models["data"][0]["max_model_len"], CONTEXT);
    let health: Value = get_json(&router.url, "/health").await;
    assert_eq!(health["status"], "ok");
    assert_eq!(health["decode_workers_healthy"], 1);
    assert_eq!(health["prefill_workers_healthy"], 1);
    let r = get(&router.url, "/v1/completions").await;
    assert_eq!(r.status(), 405);
    let err: Value = r.json().await.unwrap();
    assert!(err["error"]["message"].is_string());
    let r = get(&router.url, "/nope").await;
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
    let text = get(&router.url, "/metrics").await.text().await.unwrap();
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
    let r = get(&router.url, "/health").await;
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
async fn the_binary_serves_and_stops_on_sigterm() {
    let decode = FakeDecode::new("decode-0");
    let ds = FakeServer::decode(&decode);
    let (mut child, url) = spawn_binary(&[
        "--decode",
        &ds.url,
        "--health-interval-ms",
        "50",
        "--served-model-name",
        "served",
    ]);
    if binary_health(&url).await.is_none() {
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
