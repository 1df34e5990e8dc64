//! A chat reply's parts in OpenAI's shapes: the whole `message` (`content`,
//! `reasoning_content` as vLLM and SGLang name it, `tool_calls` with fresh ids) and each
//! streamed `delta`, whose `tool_calls` items carry the `index` the OpenAI client assembles
//! them by. One [`ChoiceReply`] per choice keeps the parser and the calls' numbering.
//! `tgi_deltas` reshapes a delta for TGI's own client.

use serde::Serialize;
use serde_json::{Value, json};
use tandem_text::{ParsedReply, ReplyOptions, ReplyParser, ReplyPart, ToolMode};

use super::tools::call_id;

/// A streamed chunk's delta.
#[derive(Serialize, Default, Debug, PartialEq)]
pub(super) struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) tool_calls: Option<Vec<Value>>,
}

impl Delta {
    /// Says nothing beyond the role.
    pub(super) fn is_empty(&self) -> bool {
        self.content.is_none() && self.reasoning_content.is_none() && self.tool_calls.is_none()
    }
}

/// One choice's reply being streamed.
pub(super) struct ChoiceReply {
    parser: ReplyParser,
    /// Calls streamed so far (the next one's `index`).
    calls: u32,
}

impl ChoiceReply {
    pub(super) fn new(options: &ReplyOptions) -> Self {
        Self {
            parser: ReplyParser::new(options),
            calls: 0,
        }
    }

    /// The delta of one token's text (`None`: a choice's end with no token) and, at the
    /// choice's end, of everything still held.
    pub(super) fn delta(&mut self, text: Option<&str>, end: bool, delta: &mut Delta) {
        let mut parts = text.map(|t| self.parser.push_token(t)).unwrap_or_default();
        if end {
            parts.extend(self.parser.finish());
        }
        for part in parts {
            match part {
                ReplyPart::Content(t) => delta.content.get_or_insert_default().push_str(&t),
                ReplyPart::Reasoning(t) => {
                    delta.reasoning_content.get_or_insert_default().push_str(&t)
                }
                ReplyPart::Call(call) => {
                    let item = json!({
                        "index": self.calls,
                        "id": call_id(),
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    });
                    self.calls += 1;
                    delta.tool_calls.get_or_insert_default().push(item);
                }
                ReplyPart::CallOpened(name) => {
                    let item = json!({
                        "index": self.calls,
                        "id": call_id(),
                        "type": "function",
                        "function": {"name": name, "arguments": ""},
                    });
                    self.calls += 1;
                    delta.tool_calls.get_or_insert_default().push(item);
                }
                ReplyPart::Arguments(t) => {
                    let index = self.calls.saturating_sub(1);
                    let items = delta.tool_calls.get_or_insert_default();
                    // One item per call in a delta: arguments join the call's item when this
                    // delta already has it.
                    match items.last_mut().filter(|i| i["index"] == index) {
                        Some(item) => {
                            let before = item["function"]["arguments"].as_str().unwrap_or("");
                            item["function"]["arguments"] = Value::from(format!("{before}{t}"));
                        }
                        None => items.push(json!({
                            "index": index,
                            "function": {"arguments": t},
                        })),
                    }
                }
            }
        }
    }

    pub(super) fn made_calls(&self) -> bool {
        self.parser.made_calls()
    }

    pub(super) fn reasoning_tokens(&self) -> u32 {
        self.parser.reasoning_tokens()
    }
}

/// `delta` in the shape TGI's own Python client (`text_generation`) parses: every delta
/// names its role and has `content` and `tool_calls` keys, and `tool_calls` is one object
/// (with an `id`, a `type` and a function `name`, empty or null on a call's later pieces),
/// so a delta with several calls becomes several deltas, the content with the first.
pub(super) fn tgi_deltas(delta: Delta) -> Vec<Value> {
    let shape = |content: Option<String>, call: Value| {
        let mut d = json!({"role": "assistant", "content": content, "tool_calls": call});
        if let Some(r) = &delta.reasoning_content {
            d["reasoning_content"] = Value::from(r.as_str());
        }
        d
    };
    let calls = delta.tool_calls.clone().unwrap_or_default();
    if calls.is_empty() {
        return vec![shape(delta.content.clone(), Value::Null)];
    }
    let mut content = delta.content.clone();
    calls
        .into_iter()
        .map(|mut call| {
            if call.get("id").is_none() {
                call["id"] = Value::from("");
            }
            if call.get("type").is_none() {
                call["type"] = Value::from("function");
            }
            if call["function"].get("name").is_none() {
                call["function"]["name"] = Value::Null;
            }
            shape(content.take(), call)
        })
        .collect()
}

/// The finish reason of a choice that ended for `stop`: `tool_calls` when the model chose to
/// call (OpenAI's; a call that `tool_choice` forced ends with `stop`, as OpenAI's does).
pub(super) fn stop_reason(options: &ReplyOptions, made_calls: bool) -> &'static str {
    if made_calls && matches!(options.tools, ToolMode::Auto { .. }) {
        "tool_calls"
    } else {
        "stop"
    }
}

