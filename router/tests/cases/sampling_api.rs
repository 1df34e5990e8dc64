//! Logprobs, penalties, logit bias and `min_tokens` through the router: what reaches the
//! workers (both of them, in disaggregated mode), and the OpenAI and TGI shapes of the
//! alternatives the fake decode worker reports. The fake sends one alternative more than
//! asked for (the token itself at -0.5, then id + k at -0.5 - k): the router drops it.

use super::*;

/// The fake's alternatives for the token of `byte`, as the router must report them.
fn alternatives(byte: u8, n: u32) -> Vec<(String, f64)> {
    (0..n)
        .map(|k| {
            let text = ((byte + k as u8) as char).to_string();
            (text, -0.5 - f64::from(k))
        })
        .collect()
}

#[tokio::test]
async fn chat_logprobs_and_every_sampling_field_reach_both_workers() {
    let (decode, prefill, _ds, _ps, router) = setup().await;
    let r = post(
        &router.url,
        "/v1/chat/completions",
        json!({
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4, "logprobs": true, "top_logprobs": 2,
            "presence_penalty": 0.5, "frequency_penalty": -0.25,
            "logit_bias": {"5": -100, "7": 2.5}, "min_tokens": 2,
        }),
    )
    .await;
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    let choice = &body["choices"][0];
    let text = choice["message"]["content"].as_str().unwrap().to_string();
    let content = choice["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), text.len(), "{body}");
    for (entry, byte) in content.iter().zip(text.bytes()) {
        let token = (byte as char).to_string();
        assert_eq!(entry["token"], token.as_str());
        assert_eq!(entry["logprob"], -0.5);
        assert_eq!(entry["bytes"], json!([byte]));
        let top: Vec<(String, f64)> = entry["top_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                assert_eq!(t["bytes"], json!(t["token"].as_str().unwrap().as_bytes()));
                (
                    t["token"].as_str().unwrap().into(),
                    t["logprob"].as_f64().unwrap(),
                )
            })
            .collect();
        assert_eq!(top, alternatives(byte, 2), "{entry}");
    }

    let g = &decode.generate_calls()[0];
    let s = g.sampling.as_ref().unwrap();
    assert_eq!((s.presence_penalty, s.frequency_penalty), (0.5, -0.25));
    let bias: Vec<(u32, f32)> = s.logit_bias.iter().map(|b| (b.id, b.bias)).collect();
    assert_eq!(bias, [(5, -100.0), (7, 2.5)]);
    assert_eq!(s.top_logprobs, 2);
    assert_eq!(g.stop.as_ref().unwrap().min_tokens, 2);
    // The prefill worker samples the first token: it gets the same sampling and stop ids.
    let p = &prefill.calls()[0];
    assert_eq!(p.sampling.as_ref(), Some(s));
    assert_eq!(p.stop.as_ref().unwrap().min_tokens, 2);
    router.stop().await;
}

#[tokio::test]
async fn without_logprobs_nothing_is_asked_or_reported() {
    let (decode, _prefill, _ds, _ps, router) = setup().await;
    for (path, body) in [
        ("/v1/completions", json!({"prompt": "Hi", "max_tokens": 3})),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "logprobs": false, "top_logprobs": 0}),
        ),
    ] {
        let r = post(&router.url, path, body).await;
        assert_eq!(r.status(), 200);
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["choices"][0]["logprobs"], Value::Null, "{body}");
    }
    for g in decode.generate_calls() {
        assert_eq!(g.sampling.as_ref().unwrap().top_logprobs, 0);
    }
    router.stop().await;
}

