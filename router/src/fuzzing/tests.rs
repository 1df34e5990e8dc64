//! The `http_bodies` fuzz target on every build (see `tandem_text::fuzzing::replay`): its
//! committed corpus and regressions, then a bounded, seeded mutation loop. `TANDEM_BLESS=1`
//! writes the generated seeds, a valid body of each route and of each feature a route's
//! validation handles apart (tools, structured output, logprobs, choices, streams).

use serde_json::json;
use tandem_text::fuzzing::replay::{blessing, run, write_seed};

use super::*;

#[test]
fn http_bodies_survives_its_corpus() {
    if blessing() {
        for (name, seed) in seeds() {
            write_seed("http_bodies", name, &seed);
        }
    }
    run("http_bodies", |data| {
        let _ = http_bodies(data);
    });
}

/// Every seed passes its route's validation: a generation ends at the missing worker (503),
/// the tokenizer routes answer (200). So mutations of them explore every check on the way.
#[test]
fn each_seed_passes_validation() {
    for (name, seed) in seeds() {
        let route = ROUTES[usize::from(seed[0] & 0x7f) % ROUTES.len()];
        let want = if route.ends_with("tokenize") {
            200
        } else {
            503
        };
        assert_eq!(http_bodies(&seed), Some(want), "{name} ({route})");
    }
}

/// The index of `route` in [`ROUTES`], with the top bit when the model takes tools.
fn pick(route: &str, tools: bool) -> u8 {
    let i = ROUTES.iter().position(|r| *r == route).unwrap() as u8;
    i | if tools { 0x80 } else { 0 }
}

fn seed(route: &str, tools: bool, body: serde_json::Value) -> Vec<u8> {
    let mut out = vec![pick(route, tools)];
    out.extend(body.to_string().into_bytes());
    out
}

/// The generated seeds, named.
fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let weather = json!({
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"]
            }
        }
    });
    let conversation = json!([
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": null, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}
        }]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"}
    ]);
    vec![
        (
            "completion",
            seed(
                "/v1/completions",
                false,
                json!({
                    "model": "fuzz-model", "prompt": "Hello there", "max_tokens": 8,
                    "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 1,
                    "stop": ["\n"], "stop_token_ids": [2], "min_tokens": 1,
                    "presence_penalty": 0.5, "frequency_penalty": -0.5,
                    "repetition_penalty": 1.1, "logit_bias": {"72": -100},
                    "logprobs": 2, "echo": true, "n": 2, "best_of": 3,
                    "prompt_logprobs": 1, "ignore_eos": false, "user": "u"
                }),
            ),
        ),
        (
            "completion_ids_stream",
            seed(
                "/v1/completions",
                false,
                json!({
                    "prompt": [[72, 105, 33]], "max_tokens": 4, "stream": true,
                    "stream_options": {"include_usage": true},
                    "response_format": {"type": "json_object"}
                }),
            ),
        ),
        (
            "chat_tools",
            seed(
                "/v1/chat/completions",
                true,
                json!({
                    "model": "fuzz-model", "messages": conversation, "tools": [weather],
                    "tool_choice": "auto", "parallel_tool_calls": true,
                    "max_completion_tokens": 64, "logprobs": true, "top_logprobs": 2,
                    "chat_template_kwargs": {"enable_thinking": false}
                }),
            ),
        ),
        (
            "chat_required_tool",
            seed(
                "/v1/chat/completions",
                true,
                json!({
                    "messages": [{"role": "user", "content": "Weather?"}],
                    "tools": [weather],
                    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                    "stream": true
                }),
            ),
        ),
        (
            "chat_schema",
            seed(
                "/v1/chat/completions",
                false,
                json!({
                    "messages": [{"role": "user", "content": "A person, as JSON"}],
                    "max_tokens": 32, "n": 2, "temperature": 1.0,
                    "response_format": {"type": "json_schema", "json_schema": {
                        "name": "person", "schema": {
                            "type": "object",
                            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                            "required": ["name"]
                        }
                    }}
                }),
            ),
        ),
        (
            "chat_guided",
            seed(
                "/v1/chat/completions",
                false,
                json!({
                    "messages": [{"role": "user", "content": "Yes or no?"}],
                    "guided_choice": ["yes", "no"], "max_tokens": 4
                }),
            ),
        ),
        (
            "chat_tgi_client",
            seed(
                "/v1/chat/completions",
                false,
                json!({
                    "model": "tgi", "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 10, "stream": true, "seed": 4, "temperature": 0.5
                }),
            ),
        ),
        (
            "generate",
            seed(
                "/generate",
                false,
                json!({"inputs": "Hello", "parameters": {
                    "max_new_tokens": 10, "do_sample": true, "temperature": 0.5, "top_k": 10,
                    "top_p": 0.9, "stop": ["x"], "details": true, "decoder_input_details": true,
                    "best_of": 2, "seed": 3, "truncate": 100, "top_n_tokens": 2,
                    "repetition_penalty": 1.2, "frequency_penalty": 0.1,
                    "grammar": {"type": "regex", "value": "[a-z]+"}
                }}),
            ),
        ),
        (
            "generate_stream",
            seed(
                "/generate_stream",
                false,
                json!({"inputs": "Hi", "parameters": {
                    "max_new_tokens": 5,
                    "grammar": {"type": "json", "value": {"type": "object"}}
                }}),
            ),
        ),
        (
            "tgi_compat",
            seed(
                "/",
                false,
                json!({"inputs": "Hi", "parameters": {"max_new_tokens": 4}, "stream": true}),
            ),
        ),
        (
            "tokenize_chat",
            seed(
                "/tokenize",
                true,
                json!({
                    "messages": [{"role": "user", "content": "Hi"}],
                    "add_generation_prompt": true, "return_token_strs": true
                }),
            ),
        ),
        (
            "tokenize_tgi",
            seed("/tokenize", false, json!({"inputs": "Hello"})),
        ),
        (
            "detokenize",
            seed("/detokenize", false, json!({"tokens": [75, 104, 111]})),
        ),
    ]
}