/// The whole `message` of a reply: `content` null when the reply is only calls.
pub(super) fn message(options: &ReplyOptions, reply: &ParsedReply) -> Value {
    let mut message = json!({"role": "assistant"});
    message["content"] = if reply.content.is_empty() && !reply.calls.is_empty() {
        Value::Null
    } else {
        Value::from(reply.content.as_str())
    };
    if options.reasoning || options.starts_thinking {
        message["reasoning_content"] = reply.reasoning.clone().map_or(Value::Null, Value::from);
    }
    if !reply.calls.is_empty() {
        let calls: Vec<Value> = reply
            .calls
            .iter()
            .map(|call| {
                json!({
                    "id": call_id(),
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                })
            })
            .collect();
        message["tool_calls"] = Value::Array(calls);
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_text::ToolSyntax;

    fn options(tools: ToolMode) -> ReplyOptions {
        ReplyOptions {
            reasoning: true,
            starts_thinking: false,
            tools,
        }
    }

    #[test]
    fn streamed_calls_are_numbered_and_named_arguments_follow_their_call() {
        let auto = options(ToolMode::Auto {
            syntax: ToolSyntax::Hermes,
            parallel: true,
        });
        let mut reply = ChoiceReply::new(&auto);
        let mut delta = Delta::default();
        reply.delta(Some("<think>hm</think>"), false, &mut delta);
        assert_eq!(delta.reasoning_content.as_deref(), Some("hm"));
        let mut delta = Delta::default();
        let two =
            "<tool_call>{\"name\": \"a\"}</tool_call><tool_call>{\"name\": \"b\"}</tool_call>";
        reply.delta(Some(two), true, &mut delta);
        let calls = delta.tool_calls.unwrap();
        assert_eq!(
            (calls[0]["index"].clone(), calls[1]["index"].clone()),
            (json!(0), json!(1))
        );
        assert_eq!(
            calls[1]["function"],
            json!({"name": "b", "arguments": "{}"})
        );
        assert_ne!(calls[0]["id"], calls[1]["id"]);
        assert_eq!(stop_reason(&auto, reply.made_calls()), "tool_calls");
        assert_eq!(reply.reasoning_tokens(), 1);

        let named = options(ToolMode::Named("f".into()));
        let mut reply = ChoiceReply::new(&named);
        let mut first = Delta::default();
        reply.delta(Some("{\"a\""), false, &mut first);
        let mut second = Delta::default();
        reply.delta(Some(": 1}"), true, &mut second);
        let first = first.tool_calls.unwrap();
        assert_eq!(first.len(), 1, "{first:?}");
        assert_eq!(first[0]["function"]["name"], "f");
        assert_eq!(first[0]["function"]["arguments"], "{\"a\"");
        assert_eq!(
            second.tool_calls.unwrap(),
            [json!({"index": 0, "function": {"arguments": ": 1}"}})]
        );
        assert_eq!(stop_reason(&named, reply.made_calls()), "stop");
    }

    #[test]
    fn tgi_deltas_carry_their_role_and_one_call_each() {
        let plain = Delta {
            content: Some("Hi".into()),
            ..Delta::default()
        };
        assert_eq!(
            tgi_deltas(plain),
            [json!({"role": "assistant", "content": "Hi", "tool_calls": null})]
        );
        let calls = Delta {
            content: Some("x".into()),
            tool_calls: Some(vec![
                json!({"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}}),
                json!({"index": 1, "function": {"arguments": "{"}}),
            ]),
            ..Delta::default()
        };
        let out = tgi_deltas(calls);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0]["content"], "x");
        assert_eq!(out[0]["tool_calls"]["id"], "call_a");
        assert_eq!(out[1]["content"], Value::Null);
        assert_eq!(
            out[1]["tool_calls"],
            json!({"index": 1, "id": "", "type": "function", "function": {"arguments": "{", "name": null}})
        );
    }

    #[test]
    fn whole_messages() {
        let auto = options(ToolMode::Auto {
            syntax: ToolSyntax::Hermes,
            parallel: true,
        });
        let reply = ParsedReply::parse(&auto, ["<tool_call>{\"name\": \"a\"}</tool_call>"]);
        let m = message(&auto, &reply);
        assert_eq!(m["content"], Value::Null);
        assert_eq!(m["reasoning_content"], Value::Null);
        assert_eq!(m["tool_calls"][0]["function"]["name"], "a");
        assert!(
            m["tool_calls"][0]["id"]
                .as_str()
                .unwrap()
                .starts_with("call_")
        );
        let plain = ParsedReply::parse(&auto, ["Hello"]);
        let m = message(&auto, &plain);
        assert_eq!(
            (m["content"].clone(), m.get("tool_calls")),
            (json!("Hello"), None)
        );
    }
}
