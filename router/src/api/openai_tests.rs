//! Golden tests of the OpenAI objects and stream chunks (ids and timestamps fixed).

use super::*;
use crate::api::validate::UnimplementedFields;
use crate::flow::{FinishOut, FlowEvent, Head, RunMode, TokenOut};
use crate::routing::FallbackReason;
use tandem_proto::v1::FinishReason;
use tandem_proto::v1::Transport;

fn head(mode: RunMode) -> Head {
    Head {
        mode,
        kv_bytes: 4096,
        transport: (mode == RunMode::Disaggregated).then_some(Transport::Shm),
        fallback: None,
        prompt_logprobs: Vec::new(),
        cached_tokens: 0,
        kv_blocks: 0,
        decode_cached_tokens: 0,
        prefill_pulled_tokens: 0,
    }
}

fn formatter(kind: Kind, include_usage: bool, mode: RunMode) -> OpenAiFormatter {
    OpenAiFormatter {
        kind,
        id: "cmpl-ID".into(),
        created: 1_700_000_000,
        model: "m".into(),
        include_usage,
        head: Some(head(mode)),
        prompt_tokens: 5,
        started: Default::default(),
        echo: None,
        logprobs: None,
        prompt: Vec::new(),
        echo_logprobs: false,
        vllm_prompt_logprobs: false,
        served: Arc::new(ServedModel::new(
            "m",
            100,
            tandem_text::TextTokenizer::byte_level(),
            None,
        )),
        reply: None,
        replies: Default::default(),
        reasoning_tokens: 0,
        tgi_client: false,
    }
}

fn token(text: &str, index: u32) -> TokenOut {
    TokenOut {
        choice: 0,
        id: 40 + index,
        text: text.into(),
        logprob: -0.25,
        index,
        special: false,
        top_logprobs: Vec::new(),
    }
}

fn finish(reason: FinishReason, kv_bytes: u64, transport: Option<Transport>) -> FinishOut {
    FinishOut {
        choice: 0,
        last: true,
        reason,
        prompt_tokens: 5,
        completion_tokens: 2,
        total_completion_tokens: 2,
        kv_bytes,
        transport,
        cached_tokens: 3,
        kv_blocks: 2,
        decode_cached_tokens: 16,
        prefill_pulled_tokens: 0,
    }
}

/// A one-choice generation of `text` without tokens.
fn whole(text: &str, finish: FinishOut) -> crate::api::launch::CollectedAll {
    crate::api::launch::CollectedAll {
        choices: vec![crate::api::launch::Collected {
            text: text.into(),
            finish: finish.clone(),
            last_token: None,
            tokens: Vec::new(),
            generated_as: 0,
        }],
        finish,
    }
}

#[test]
fn completion_stream_with_usage_golden() {
    let mut f = formatter(Kind::Completion, true, RunMode::Disaggregated);
    let (a, done_a) = f.format(FlowEvent::Token(token("Hel", 0), None));
    let (b, done_b) = f.format(FlowEvent::Token(
        token("lo", 1),
        Some(finish(FinishReason::Length, 4096, Some(Transport::Shm))),
    ));
    assert!(!done_a && done_b);
    assert_eq!(
        a,
        "data: {\"id\":\"cmpl-ID\",\"object\":\"text_completion\",\"created\":1700000000,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\"Hel\",\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n"
    );
    assert_eq!(
        b,
        "data: {\"id\":\"cmpl-ID\",\"object\":\"text_completion\",\"created\":1700000000,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\"lo\",\"logprobs\":null,\"finish_reason\":\"length\"}],\"usage\":null}\n\n\
         data: {\"id\":\"cmpl-ID\",\"object\":\"text_completion\",\"created\":1700000000,\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2,\"total_tokens\":7,\"prompt_tokens_details\":{\"cached_tokens\":3},\"tandem\":{\"mode\":\"disaggregated\",\"kv_bytes\":4096,\"transport\":\"shm\",\"fallback_reason\":null,\"cached_tokens\":3,\"kv_blocks\":2,\"decode_cached_tokens\":16,\"prefill_pulled_tokens\":0}}}\n\n\
         data: [DONE]\n\n"
    );
}

#[test]
fn completion_stream_without_usage_puts_tandem_on_the_final_chunk() {
    let mut f = formatter(Kind::Completion, false, RunMode::Aggregated);
    if let Some(h) = f.head.as_mut() {
        h.fallback = Some(FallbackReason::NoPrefillWorker);
    }
    let (a, _) = f.format(FlowEvent::Token(token("x", 0), None));
    assert!(!a.contains("usage") && !a.contains("tandem"), "{a}");
    // The finish arrived on its own (stop string): an empty final chunk carries it.
    let (b, done) = f.format(FlowEvent::Finished(finish(FinishReason::Stop, 0, None)));
    assert!(done);
    assert_eq!(
        b,
        "data: {\"id\":\"cmpl-ID\",\"object\":\"text_completion\",\"created\":1700000000,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\"\",\"logprobs\":null,\"finish_reason\":\"stop\"}],\"tandem\":{\"mode\":\"aggregated\",\"kv_bytes\":0,\"transport\":null,\"fallback_reason\":\"no_prefill_worker\",\"cached_tokens\":3,\"kv_blocks\":2,\"decode_cached_tokens\":16,\"prefill_pulled_tokens\":0}}\n\n\
         data: [DONE]\n\n"
    );
}

