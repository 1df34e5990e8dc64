//! Malformed and out-of-range requests on every generation route: each must get a 4xx that
//! names the offending field (OpenAI's `error.param`, or the field's name in TGI's error
//! message), never a 5xx, and the router's memory must not grow with them.

use std::time::Duration;

use anyhow::Context;
use serde_json::{Value, json};
use tandem_e2e::rss_kib;

use crate::client::token_prompt;
use crate::deployment::Deployment;

const COMPLETIONS: &str = "/v1/completions";
const CHAT: &str = "/v1/chat/completions";
const GENERATE: &str = "/generate";
const GENERATE_STREAM: &str = "/generate_stream";
const JSON: &str = "application/json";

/// One malformed request and the field its refusal must name (None: a body-level error,
/// which must carry a non-empty message).
struct BadInput {
    path: &'static str,
    body: Vec<u8>,
    content_type: &'static str,
    field: Option<&'static str>,
}

/// A JSON body whose refusal must name `field`.
fn bad(path: &'static str, body: Value, field: &'static str) -> BadInput {
    BadInput {
        path,
        body: body.to_string().into_bytes(),
        content_type: JSON,
        field: Some(field),
    }
}

/// A valid request on `path` but for `field`, set to `value`: the refusal must name it.
fn bad_field(path: &'static str, field: &'static str, value: Value) -> BadInput {
    let mut body = match path {
        COMPLETIONS => json!({"prompt": "hi"}),
        CHAT => json!({"messages": [{"role": "user", "content": "hi"}]}),
        _ => json!({"inputs": "hi", "parameters": {}}),
    };
    // TGI's sampling fields live under `parameters`.
    let fields = match body.get_mut("parameters") {
        Some(parameters) => parameters,
        None => &mut body,
    };
    fields[field] = value;
    bad(path, body, field)
}

/// Bytes that are not a request at all (broken JSON, wrong content type, bad UTF-8).
fn bad_raw(path: &'static str, body: impl Into<Vec<u8>>, content_type: &'static str) -> BadInput {
    BadInput {
        path,
        body: body.into(),
        content_type,
        field: None,
    }
}