#[tokio::test]
async fn completion_logprobs_stream_one_entry_per_chunk_in_the_legacy_shape() {
    let (_decode, _prefill, _ds, _ps, router) = setup().await;
    let r = post(
        &router.url,
        "/v1/completions",
        json!({"prompt": "Hi", "max_tokens": 4, "logprobs": 1, "stream": true}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let body = r.text().await.unwrap();
    let events = sse_payloads(&body);
    let mut offset = 0;
    let mut tokens = 0;
    for e in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(e).unwrap();
        let choice = &chunk["choices"][0];
        let text = choice["text"].as_str().unwrap();
        if text.is_empty() {
            continue;
        }
        let lp = &choice["logprobs"];
        assert_eq!(lp["tokens"], json!([text]), "{chunk}");
        assert_eq!(lp["token_logprobs"], json!([-0.5]));
        assert_eq!(lp["text_offset"], json!([offset]));
        // The one alternative asked for is the token itself: one entry.
        assert_eq!(lp["top_logprobs"], json!([{text: -0.5}]));
        offset += text.chars().count();
        tokens += 1;
    }
    assert_eq!(tokens, 4);

    // Non-streaming, two alternatives: the second is another token, so two entries.
    let r = post(
        &router.url,
        "/v1/completions",
        json!({"prompt": "Hi", "max_tokens": 3, "logprobs": 2}),
    )
    .await;
    let body: Value = r.json().await.unwrap();
    let lp = &body["choices"][0]["logprobs"];
    let text = body["choices"][0]["text"].as_str().unwrap();
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 3);
    assert_eq!(lp["text_offset"], json!([0, 1, 2]));
    for (dict, byte) in lp["top_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .zip(text.bytes())
    {
        let expected: serde_json::Map<String, Value> = alternatives(byte, 2)
            .into_iter()
            .map(|(t, l)| (t, json!(l)))
            .collect();
        assert_eq!(dict, &Value::Object(expected));
    }
    router.stop().await;
}

#[tokio::test]
async fn tgi_top_n_tokens_in_details_and_stream_events() {
    let (decode, _prefill, _ds, _ps, router) = setup().await;
    let r = post(
        &router.url,
        "/generate",
        json!({"inputs": "Hi", "parameters": {"max_new_tokens": 3, "details": true, "top_n_tokens": 2, "frequency_penalty": 0.5}}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    let details = &body["details"];
    let tokens = details["tokens"].as_array().unwrap();
    let top = details["top_tokens"].as_array().unwrap();
    assert_eq!(top.len(), tokens.len());
    for (token, top) in tokens.iter().zip(top) {
        let byte = token["text"].as_str().unwrap().as_bytes()[0];
        let id = token["id"].as_u64().unwrap();
        assert_eq!(
            top,
            &json!([
                {"id": id, "text": (byte as char).to_string(), "logprob": -0.5, "special": false},
                {"id": id + 1, "text": ((byte + 1) as char).to_string(), "logprob": -1.5, "special": false},
            ])
        );
    }
    assert_eq!(
        decode.generate_calls()[0]
            .sampling
            .as_ref()
            .unwrap()
            .frequency_penalty,
        0.5
    );

    let r = post(
        &router.url,
        "/generate_stream",
        json!({"inputs": "Hi", "parameters": {"max_new_tokens": 2, "top_n_tokens": 1}}),
    )
    .await;
    let body = r.text().await.unwrap();
    for e in sse_payloads(&body) {
        let event: Value = serde_json::from_str(&e).unwrap();
        let top = event["top_tokens"].as_array().unwrap();
        assert_eq!(top.len(), 1, "{event}");
        assert_eq!(top[0]["id"], event["token"]["id"]);
    }
    // Without top_n_tokens the field is absent, as before.
    let r = post(
        &router.url,
        "/generate",
        json!({"inputs": "Hi", "parameters": {"max_new_tokens": 2, "details": true}}),
    )
    .await;
    let body: Value = r.json().await.unwrap();
    assert!(body["details"].get("top_tokens").is_none(), "{body}");
    router.stop().await;
}

#[tokio::test]
async fn structured_output_reaches_both_workers_as_one_grammar() {
    use tandem_proto::v1::guide::Kind;
    let (decode, prefill, _ds, _ps, router) = setup().await;
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    let asks = [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                   "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}}),
            Kind::JsonSchema(schema.to_string()),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "response_format": {"type": "json_object"}}),
            Kind::JsonObject(true),
        ),
        (
            "/v1/completions",
            json!({"prompt": "Hi", "max_tokens": 3, "guided_choice": ["yes", "no"]}),
            Kind::Choice(tandem_proto::v1::Choices {
                choices: vec!["yes".into(), "no".into()],
            }),
        ),
        (
            "/v1/completions",
            json!({"prompt": "Hi", "max_tokens": 3, "guided_regex": "[0-9]+"}),
            Kind::Regex("[0-9]+".into()),
        ),
        (
            "/generate",
            json!({"inputs": "Hi", "parameters": {"max_new_tokens": 3, "grammar": {"type": "json", "value": schema}}}),
            Kind::JsonSchema(schema.to_string()),
        ),
    ];
    for (i, (path, body, kind)) in asks.into_iter().enumerate() {
        let r = post(&router.url, path, body).await;
        assert_eq!(r.status(), 200, "{path}");
        let g = &decode.generate_calls()[i];
        let guide = g.sampling.as_ref().unwrap().guide.as_ref().unwrap();
        assert_eq!(guide.kind.as_ref(), Some(&kind), "{path}");
        // The prefill worker samples the first token under the same grammar.
        let p = prefill.calls();
        assert_eq!(p[i].sampling.as_ref().unwrap().guide.as_ref(), Some(guide));
    }
    router.stop().await;
}

