//! Tool calls in a model's output: each family's syntax, found from its chat template, and
//! the parser that turns a finished generation into the text around the calls and the calls
//! themselves (a function name and its arguments as JSON text), as OpenAI's
//! `message.tool_calls` carries them.
//!
//! What the model writes is not trusted to be well formed: a call whose JSON does not parse,
//! lacks a name, or is cut off (an unterminated `<tool_call>` at `max_tokens`) stays in the
//! content as the model wrote it; parsing never fails.

use serde_json::Value;

/// How a family writes its tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolSyntax {
    /// Hermes, Qwen2.5 and Qwen3: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`,
    /// once per call, anywhere in the text.
    Hermes,
    /// Llama 3.1 and later: the whole reply is `{"name": …, "parameters": {…}}` (calls
    /// separated by `;`), after `<|python_tag|>` where the template asks for it.
    Llama3Json,
    /// Mistral: `[TOOL_CALLS]` then a JSON array of `{"name": …, "arguments": {…}}`.
    Mistral,
}

/// One call the model made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as JSON text (an object, compact).
    pub arguments: String,
}

/// A generation split into its text and its tool calls.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ParsedOutput {
    /// The text outside the calls (trimmed at the seams the calls leave).
    pub content: String,
    pub calls: Vec<ToolCall>,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";
const MISTRAL_MARK: &str = "[TOOL_CALLS]";

impl ToolSyntax {
    /// The syntax a chat template teaches its model, from the markers it prints; `None` for
    /// a template that knows no tools.
    pub fn for_template(source: &str) -> Option<Self> {
        if source.contains(HERMES_OPEN) {
            Some(Self::Hermes)
        } else if source.contains(MISTRAL_MARK) {
            Some(Self::Mistral)
        } else if source.contains(PYTHON_TAG)
            || (source.contains("tools") && source.contains("\"parameters\""))
        {
            Some(Self::Llama3Json)
        } else {
            None
        }
    }

    /// Splits a finished generation into text and calls.
    pub fn parse(self, text: &str) -> ParsedOutput {
        match self {
            Self::Hermes => parse_hermes(text),
            Self::Llama3Json => parse_llama3(text),
            Self::Mistral => parse_mistral(text),
        }
    }
}

fn parse_hermes(text: &str) -> ParsedOutput {
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find(HERMES_OPEN) {
        let after = &rest[open + HERMES_OPEN.len()..];
        let Some(close) = after.find(HERMES_CLOSE) else {
            break; // cut off: the rest stays text
        };
        match call_from(&after[..close], &["arguments", "parameters"]) {
            Some(call) => {
                content.push_str(&rest[..open]);
                calls.push(call);
            }
            None => {
                content.push_str(&rest[..open + HERMES_OPEN.len() + close + HERMES_CLOSE.len()])
            }
        }
        rest = &after[close + HERMES_CLOSE.len()..];
    }
    content.push_str(rest);
    ParsedOutput {
        content: tidy(&content, !calls.is_empty()),
        calls,
    }
}

fn parse_llama3(text: &str) -> ParsedOutput {
    let trimmed = text.trim();
    let body = trimmed.strip_prefix(PYTHON_TAG).unwrap_or(trimmed).trim();
    if !body.starts_with('{') {
        return ParsedOutput {
            content: text.to_string(),
            calls: Vec::new(),
        };
    }
    // One object, or several separated by `;`: all of them calls, or the reply is text.
    let mut calls = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let call = values
            .next()
            .and_then(Result::ok)
            .and_then(|v| call_from_value(&v, &["parameters", "arguments"]));
        let Some(call) = call else {
            return ParsedOutput {
                content: text.to_string(),
                calls: Vec::new(),
            };
        };
        calls.push(call);
        rest = rest[values.byte_offset()..].trim_start();
        rest = rest.strip_prefix(';').unwrap_or(rest).trim_start();
    }
    ParsedOutput {
        content: String::new(),
        calls,
    }
}

fn parse_mistral(text: &str) -> ParsedOutput {
    // The marker is a special token a detokenizer may drop: then a reply that is a JSON
    // array of calls is one.
    let (before, array) = match text.find(MISTRAL_MARK) {
        Some(at) => (&text[..at], &text[at + MISTRAL_MARK.len()..]),
        None if text.trim_start().starts_with("[{") => ("", text),
        None => {
            return ParsedOutput {
                content: text.to_string(),
                calls: Vec::new(),
            };
        }
    };
    let calls: Option<Vec<ToolCall>> = serde_json::from_str::<Value>(array.trim())
        .ok()
        .and_then(|v| match v {
            Value::Array(items) => items
                .iter()
                .map(|i| call_from_value(i, &["arguments", "parameters"]))
                .collect(),
            one @ Value::Object(_) => {
                call_from_value(&one, &["arguments", "parameters"]).map(|c| vec![c])
            }
            _ => None,
        })
        .filter(|c| !c.is_empty());
    match calls {
        Some(calls) => ParsedOutput {
            content: tidy(before, true),
            calls,
        },
        None => ParsedOutput {
            content: text.to_string(),
            calls: Vec::new(),
        },
    }
}

/// A call from the JSON text between markers.
fn call_from(json: &str, argument_keys: &[&str]) -> Option<ToolCall> {
    let value: Value = serde_json::from_str(json.trim()).ok()?;
    call_from_value(&value, argument_keys)
}

/// A call from `{"name": …, <argument key>: {…}}`; arguments given as a JSON string are taken
/// when the string holds an object; absent ones are `{}`.
fn call_from_value(value: &Value, argument_keys: &[&str]) -> Option<ToolCall> {
    let object = value.as_object()?;
    let name = object.get("name")?.as_str()?.trim();
    if name.is_empty() {
        return None;
    }
    let arguments = match argument_keys.iter().find_map(|k| object.get(*k)) {
        None | Some(Value::Null) => "{}".to_string(),
        Some(args @ Value::Object(_)) => args.to_string(),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(args @ Value::Object(_)) => args.to_string(),
            _ => return None,
        },
        Some(_) => return None,
    };
    Some(ToolCall {
        name: name.to_string(),
        arguments,
    })
}

/// The text around calls, without the blank space the calls leave at its ends.
fn tidy(content: &str, had_calls: bool) -> String {
    if had_calls {
        content.trim().to_string()
    } else {
        content.to_string()
    }
}

#[cfg(test)]
mod tests;
