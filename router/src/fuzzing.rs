//! Entry point of the `http_bodies` fuzz target (`fuzz/`, libFuzzer through cargo-fuzz) and
//! of the test that replays its corpus on every build: the body of a request to one of the
//! public routes that take one, sent through the router's HTTP application (its middleware,
//! the JSON extractor, the route's validation, admission, the chat template and the
//! tokenizer) as far as a router with a served model and no worker goes: every valid request
//! ends at "no decode worker". No server runs; the application is called as a service. It
//! must return, whatever the body, without a panic, an abort, a hang or an allocation the
//! body did not pay for.
//!
//! The first byte picks the route (its value modulo 7, in [`ROUTES`]' order) and the model
//! (its top bit): a model whose chat template takes tools and thinks (Hermes tool calls,
//! `<think>`), or a plain ChatML one. The rest is the body. TGI's chat form is OpenAI's chat
//! route with `"model": "tgi"`, which the seeds hold.

use std::sync::{Arc, OnceLock};

use axum::Router;
use axum::body::Body;
use axum::http::{Method, Request, header};
use tandem_auth::InternalAuth;
use tandem_proto::v1::Transport;
use tandem_text::{ChatTemplate, TextTokenizer};
use tower::ServiceExt;

use crate::api::{app, state::AppState};
use crate::config::RouterConfig;
use crate::model::ServedModel;
use crate::workers::WorkerPool;

/// The routes that take a body, as the first byte of an input picks them.
pub const ROUTES: [&str; 7] = [
    "/v1/completions",
    "/v1/chat/completions",
    "/generate",
    "/generate_stream",
    "/",
    "/tokenize",
    "/detokenize",
];

/// A chat template in Qwen's shape: tools in a system turn, Hermes `<tool_call>`s, tool
/// results, and a `<think>` block the generation prompt opens (or closes empty with
/// `enable_thinking: false`).
const TOOLS_TEMPLATE: &str = r#"{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
For each call return <tool_call>{"name": <name>, "arguments": <args>}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif not (tools and loop.first and message.role == 'system') %}<|im_start|>{{ message.role }}
{{ message.content }}
{%- if message.tool_calls %}{% for call in message.tool_calls %}
<tool_call>
{{ call.function | tojson }}
</tool_call>{% endfor %}{% endif %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"#;

/// The context length of the fuzzed models: room for a long prompt, and a completion budget
/// that runs out.
const CONTEXT: u32 = 4096;

/// The application around a model (`tools`: [`TOOLS_TEMPLATE`]'s, else the byte-level
/// tokenizer's own ChatML), with no worker; `None` when it could not be built.
fn application(tools: bool) -> Option<&'static Router> {
    static APPS: OnceLock<Option<[Router; 2]>> = OnceLock::new();
    let build = |tools: bool| -> Option<Router> {
        let tokenizer = TextTokenizer::byte_level();
        let info = tokenizer.info();
        let source = match tools {
            true => TOOLS_TEMPLATE,
            false => info.chat_template.as_deref()?,
        };
        let template =
            ChatTemplate::new(source, info.bos_token.as_deref(), info.eos_token.as_deref()).ok()?;
        let model = ServedModel::new("fuzz-model", CONTEXT, tokenizer, Some(template));
        let config = RouterConfig::new(Vec::new(), Vec::new());
        let pool = WorkerPool::new(&[], &[], Transport::Shm, None, InternalAuth::none()).ok()?;
        if !pool.adopt_model(model) {
            return None;
        }
        // A recorder of its own, not installed: the metrics of millions of requests go
        // nowhere, rather than into a registry that grows.
        let prometheus = metrics_exporter_prometheus::PrometheusBuilder::new()
            .build_recorder()
            .handle();
        Some(app(AppState::new(config, Arc::new(pool), prometheus)))
    };
    APPS.get_or_init(|| Some([build(false)?, build(true)?]))
        .as_ref()
        .map(|apps| &apps[usize::from(tools)])
}

/// One runtime for every input: the application is async, tokenizes on the blocking pool,
/// and starts each request's flow as a task.
fn runtime() -> Option<&'static tokio::runtime::Runtime> {
    static RUNTIME: OnceLock<Option<tokio::runtime::Runtime>> = OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()
        })
        .as_ref()
}

/// A JSON body sent to the route the first byte picks (see the module's documentation); the
/// response's status.
pub fn http_bodies(data: &[u8]) -> Option<u16> {
    let (&pick, body) = data.split_first()?;
    let app = application(pick & 0x80 != 0)?.clone();
    let path = ROUTES[usize::from(pick & 0x7f) % ROUTES.len()];
    let request = Request::builder()
        .method(Method::POST)
        .uri(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_vec()))
        .ok()?;
    // The response's body is not read: an error's is built whole, and no request gets as
    // far as a stream of tokens without a worker.
    let response = runtime()?.block_on(app.oneshot(request)).ok()?;
    Some(response.status().as_u16())
}

#[cfg(test)]
mod tests;
