//! One request end to end per API shape: a disaggregated completion (and what reaches each
//! worker), streaming with usage, chat streamed and not, TGI's generate and stream, and the
//! model, tokenizer and TGI compatibility routes.

use super::*;

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
    assert_eq!(sse_payloads(&body).last().unwrap(), "[DONE]");
    let chunks = sse_json(&body);
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
    let events = sse_json(&text);
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
async fn model_tokenizer_and_tgi_compat_routes() {
    let (_decode, _prefill, _ds, _ps, router) = setup().await;
    let one = get_json(&router.url, &format!("/v1/models/{MODEL}")).await;
    assert_eq!(
        (one["id"].clone(), one["object"].clone()),
        (json!(MODEL), json!("model"))
    );
    let r = get(&router.url, "/v1/models/gpt-5").await;
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
    let info = get_json(&router.url, "/info").await;
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
