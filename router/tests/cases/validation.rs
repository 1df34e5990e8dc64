//! The bad-input matrix: every case gets its status and error body, and none reaches a
//! worker. Also the body limit (413) and the exact context-length boundary.

use super::*;

struct Case {
    name: &'static str,
    path: &'static str,
    content_type: Option<&'static str>,
    body: Vec<u8>,
    status: u16,
    /// The `param` an OpenAI error must name (None: not checked).
    param: Option<&'static str>,
    /// Words the message must contain.
    says: &'static [&'static str],
}

fn case(name: &'static str, path: &'static str, body: Value, status: u16) -> Case {
    Case {
        name,
        path,
        content_type: Some("application/json"),
        body: body.to_string().into_bytes(),
        status,
        param: None,
        says: &[],
    }
}

impl Case {
    fn param(mut self, p: &'static str) -> Self {
        self.param = Some(p);
        self
    }
    fn says(mut self, words: &'static [&'static str]) -> Self {
        self.says = words;
        self
    }
    fn raw(mut self, body: &[u8]) -> Self {
        self.body = body.to_vec();
        self
    }
    fn content_type(mut self, ct: Option<&'static str>) -> Self {
        self.content_type = ct;
        self
    }
}

fn matrix() -> Vec<Case> {
    let c = "/v1/completions";
    let chat = "/v1/chat/completions";
    let user = json!([{"role": "user", "content": "Hi"}]);
    vec![
        case("empty prompt", c, json!({"prompt": ""}), 400).param("prompt").says(&["empty"]),
        case("missing prompt", c, json!({"max_tokens": 3}), 400).param("prompt"),
        case("empty prompt list", c, json!({"prompt": []}), 400).param("prompt"),
        case("batched prompts", c, json!({"prompt": ["a", "b"]}), 400).param("prompt"),
        case("token id out of vocabulary", c, json!({"prompt": [1, 999999]}), 400).param("prompt"),
        case("prompt + max_tokens over context", c, json!({"prompt": "Hello", "max_tokens": 124}), 400)
            .param("max_tokens")
            .says(&["128", "129", "124"]),
        case("prompt alone fills the context", c, json!({"prompt": "x".repeat(128), "max_tokens": 1}), 400)
            .param("prompt")
            .says(&["128"]),
        case("max_tokens 0", c, json!({"prompt": "Hi", "max_tokens": 0}), 400).param("max_tokens").says(&["at least 1"]),
        case("max_tokens negative", c, json!({"prompt": "Hi", "max_tokens": -1}), 400).param("max_tokens"),
        case("max_tokens absurd", c, json!({"prompt": "Hi", "max_tokens": 4294967296u64}), 400).param("max_tokens"),
        case("max_tokens huge", c, json!({"prompt": "Hi", "max_tokens": 100000}), 400).param("max_tokens"),
        case("max_tokens string", c, json!({"prompt": "Hi", "max_tokens": "10"}), 400).param("max_tokens"),
        case("max_tokens float", c, json!({"prompt": "Hi", "max_tokens": 10.5}), 400).param("max_tokens"),
        case("temperature negative", c, json!({"prompt": "Hi", "temperature": -1}), 400).param("temperature"),
        case("top_p zero", c, json!({"prompt": "Hi", "top_p": 0}), 400).param("top_p"),
        case("top_p above one", c, json!({"prompt": "Hi", "top_p": 1.5}), 400).param("top_p"),
        case("n = 17", c, json!({"prompt": "Hi", "n": 17}), 400).param("n").says(&["16"]),
        case("best_of under n", c, json!({"prompt": "Hi", "n": 3, "best_of": 2}), 400).param("best_of"),
        case("best_of streamed", c, json!({"prompt": "Hi", "n": 1, "best_of": 2, "stream": true}), 400).param("best_of"),
        case("top_k -2", c, json!({"prompt": "Hi", "top_k": -2}), 400).param("top_k"),
        case("min_tokens over max_tokens", c, json!({"prompt": "Hi", "min_tokens": 5, "max_tokens": 4}), 400)
            .param("min_tokens").says(&["5", "4"]),
        case("min_tokens negative", c, json!({"prompt": "Hi", "min_tokens": -1}), 400).param("min_tokens"),
        case("logprobs over 20", c, json!({"prompt": "Hi", "logprobs": 21}), 400).param("logprobs").says(&["20"]),
        case("logprobs negative", c, json!({"prompt": "Hi", "logprobs": -1}), 400).param("logprobs"),
        case("top_logprobs on completions", c, json!({"prompt": "Hi", "top_logprobs": 2}), 400).param("top_logprobs"),
        case("presence_penalty over 2", c, json!({"prompt": "Hi", "presence_penalty": 2.5}), 400).param("presence_penalty"),
        case("frequency_penalty under -2", chat, json!({"messages": user, "frequency_penalty": -3}), 400).param("frequency_penalty"),
        case("logit_bias id out of vocabulary", c, json!({"prompt": "Hi", "logit_bias": {"999999": 1}}), 400)
            .param("logit_bias").says(&["999999"]),
        case("logit_bias key not an id", c, json!({"prompt": "Hi", "logit_bias": {"hello": 1}}), 400).param("logit_bias"),
        case("logit_bias over 100", c, json!({"prompt": "Hi", "logit_bias": {"5": 101}}), 400).param("logit_bias"),
        case("logit_bias not a number", c, json!({"prompt": "Hi", "logit_bias": {"5": "x"}}), 400).param("logit_bias"),
        case("prompt_logprobs streamed", c, json!({"prompt": "Hi", "prompt_logprobs": 1, "stream": true}), 400).param("prompt_logprobs"),
        case("prompt_logprobs over 20", c, json!({"prompt": "Hi", "prompt_logprobs": 21}), 400).param("prompt_logprobs").says(&["20"]),
        case("response_format xml", chat, json!({"messages": user, "response_format": {"type": "xml"}}), 400)
            .param("response_format").says(&["xml"]),
        case("json_schema without a schema", c, json!({"prompt": "Hi", "response_format": {"type": "json_schema"}}), 400)
            .param("response_format"),
        case("guided_choice empty", c, json!({"prompt": "Hi", "guided_choice": []}), 400).param("guided_choice"),
        case("guided_json not a schema", chat, json!({"messages": user, "guided_json": 5}), 400).param("guided_json"),
        case("guided_regex that does not compile", c, json!({"prompt": "Hi", "guided_regex": "(a"}), 400)
            .param("guided_regex"),
        case("guided_grammar that does not compile", c, json!({"prompt": "Hi", "guided_grammar": "start: nowhere"}), 400)
            .param("guided_grammar"),
        case("two kinds of structured output", c, json!({"prompt": "Hi", "guided_regex": "a", "guided_choice": ["b"]}), 400)
            .says(&["one kind"]),
        case("guided_whitespace_pattern", c, json!({"prompt": "Hi", "guided_json": {}, "guided_whitespace_pattern": " "}), 400)
            .param("guided_whitespace_pattern"),
        case("top_logprobs without logprobs", chat, json!({"messages": user, "top_logprobs": 3}), 400)
            .param("top_logprobs").says(&["logprobs"]),
        case("top_logprobs over 20", chat, json!({"messages": user, "logprobs": true, "top_logprobs": 21}), 400)
            .param("top_logprobs"),
        case("tool_choice required", chat, json!({"messages": user, "tool_choice": "required"}), 400).param("tool_choice"),
        case("tool not a function", chat, json!({"messages": user, "tools": [{"type": "retrieval"}]}), 400).param("tools[0].type"),
        case("tool without a name", chat, json!({"messages": user, "tools": [{"type": "function", "function": {}}]}), 400)
            .param("tools[0].function.name"),
        case("tool_choice names no tool", chat, json!({"messages": user, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}), 400).param("tool_choice").says(&["`g`"]),
        case("forced call with a response_format", chat, json!({"messages": user, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "required", "response_format": {"type": "json_object"}}), 400).param("response_format"),
        case("tool call arguments not JSON", chat, json!({"messages": [{"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}), 400)
            .param("messages[0].tool_calls[0].function.arguments"),
        case("tool_choice on completions", c, json!({"prompt": "Hi", "tool_choice": "required"}), 400).param("tool_choice"),
        case("chat_template_kwargs not an object", chat, json!({"messages": user, "chat_template_kwargs": [1]}), 400)
            .param("chat_template_kwargs"),
        case("functions", chat, json!({"messages": user, "functions": [{"name": "f"}]}), 400).param("functions"),
        case("stream_options without stream", c, json!({"prompt": "Hi", "stream_options": {"include_usage": true}}), 400)
            .param("stream_options").says(&["stream"]),
        case("tgi grammar of an unknown type", "/generate", json!({"inputs": "Hi", "parameters": {"grammar": {"type": "lark", "value": "x"}}}), 422)
            .says(&["grammar"]),
        case("tgi regex that does not compile", "/generate", json!({"inputs": "Hi", "parameters": {"grammar": {"type": "regex", "value": "[z-a]"}}}), 422)
            .says(&["grammar"]),
        case("unknown model", c, json!({"model": "nope", "prompt": "Hi"}), 404).param("model").says(&["nope"]),
        case("prompt wrong type", c, json!({"prompt": 5}), 400).param("prompt"),
        case("stream wrong type", c, json!({"prompt": "Hi", "stream": "yes"}), 400).param("stream"),
        case("malformed JSON", c, json!(null), 400).raw(b"{\"prompt\": \"Hi\""),
        case("trailing garbage", c, json!(null), 400).raw(b"{\"prompt\": \"Hi\"} x"),
        case("not an object", c, json!([1, 2]), 400),
        case("non-UTF-8 body", c, json!(null), 400).raw(b"{\"prompt\": \"\xff\xfe\"}").says(&["UTF-8"]),
        case("lone surrogate", c, json!(null), 400).raw(br#"{"prompt": "\ud800"}"#),
        case("deep nesting", c, json!(null), 400).raw("[".repeat(10_000).as_bytes()),
        case("wrong content type", c, json!({"prompt": "Hi"}), 415).content_type(Some("text/plain")),
        case("no content type", c, json!({"prompt": "Hi"}), 415).content_type(None),
        case("empty messages", chat, json!({"messages": []}), 400).param("messages"),
        case("missing messages", chat, json!({"max_tokens": 2}), 400).param("messages"),
        case("image content", chat, json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}), 400)
            .param("messages[0].content"),
        case("chat over context", chat, json!({"messages": user, "max_completion_tokens": 1000}), 400)
            .param("max_completion_tokens")
            .says(&["128"]),
        case("chat n = 0", chat, json!({"messages": user, "n": 0}), 400).param("n"),
        case("chat temperature", chat, json!({"messages": user, "temperature": -0.5}), 400).param("temperature"),
        case("tgi empty inputs", "/generate", json!({"inputs": ""}), 422),
        case("tgi missing inputs", "/generate", json!({"parameters": {}}), 422),
        case("tgi max_new_tokens 0", "/generate_stream", json!({"inputs": "Hi", "parameters": {"max_new_tokens": 0}}), 422),
        case("tgi temperature 0", "/generate", json!({"inputs": "Hi", "parameters": {"temperature": 0.0}}), 422),
        case("tgi top_p", "/generate", json!({"inputs": "Hi", "parameters": {"top_p": 1.5}}), 422),
        case("tgi best_of streamed", "/generate_stream", json!({"inputs": "Hi", "parameters": {"best_of": 2, "do_sample": true}}), 422),
        case("tgi best_of greedy", "/generate", json!({"inputs": "Hi", "parameters": {"best_of": 2}}), 422),
        case("tgi top_n_tokens over 20", "/generate", json!({"inputs": "Hi", "parameters": {"top_n_tokens": 21}}), 422)
            .says(&["top_n_tokens"]),
        case("tgi frequency_penalty", "/generate", json!({"inputs": "Hi", "parameters": {"frequency_penalty": 3.0}}), 422)
            .says(&["frequency_penalty"]),
        case("tgi over context", "/generate", json!({"inputs": "Hello", "parameters": {"max_new_tokens": 124}}), 422)
            .says(&["128", "129"]),
        case("tgi malformed", "/generate_stream", json!(null), 422).raw(b"{\"inputs\":"),
        case("tgi wrong content type", "/generate", json!({"inputs": "Hi"}), 415).content_type(Some("text/plain")),
    ]
}

#[tokio::test]
async fn bad_input_matrix_never_reaches_a_worker() {
    let (decode, prefill, _ds, _ps, router) = setup().await;
    let cases = matrix();
    let total = cases.len();
    for case in cases {
        let mut req = client()
            .post(format!("{}{}", router.url, case.path))
            .body(case.body.clone());
        if let Some(ct) = case.content_type {
            req = req.header("content-type", ct);
        }
        let r = req.send().await.unwrap();
        assert_eq!(r.status().as_u16(), case.status, "{}", case.name);
        assert!(r.headers().get("x-request-id").is_some(), "{}", case.name);
        let body: Value = r
            .json()
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        let message = if case.path.starts_with("/v1") {
            let e = &body["error"];
            assert!(e["type"].is_string(), "{}: {body}", case.name);
            assert!(
                e.get("code").is_some() && e.get("param").is_some(),
                "{}: {body}",
                case.name
            );
            if let Some(p) = case.param {
                assert_eq!(e["param"], p, "{}: {body}", case.name);
            }
            e["message"].as_str().unwrap_or_default().to_string()
        } else {
            assert_eq!(body["error_type"], "validation", "{}: {body}", case.name);
            body["error"].as_str().unwrap_or_default().to_string()
        };
        assert!(!message.is_empty(), "{}", case.name);
        for word in case.says {
            assert!(
                message.contains(word),
                "{}: {message:?} lacks {word:?}",
                case.name
            );
        }
    }
    assert!(total >= 40);
    assert!(
        decode.generate_calls().is_empty(),
        "bad input reached the decode worker"
    );
    assert!(
        prefill.calls().is_empty(),
        "bad input reached the prefill worker"
    );
    router.stop().await;
}

#[tokio::test]
async fn context_boundary_is_accepted() {
    let (decode, _prefill, _ds, _ps, router) = setup().await;
    // 5 prompt tokens + 123 = 128, exactly the context length.
    let r = complete(&router.url, 123).await;
    assert_eq!(r.status(), 200);
    let r = post(
        &router.url,
        "/generate",
        json!({"inputs": "Hello", "parameters": {"max_new_tokens": 123}}),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        decode.generate_calls()[0].stop.as_ref().unwrap().max_tokens,
        123
    );
    router.stop().await;
}

#[tokio::test]
async fn oversized_body_is_413() {
    let decode = FakeDecode::new("decode-0");
    let ds = FakeServer::decode(&decode);
    let mut c = config(&[], &[&ds]);
    c.body_limit_bytes = 4096;
    let router = TestRouter::start(c).await;
    for path in ["/v1/completions", "/generate"] {
        let body = json!({"prompt": "x".repeat(10_000), "inputs": "x"});
        let r = post(&router.url, path, body).await;
        assert_eq!(r.status(), 413, "{path}");
        let err: Value = r.json().await.unwrap();
        let message = if path == "/generate" {
            err["error"].as_str().unwrap().to_string()
        } else {
            err["error"]["message"].as_str().unwrap().to_string()
        };
        assert!(message.contains("4096"), "{message}");
    }
    assert!(decode.generate_calls().is_empty());
    router.stop().await;
}