fn bad_inputs(vocab: u32, context: u32) -> Vec<BadInput> {
    use {CHAT as CH, COMPLETIONS as C, GENERATE as G, GENERATE_STREAM as GS};
    let long_stop = "é".repeat(129); // 258 bytes of UTF-8
    vec![
        bad_raw(C, r#"{"prompt": "hi""#, JSON),
        bad_raw(C, r#"{"prompt": "hi"} trailing"#, JSON),
        bad_raw(C, "", JSON),
        bad_raw(C, b"{\"prompt\": \"\xff\xfe\"}", JSON),
        bad_raw(C, r#"{"prompt": "hi"}"#, "text/plain"),
        bad_raw(C, "[".repeat(10_000), JSON),
        bad_raw(C, r#"{"prompt": "\ud800"}"#, JSON),
        bad_raw(
            C,
            format!(r#"{{"prompt": "{}"}}"#, "a".repeat(2_100_000)),
            JSON,
        ),
        bad_field(C, "max_tokens", json!("10")),
        bad(C, json!({"prompt": 42}), "prompt"),
        bad(C, json!({"prompt": ""}), "prompt"),
        bad(C, json!({"prompt": []}), "prompt"),
        bad(C, json!({"prompt": ["a", "b"]}), "prompt"),
        bad(C, json!({"max_tokens": 4}), "prompt"),
        bad_field(C, "max_tokens", json!(0)),
        bad_field(C, "max_tokens", json!(-1)),
        bad_field(C, "max_tokens", json!(1u64 << 40)),
        bad_field(C, "max_tokens", json!(4_000_000_000u64)),
        bad_field(C, "temperature", json!(-1)),
        bad_field(C, "temperature", json!(150)),
        bad_field(C, "top_p", json!(0)),
        bad_field(C, "top_p", json!(1.5)),
        bad_field(C, "top_k", json!(-5)),
        bad_field(C, "repetition_penalty", json!(0)),
        bad_field(C, "repetition_penalty", json!(50)),
        bad_field(C, "stop", json!(vec!["x"; 17])),
        bad_field(C, "stop", json!([&long_stop])),
        bad_field(C, "stop", json!([""])),
        bad_field(C, "stop_token_ids", json!([vocab])),
        bad_field(C, "stop_token_ids", json!(vec![5; 65])),
        bad_field(C, "n", json!(17)),
        bad_field(C, "best_of", json!(17)),
        bad_field(C, "model", json!("no-such-model")),
        bad(C, json!({"prompt": [vocab + 5, 4]}), "prompt"),
        bad(
            C,
            json!({"prompt": token_prompt(context), "max_tokens": 1}),
            "prompt",
        ),
        bad_field(C, "max_tokens", json!(context)),
        bad_field(C, "logprobs", json!(21)),
        bad_field(C, "echo", json!("yes")),
        bad_field(C, "min_tokens", json!(-1)),
        bad_field(C, "seed", json!("abc")),
        bad_field(C, "stream", json!("yes")),
        bad_field(C, "presence_penalty", json!(2.5)),
        bad_field(C, "logit_bias", json!({"5": 101})),
        bad(
            CH,
            json!({"messages": [{"role": "wizard", "content": "hi"}]}),
            "messages[0].role",
        ),
        bad(CH, json!({"messages": []}), "messages"),
        bad(CH, json!({"max_tokens": 4}), "messages"),
        bad_field(CH, "temperature", json!(101)),
        bad(
            CH,
            json!({"messages": [{"role": "user", "content": 5}]}),
            "messages[0].content",
        ),
        bad_field(CH, "max_completion_tokens", json!(0)),
        bad_field(CH, "tools", json!([{"type": "function"}])),
        bad_field(CH, "n", json!(17)),
        bad_field(CH, "model", json!("gpt-9")),
        bad(CH, json!({"messages": "hi"}), "messages"),
        bad_raw(CH, r#"{"messages": [}"#, JSON),
        bad(G, json!({"inputs": ""}), "inputs"),
        bad(G, json!({"parameters": {"max_new_tokens": 4}}), "inputs"),
        bad_field(G, "max_new_tokens", json!(0)),
        bad(
            G,
            json!({"inputs": "hi", "parameters": {"temperature": 150, "do_sample": true}}),
            "temperature",
        ),
        bad_field(G, "temperature", json!(0)),
        bad_field(G, "top_p", json!(1.5)),
        bad_field(G, "top_k", json!(-5)),
        bad_field(G, "repetition_penalty", json!(50)),
        bad_field(G, "stop", json!([&long_stop])),
        bad(
            G,
            json!({"inputs": "hi", "parameters": "fast"}),
            "parameters",
        ),
        bad_field(G, "max_new_tokens", json!(context)),
        bad_raw(G, r#"{"inputs": "hi""#, JSON),
        bad(GS, json!({"inputs": ""}), "inputs"),
        bad_field(GS, "max_new_tokens", json!(-1)),
        bad_field(GS, "best_of", json!(2)),
        bad_field(GS, "top_n_tokens", json!(21)),
        bad_field(GS, "watermark", json!(true)),
        bad_field(GS, "truncate", json!(0)),
        bad_raw(GS, b"{\"inputs\": \"\xc3\x28\"}", JSON),
        bad_raw(
            GS,
            r#"{"inputs": "hi"}"#,
            "application/x-www-form-urlencoded",
        ),
        // Over the context on the TGI stream route, where the head must still be a real
        // status. " x" is at least one token under a byte-level and a BPE tokenizer alike
        // (BPE would merge a run of bare "x"s into fewer tokens than characters).
        bad(
            GS,
            json!({"inputs": " x".repeat(context as usize + 10)}),
            "inputs",
        ),
    ]
}

pub struct BadInputReport {
    pub tried: usize,
    pub named_4xx: usize,
    pub unnamed_4xx: usize,
    pub server_errors: usize,
    /// Not refused, or no answer at all.
    pub other: usize,
    pub failures: Vec<String>,
    /// Router RSS in KiB (before, after).
    pub router_rss: (u64, u64),
}

impl BadInputReport {
    pub fn passed(&self) -> bool {
        self.named_4xx + self.unnamed_4xx == self.tried && self.server_errors == 0
    }
}

/// How the router answered one bad input.
enum Answer {
    Named,
    Unnamed(String),
    ServerError(String),
    Other(String),
}

async fn send(dep: &Deployment, case: BadInput) -> Answer {
    let shown = String::from_utf8_lossy(&case.body[..case.body.len().min(60)]).into_owned();
    let what = format!("{} {shown}", case.path);
    let sent = dep
        .router
        .http
        .post(dep.router.url(case.path))
        .header("content-type", case.content_type)
        .body(case.body)
        .send();
    let response = match tokio::time::timeout(Duration::from_secs(30), sent).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return Answer::Other(format!("{what}: no answer ({e})")),
        Err(_) => return Answer::Other(format!("{what}: no answer in 30 s")),
    };
    let status = response.status();
    let body: Value = tokio::time::timeout(Duration::from_secs(10), response.json())
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or(Value::Null);
    if status.is_server_error() {
        return Answer::ServerError(format!("{what}: {status} {body}"));
    }
    if !status.is_client_error() {
        return Answer::Other(format!("{what}: {status} (not refused)"));
    }
    // OpenAI names the field in `error.param`; TGI's error is one message.
    let tgi = case.path.starts_with("/generate");
    let message = match tgi {
        true => body["error"].as_str(),
        false => body["error"]["message"].as_str(),
    };
    let named = match case.field {
        Some(field) if tgi => message.is_some_and(|m| m.contains(field)),
        // The field itself, or a path inside it (`tools[0].function` names `tools`).
        Some(field) => body["error"]["param"].as_str().is_some_and(|param| {
            param == field
                || param
                    .strip_prefix(field)
                    .is_some_and(|rest| rest.starts_with(['[', '.']))
        }),
        None => message.is_some_and(|m| !m.is_empty()),
    };
    match named {
        true => Answer::Named,
        false => Answer::Unnamed(format!(
            "{what}: {status} refused, but the answer does not name `{}`: {body}",
            case.field.unwrap_or("(a message)")
        )),
    }
}

pub async fn run(dep: &Deployment, vocab: u32, context: u32) -> anyhow::Result<BadInputReport> {
    let router = dep.pids().router.context("no router")?;
    let cases = bad_inputs(vocab, context);
    let mut report = BadInputReport {
        tried: cases.len(),
        named_4xx: 0,
        unnamed_4xx: 0,
        server_errors: 0,
        other: 0,
        failures: Vec::new(),
        router_rss: (rss_kib(router), 0),
    };
    for case in cases {
        let failure = match send(dep, case).await {
            Answer::Named => {
                report.named_4xx += 1;
                continue;
            }
            Answer::Unnamed(why) => {
                report.unnamed_4xx += 1;
                why
            }
            Answer::ServerError(why) => {
                report.server_errors += 1;
                why
            }
            Answer::Other(why) => {
                report.other += 1;
                why
            }
        };
        report.failures.push(failure);
    }
    report.router_rss.1 = rss_kib(router);
    Ok(report)
}