#[tokio::test]
async fn echo_puts_the_prompt_before_the_completion() {
    let (_decode, _prefill, _ds, _ps, router) = setup().await;
    let whole = |body: Value| {
        let url = router.url.clone();
        async move {
            let r = post(&url, "/v1/completions", body).await;
            assert_eq!(r.status(), 200);
            let v: Value = r.json().await.unwrap();
            v["choices"][0]["text"].as_str().unwrap().to_string()
        }
    };
    let plain = whole(json!({"prompt": "Hi there", "max_tokens": 3})).await;
    let echoed = whole(json!({"prompt": "Hi there", "max_tokens": 3, "echo": true})).await;
    assert_eq!(echoed, format!("Hi there{plain}"));
    // Token ids are echoed as their text.
    let ids: Vec<u32> = "Hey".bytes().map(|b| 3 + u32::from(b)).collect();
    let echoed = whole(json!({"prompt": ids, "max_tokens": 3, "echo": true})).await;
    assert_eq!(echoed, format!("Hey{plain}"));
    // Streaming: the prompt comes in the first chunk.
    let r = post(
        &router.url,
        "/v1/completions",
        json!({"prompt": "Hi there", "max_tokens": 3, "echo": true, "stream": true}),
    )
    .await;
    let body = r.text().await.unwrap();
    let events = sse_payloads(&body);
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert!(
        first["choices"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with("Hi there")
    );
    let streamed: String = events[..events.len() - 1]
        .iter()
        .map(|e| {
            let v: Value = serde_json::from_str(e).unwrap();
            v["choices"][0]["text"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    assert_eq!(streamed, format!("Hi there{plain}"));
    router.stop().await;
}

#[tokio::test]
async fn n_choices_come_back_indexed_and_best_of_keeps_the_likeliest() {
    let (decode, _prefill, _ds, _ps, router) = setup().await;
    // best_of 3, n 2: three generated (the fake's choice c has logprob -0.5 - c per token),
    // the two likeliest returned, numbered 0 and 1.
    let r = post(
        &router.url,
        "/v1/completions",
        json!({"prompt": "Hi", "max_tokens": 3, "n": 2, "best_of": 3, "logprobs": 0}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2, "{body}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        let lp = c["logprobs"]["token_logprobs"].as_array().unwrap();
        assert!(
            lp.iter().all(|v| v.as_f64() == Some(-0.5 - i as f64)),
            "{c}"
        );
    }
    assert_eq!(
        body["usage"]["completion_tokens"], 9,
        "every generated choice counts"
    );
    assert_eq!(decode.generate_calls()[0].sampling.as_ref().unwrap().n, 3);

    // Streamed chat with n = 2: each chunk names its choice, each choice opens with the
    // role and ends with a finish; the usage comes once, after both.
    let r = post(
        &router.url,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "n": 2,
               "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    let chunks: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let mut content = [String::new(), String::new()];
    let (mut roles, mut finishes, mut usages) = ([0; 2], [0; 2], 0);
    for chunk in &chunks {
        if !chunk["usage"].is_null() {
            usages += 1;
            assert_eq!(chunk["usage"]["completion_tokens"], 6);
            continue;
        }
        let c = &chunk["choices"][0];
        let i = c["index"].as_u64().unwrap() as usize;
        roles[i] += usize::from(c["delta"]["role"] == "assistant");
        finishes[i] += usize::from(!c["finish_reason"].is_null());
        content[i] += c["delta"]["content"].as_str().unwrap_or("");
    }
    assert_eq!((roles, finishes, usages), ([1, 1], [1, 1], 1), "{text}");
    assert_eq!(content[0], content[1]);
    assert!(!content[0].is_empty());
    assert!(text.ends_with("data: [DONE]\n\n"));
}

#[tokio::test]
async fn tgi_best_of_returns_the_other_sequences_in_the_details() {
    let (decode, _prefill, _ds, _ps, router) = setup().await;
    let r = post(
        &router.url,
        "/generate",
        json!({"inputs": "Hi", "parameters": {"max_new_tokens": 3, "best_of": 3, "do_sample": true,
               "seed": 10, "details": true}}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    let details = &body["details"];
    assert_eq!(
        details["seed"], 10,
        "the best is choice 0 (the likeliest): {body}"
    );
    let others = details["best_of_sequences"].as_array().unwrap();
    assert_eq!(others.len(), 2);
    assert_eq!(others[0]["seed"], 11);
    assert_eq!(others[1]["seed"], 12);
    assert_eq!(others[0]["generated_text"], body["generated_text"]);
    assert_eq!(others[0]["tokens"].as_array().unwrap().len(), 3);
    assert_eq!(decode.generate_calls()[0].sampling.as_ref().unwrap().n, 3);
}

#[tokio::test]
async fn prompt_logprobs_in_every_api_shape() {
    let (decode, prefill, _ds, _ps, router) = setup().await;
    // Completions `echo` with `logprobs: 1`: the prompt's tokens open the legacy object (the
    // fake prefill worker reports token i at -0.1 × i with its alternatives; one too many).
    let r = post(
        &router.url,
        "/v1/completions",
        json!({"prompt": "Hey", "max_tokens": 2, "echo": true, "logprobs": 1}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    let lp = &body["choices"][0]["logprobs"];
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(&tokens[..3], &["H", "e", "y"], "{body}");
    assert_eq!(tokens.len(), 5);
    assert!(lp["token_logprobs"][0].is_null());
    assert!(lp["top_logprobs"][0].is_null());
    assert!((lp["token_logprobs"][2].as_f64().unwrap() + 0.2).abs() < 1e-6);
    // One alternative (the fake's second is dropped) and the token itself.
    assert_eq!(
        lp["top_logprobs"][2].as_object().unwrap().len(),
        2,
        "{body}"
    );
    assert_eq!(lp["text_offset"], json!([0, 1, 2, 3, 4]));
    let asked = prefill.calls()[0]
        .sampling
        .as_ref()
        .unwrap()
        .prompt_logprobs;
    assert_eq!(asked, Some(1), "the prefill worker computes them");

    // vLLM's prompt_logprobs on chat: a top-level list, null first, then keyed by token id.
    let r = post(
        &router.url,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 2}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    let list = body["prompt_logprobs"].as_array().unwrap();
    assert!(list[0].is_null());
    let second = list[1].as_object().unwrap();
    assert_eq!(second.len(), 3, "own token and two alternatives: {body}");
    assert!(
        second
            .values()
            .any(|e| e["rank"] == 1 && e["logprob"].as_f64().unwrap() < -0.05)
    );
    let prompt_tokens = body["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert_eq!(list.len(), prompt_tokens);

    // Completions: in the choice. Streaming asks are refused.
    let r = post(
        &router.url,
        "/v1/completions",
        json!({"prompt": "Hey", "max_tokens": 2, "prompt_logprobs": 0}),
    )
    .await;
    let body: Value = r.json().await.unwrap();
    assert_eq!(
        body["choices"][0]["prompt_logprobs"]
            .as_array()
            .unwrap()
            .len(),
        3
    );
    let r = post(
        &router.url,
        "/v1/completions",
        json!({"prompt": "Hey", "prompt_logprobs": 1, "stream": true}),
    )
    .await;
    assert_eq!(r.status(), 400);
    let r = post(
        &router.url,
        "/v1/completions",
        json!({"prompt": "Hey", "prompt_logprobs": 21}),
    )
    .await;
    assert_eq!(r.status(), 400);

    // TGI's decoder_input_details: details.prefill, the first token without a logprob.
    let r = post(
        &router.url,
        "/generate",
        json!({"inputs": "Hey", "parameters": {"max_new_tokens": 2, "details": true,
               "decoder_input_details": true}}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    let prefill_tokens = body["details"]["prefill"].as_array().unwrap();
    assert_eq!(prefill_tokens.len(), 3, "{body}");
    assert_eq!(prefill_tokens[0]["text"], "H");
    assert!(prefill_tokens[0]["logprob"].is_null());
    assert!((prefill_tokens[1]["logprob"].as_f64().unwrap() + 0.1).abs() < 1e-6);
    let r = post(
        &router.url,
        "/generate_stream",
        json!({"inputs": "Hey", "parameters": {"decoder_input_details": true}}),
    )
    .await;
    assert_eq!(r.status(), 422);
    let _ = decode;
}

#[tokio::test]
async fn cached_prompt_tokens_are_reported_in_the_usage() {
    let (_decode, prefill, _ds, _ps, router) = setup().await;
    prefill.set_script(PrefillScript {
        cached_tokens: 3,
        ..Default::default()
    });
    let r = complete(&router.url, 2).await;
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert_eq!(
        body["usage"]["prompt_tokens_details"]["cached_tokens"], 3,
        "{body}"
    );
    assert_eq!(body["usage"]["tandem"]["cached_tokens"], 3);
    // A worker cannot claim more cached tokens than the prompt has.
    prefill.set_script(PrefillScript {
        cached_tokens: 1000,
        ..Default::default()
    });
    let r = complete(&router.url, 2).await;
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 5);
}
