//! Failures and lifetimes: clients that leave (mid-stream and during prefill), workers that
//! fail mid-stream or die, and a full queue.

use super::*;

/// Sends a raw HTTP request and returns the open socket.
fn raw_post(router_url: &str, path: &str, body: &Value) -> std::net::TcpStream {
    let addr = router_url.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let body = body.to_string();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s
}

#[tokio::test]
async fn client_disconnect_mid_stream_cancels_the_decode_stream() {
    let (decode, _prefill, _ds, _ps, router) = setup().await;
    decode.set_script(DecodeScript {
        tokens: text_tokens(&"x".repeat(100)),
        token_delay: Duration::from_millis(50),
        ..Default::default()
    });
    let url = router.url.clone();
    let dropped_at = tokio::task::spawn_blocking(move || {
        let mut s = raw_post(
            &url,
            "/v1/completions",
            &json!({"prompt": "Hello", "max_tokens": 100, "stream": true}),
        );
        let mut seen = String::new();
        let mut buf = [0u8; 1024];
        while seen.matches("data:").count() < 3 {
            let n = s.read(&mut buf).unwrap();
            assert!(n > 0, "stream ended early: {seen}");
            seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
        assert!(seen.starts_with("HTTP/1.1 200"), "{seen}");
        drop(s);
        Instant::now()
    })
    .await
    .unwrap();
    assert!(
        eventually(Duration::from_secs(2), || !decode.closed_early().is_empty()).await,
        "decode stream never closed"
    );
    let closed = decode.closed_early()[0];
    assert!(
        closed.duration_since(dropped_at) < Duration::from_secs(1),
        "closed {:?} after the client left",
        closed.duration_since(dropped_at)
    );
    router.stop().await;
}

#[tokio::test]
async fn client_disconnect_during_prefill_cancels_both_calls() {
    let (decode, prefill, _ds, _ps, router) = setup().await;
    prefill.set_script(PrefillScript {
        delay: Duration::from_secs(10),
        ..Default::default()
    });
    let url = router.url.clone();
    let s = tokio::task::spawn_blocking(move || {
        raw_post(
            &url,
            "/v1/completions",
            &json!({"prompt": "Hello", "max_tokens": 5, "stream": true}),
        )
    })
    .await
    .unwrap();
    assert!(eventually(Duration::from_secs(2), || !prefill.calls().is_empty()).await);
    let dropped_at = Instant::now();
    drop(s);
    assert!(
        eventually(Duration::from_secs(2), || !prefill.cancelled().is_empty()
            && !decode.closed_early().is_empty())
        .await,
        "prefill cancelled: {}, decode closed: {}",
        prefill.cancelled().len(),
        decode.closed_early().len()
    );
    assert!(prefill.cancelled()[0].duration_since(dropped_at) < Duration::from_secs(1));
    assert!(decode.closed_early()[0].duration_since(dropped_at) < Duration::from_secs(1));
    router.stop().await;
}

#[tokio::test]
async fn failure_after_streaming_began_ends_with_an_error_event() {
    let (decode, _prefill, _ds, _ps, router) = setup().await;
    decode.set_script(DecodeScript {
        fail_after: Some(2),
        ..Default::default()
    });
    let r = post(
        &router.url,
        "/v1/completions",
        json!({"prompt": "Hello", "max_tokens": 10, "stream": true}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let events = sse_payloads(&r.text().await.unwrap());
    assert_eq!(events.len(), 4, "{events:?}");
    let err: Value = serde_json::from_str(&events[2]).unwrap();
    assert_eq!(err["error"]["type"], "upstream_error");
    assert!(
        !err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("scripted")
    );
    assert_eq!(events[3], "[DONE]");

    let r = post(
        &router.url,
        "/generate_stream",
        json!({"inputs": "Hello", "parameters": {"max_new_tokens": 10}}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let events = sse_payloads(&r.text().await.unwrap());
    assert_eq!(events.len(), 3, "{events:?}");
    let err: Value = serde_json::from_str(&events[2]).unwrap();
    assert_eq!(err["error_type"], "generation");
    assert!(err["error"].is_string());

    // Not streaming: nothing was sent yet, so the status says it.
    let r = complete(&router.url, 10).await;
    assert_eq!(r.status(), 502);
    router.stop().await;
}

#[tokio::test]
async fn full_queue_gets_429_with_retry_after() {
    let decode = FakeDecode::new("decode-0");
    decode.set_script(DecodeScript {
        tokens: text_tokens(&"x".repeat(40)),
        token_delay: Duration::from_millis(50),
        ..Default::default()
    });
    let ds = FakeServer::decode(&decode);
    let mut c = config(&[], &[&ds]);
    c.max_concurrent_requests = 1;
    c.max_queued_requests = 1;
    let router = TestRouter::start(c).await;
    let body = json!({"prompt": "Hello", "max_tokens": 40, "stream": true});
    let running = post(&router.url, "/v1/completions", body.clone()).await;
    assert_eq!(running.status(), 200);
    let url = router.url.clone();
    let queued_body = body.clone();
    let queued = tokio::spawn(async move { post(&url, "/v1/completions", queued_body).await });
    // The second request waits in the queue (no second Generate) before the third arrives.
    let deadline = Instant::now() + Duration::from_secs(10);
    while series(&router.url, "tandem_router_queue_depth").await != Some(1.0) {
        assert!(Instant::now() < deadline, "the second request never queued");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(decode.generate_calls().len(), 1);
    let started = Instant::now();
    let r = post(&router.url, "/v1/completions", body).await;
    assert_eq!(r.status(), 429);
    assert!(started.elapsed() < Duration::from_secs(1));
    assert_eq!(header(&r, "retry-after"), "1");
    let err: Value = r.json().await.unwrap();
    assert_eq!(err["error"]["type"], "rate_limit_error");
    drop(running);
    let queued = tokio::time::timeout(Duration::from_secs(10), queued)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(queued.status(), 200);
    router.stop().await;
}

#[tokio::test]
async fn dead_decode_worker_errors_its_streams_and_is_routed_around() {
    let (a, b) = (FakeDecode::new("decode-a"), FakeDecode::new("decode-b"));
    a.set_script(DecodeScript {
        tokens: text_tokens(&"x".repeat(100)),
        token_delay: Duration::from_millis(50),
        ..Default::default()
    });
    // A has more free blocks, so it is chosen first.
    lock(&b.0.load).free_blocks = 32;
    let mut sa = FakeServer::decode(&a);
    let sb = FakeServer::decode(&b);
    let router = TestRouter::start(config(&[], &[&sa, &sb])).await;
    let mut r = post(
        &router.url,
        "/v1/completions",
        json!({"prompt": "Hello", "max_tokens": 100, "stream": true}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let mut seen = String::new();
    while seen.matches("data:").count() < 2 {
        seen.push_str(&String::from_utf8_lossy(&r.chunk().await.unwrap().unwrap()));
    }
    assert_eq!(a.generate_calls().len(), 1);
    let killed = Instant::now();
    sa.kill();
    let rest = tokio::time::timeout(Duration::from_secs(5), async {
        while let Ok(Some(c)) = r.chunk().await {
            seen.push_str(&String::from_utf8_lossy(&c));
        }
        seen
    })
    .await
    .expect("stream ended");
    assert!(killed.elapsed() < Duration::from_secs(2));
    let events = sse_payloads(&rest);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let err: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert!(err["error"]["message"].is_string(), "{rest}");
    for _ in 0..3 {
        let r = complete(&router.url, 2).await;
        assert_eq!(r.status(), 200);
    }
    assert_eq!(b.generate_calls().len(), 3);
    assert_eq!(a.generate_calls().len(), 1);
    router.stop().await;
}

#[tokio::test]
async fn unavailable_decode_worker_is_retried_elsewhere_before_the_first_token() {
    let (a, b) = (FakeDecode::new("decode-a"), FakeDecode::new("decode-b"));
    a.set_script(DecodeScript {
        generate_error: Some(Code::Unavailable),
        ..Default::default()
    });
    lock(&b.0.load).free_blocks = 32;
    let sa = FakeServer::decode(&a);
    let sb = FakeServer::decode(&b);
    let router = TestRouter::start(config(&[], &[&sa, &sb])).await;
    let r = complete(&router.url, 2).await;
    assert_eq!(r.status(), 200);
    assert_eq!((a.generate_calls().len(), b.generate_calls().len()), (1, 1));
    // A worker that answers InvalidArgument is not retried: the request itself is bad.
    b.set_script(DecodeScript {
        generate_error: Some(Code::InvalidArgument),
        ..Default::default()
    });
    a.set_script(DecodeScript {
        generate_error: Some(Code::InvalidArgument),
        ..Default::default()
    });
    let r = complete(&router.url, 2).await;
    assert_eq!(r.status(), 400);
    let err: Value = r.json().await.unwrap();
    assert!(
        !err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("scripted")
    );
    assert_eq!(a.generate_calls().len() + b.generate_calls().len(), 3);
    router.stop().await;
}