#[test]
fn chat_stream_golden() {
    let mut f = formatter(Kind::Chat, true, RunMode::Disaggregated);
    f.id = "chatcmpl-ID".into();
    let (a, _) = f.format(FlowEvent::Token(token("Hi", 0), None));
    let (b, _) = f.format(FlowEvent::Token(token("!", 1), None));
    let (c, done) = f.format(FlowEvent::Finished(finish(
        FinishReason::Stop,
        4096,
        Some(Transport::Shm),
    )));
    assert!(done);
    assert_eq!(
        a,
        "data: {\"id\":\"chatcmpl-ID\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"m\",\"system_fingerprint\":\"tandem-0.1.0\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"Hi\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n"
    );
    assert_eq!(
        b,
        "data: {\"id\":\"chatcmpl-ID\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"m\",\"system_fingerprint\":\"tandem-0.1.0\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"!\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n"
    );
    assert!(c.starts_with(
        "data: {\"id\":\"chatcmpl-ID\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"m\",\"system_fingerprint\":\"tandem-0.1.0\",\"choices\":[{\"index\":0,\"delta\":{},\"logprobs\":null,\"finish_reason\":\"stop\"}],\"usage\":null}\n\n"
    ), "{c}");
    assert!(
        c.contains("\"choices\":[],\"usage\":{\"prompt_tokens\":5"),
        "{c}"
    );
    assert!(c.ends_with("data: [DONE]\n\n"));
}

#[test]
fn full_responses_golden() {
    let mut f = formatter(Kind::Completion, false, RunMode::Disaggregated);
    let body = f.full_response(&whole(
        "Hello",
        finish(FinishReason::Length, 4096, Some(Transport::Shm)),
    ));
    assert_eq!(
        body.to_string(),
        r#"{"id":"cmpl-ID","object":"text_completion","created":1700000000,"model":"m","choices":[{"index":0,"text":"Hello","logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7,"prompt_tokens_details":{"cached_tokens":3},"tandem":{"mode":"disaggregated","kv_bytes":4096,"transport":"shm","fallback_reason":null,"cached_tokens":3,"kv_blocks":2,"decode_cached_tokens":16,"prefill_pulled_tokens":0}}}"#
    );
    let mut chat = formatter(Kind::Chat, false, RunMode::Aggregated);
    chat.id = "chatcmpl-ID".into();
    let body = chat.full_response(&whole("Hi", finish(FinishReason::Stop, 0, None)));
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"][0]["message"]["content"], "Hi");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    assert_eq!(body["usage"]["tandem"]["mode"], "aggregated");
    assert_eq!(
        body["usage"]["tandem"]["transport"],
        serde_json::Value::Null
    );
}

#[test]
fn stream_error_golden() {
    let mut f = formatter(Kind::Completion, true, RunMode::Disaggregated);
    let (out, done) = f.format(FlowEvent::Failed(ApiError::WorkerUnavailable));
    assert!(done);
    assert_eq!(
        out,
        "data: {\"error\":{\"message\":\"a worker became unavailable while serving this request; retry later\",\"type\":\"service_unavailable_error\",\"param\":null,\"code\":503}}\n\ndata: [DONE]\n\n"
    );
    assert!(f.broken().ends_with("data: [DONE]\n\n"));
}

#[test]
fn prompt_shapes() {
    use serde_json::json;
    assert_eq!(
        parse_prompt(Some(json!("hi"))).unwrap(),
        PromptInput::Text("hi".into())
    );
    assert_eq!(
        parse_prompt(Some(json!(["hi"]))).unwrap(),
        PromptInput::Text("hi".into())
    );
    assert_eq!(
        parse_prompt(Some(json!([1, 2]))).unwrap(),
        PromptInput::Ids(vec![1, 2])
    );
    assert_eq!(
        parse_prompt(Some(json!([[1, 2]]))).unwrap(),
        PromptInput::Ids(vec![1, 2])
    );
    for bad in [
        json!(""),
        json!([]),
        json!(["a", "b"]),
        json!([[1], [2]]),
        json!([1, -1]),
        json!([1, "a"]),
        json!([1.5]),
        json!({"a": 1}),
        json!(5),
        json!(null),
    ] {
        assert!(parse_prompt(Some(bad.clone())).is_err(), "{bad}");
    }
}

#[test]
fn message_content_shapes() {
    use serde_json::json;
    assert_eq!(message_text(Some(json!("a")), 0).unwrap(), "a");
    assert_eq!(message_text(None, 0).unwrap(), "");
    assert_eq!(
        message_text(
            Some(json!([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])),
            0
        )
        .unwrap(),
        "a\nb"
    );
    assert!(message_text(Some(json!([{"type": "image_url", "image_url": {}}])), 1).is_err());
    assert!(message_text(Some(json!(3)), 0).is_err());
}

#[test]
fn unimplemented_fields_pass_only_when_they_ask_for_the_default() {
    let fields =
        |json: serde_json::Value| -> UnimplementedFields { serde_json::from_value(json).unwrap() };
    let param_of = |json: serde_json::Value| match refuse_unimplemented(&fields(json)) {
        Ok(()) => None,
        Err(ApiError::Invalid { param, .. }) => param,
        Err(other) => panic!("{other}"),
    };
    // What clients send when they want nothing special.
    for json in [
        serde_json::json!({}),
        serde_json::json!({"tool_choice": "none", "functions": [], "function_call": "auto",
            "guided_whitespace_pattern": null}),
    ] {
        assert_eq!(param_of(json.clone()), None, "{json}");
    }
    for (json, param) in [
        (
            serde_json::json!({"guided_whitespace_pattern": "\\s*"}),
            "guided_whitespace_pattern",
        ),
        (
            serde_json::json!({"tool_choice": {"type": "function"}}),
            "tool_choice",
        ),
        (
            serde_json::json!({"function_call": {"name": "f"}}),
            "function_call",
        ),
    ] {
        assert_eq!(param_of(json.clone()).as_deref(), Some(param), "{json}");
    }
}
