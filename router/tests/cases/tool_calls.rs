//! Tool calls and reasoning through the router: a decode worker whose model has Qwen3's
//! chat template (thinking, Hermes tool calls) streams a scripted reply that thinks, then
//! calls a tool; the whole and the streamed answer take it apart alike, the tools and the
//! conversation's calls and results reach the template, and `chat_template_kwargs` too.

use super::*;

const THINKING: &str = "<think>\nThe user wants the weather.\n</think>";
const CALL: &str =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

fn qwen3_template() -> String {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../text/tests/templates/qwen3.jinja"
    );
    std::fs::read_to_string(path).unwrap()
}

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])
}

/// A router over one decode fake with Qwen3's template, a long context, and `reply` scripted.
async fn qwen3_router(reply: &str) -> (FakeDecode, FakeServer, TestRouter) {
    let decode = FakeDecode::new("decode-0");
    {
        let mut info = lock(&decode.0.info);
        info.context_length = 8192;
        if let Some(t) = info.tokenizer.as_mut() {
            t.chat_template = Some(qwen3_template());
        }
    }
    let mut tokens = text_tokens(reply);
    tokens.push((EOS, String::new()));
    decode.set_script(DecodeScript {
        tokens,
        ..DecodeScript::default()
    });
    let ds = FakeServer::decode(&decode);
    let router = TestRouter::start(config(&[], &[&ds])).await;
    (decode, ds, router)
}

/// The text of the last prompt the decode fake was asked to run (byte-level ids).
fn last_prompt(decode: &FakeDecode) -> String {
    let calls = decode.generate_calls();
    let ids = &calls.last().unwrap().prompt;
    let tok = tokenizer();
    tok.decode(ids, false).unwrap()
}

#[tokio::test]
async fn a_reply_that_thinks_then_calls_is_taken_apart_whole_and_streamed() {
    let (decode, _ds, router) = qwen3_router(&format!("{THINKING}\n\n{CALL}")).await;
    let ask =
        json!({"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools()});
    let r = post(&router.url, "/v1/chat/completions", ask.clone()).await;
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{body}");
    let message = &choice["message"];
    assert_eq!(message["content"], Value::Null);
    assert_eq!(message["reasoning_content"], "The user wants the weather.");
    let call = &message["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert!(call["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(
        call["function"],
        json!({"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"})
    );
    // Every byte of the block is a token here.
    assert_eq!(
        body["usage"]["completion_tokens_details"]["reasoning_tokens"],
        THINKING.len()
    );
    // The template saw the tools.
    let prompt = last_prompt(&decode);
    assert!(
        prompt.contains("<tools>") && prompt.contains("\"name\": \"get_weather\""),
        "{prompt}"
    );

    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let r = post(&router.url, "/v1/chat/completions", streamed).await;
    let chunks = sse_json(&r.text().await.unwrap());
    let (mut reasoning, mut content, mut calls, mut finish, mut usage) = (
        String::new(),
        String::new(),
        Vec::<Value>::new(),
        None,
        None,
    );
    for chunk in &chunks {
        if let Some(u) = chunk.get("usage").filter(|u| !u.is_null()) {
            usage = Some(u.clone());
        }
        let Some(choice) = chunk["choices"].get(0) else {
            continue;
        };
        let delta = &choice["delta"];
        reasoning += delta["reasoning_content"].as_str().unwrap_or("");
        content += delta["content"].as_str().unwrap_or("");
        calls.extend(delta["tool_calls"].as_array().cloned().unwrap_or_default());
        finish = choice["finish_reason"]
            .as_str()
            .map(str::to_string)
            .or(finish);
    }
    assert_eq!(reasoning, "The user wants the weather.");
    assert_eq!(content, "");
    assert_eq!(calls.len(), 1, "{chunks:?}");
    assert_eq!(calls[0]["index"], 0);
    assert_eq!(calls[0]["function"], call["function"]);
    assert_eq!(finish.as_deref(), Some("tool_calls"));
    assert_eq!(
        usage.unwrap()["completion_tokens_details"]["reasoning_tokens"],
        THINKING.len()
    );
    // Nothing is sent for tokens that settle nothing: far fewer chunks than tokens.
    assert!(chunks.len() < THINKING.len(), "{}", chunks.len());
    router.stop().await;
}

#[tokio::test]
async fn calls_and_results_go_back_through_the_template() {
    let (decode, _ds, router) = qwen3_router("It is sunny in Paris.").await;
    let loop_ = json!({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"sky\": \"sunny\"}"},
    ], "tools": tools(), "chat_template_kwargs": {"enable_thinking": false}});
    let r = post(&router.url, "/v1/chat/completions", loop_).await;
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    let message = &body["choices"][0]["message"];
    assert_eq!(message["content"], "It is sunny in Paris.");
    assert_eq!(message["reasoning_content"], Value::Null);
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    let prompt = last_prompt(&decode);
    // The call's arguments as an object (Qwen's template prints them with tojson), the
    // result in a tool response, and thinking switched off by the template variable.
    assert!(
        prompt.contains("{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}"),
        "{prompt}"
    );
    assert!(
        prompt.contains("<tool_response>\n{\"sky\": \"sunny\"}\n</tool_response>"),
        "{prompt}"
    );
    assert!(prompt.ends_with("<think>\n\n</think>\n\n"), "{prompt}");
    router.stop().await;
}

#[tokio::test]
async fn a_malformed_call_is_content_never_an_error() {
    let bad = "<tool_call>\n{\"name\": get_weather}\n</tool_call>";
    let (_decode, _ds, router) = qwen3_router(bad).await;
    let ask = json!({"messages": [{"role": "user", "content": "Weather?"}], "tools": tools()});
    let r = post(&router.url, "/v1/chat/completions", ask).await;
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["choices"][0]["message"]["content"], bad);
    assert_eq!(body["choices"][0]["message"].get("tool_calls"), None);
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    router.stop().await;
}
