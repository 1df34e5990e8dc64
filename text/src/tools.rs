//! Tool calls in a model's output: each family's syntax, found from its chat template, and
//! the readers of a call's JSON (a function name and its arguments as JSON text, as OpenAI's
//! `message.tool_calls` carries them). `reply` finds the calls in a streaming reply.
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

/// The markers of each syntax (the reply parser looks for them too).
pub(crate) const HERMES_OPEN: &str = "<tool_call>";
pub(crate) const HERMES_CLOSE: &str = "</tool_call>";
pub(crate) const PYTHON_TAG: &str = "<|python_tag|>";
pub(crate) const MISTRAL_MARK: &str = "[TOOL_CALLS]";

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
}

/// A Llama 3 or Mistral reply read whole: its calls, or `None` when it is not all calls.
pub(crate) fn parse_whole(syntax: ToolSyntax, text: &str) -> Option<Vec<ToolCall>> {
    match syntax {
        ToolSyntax::Hermes => None,
        ToolSyntax::Llama3Json => parse_llama3(text),
        ToolSyntax::Mistral => parse_mistral(text),
    }
}

/// `tool_choice: "required"`'s reply: a non-empty JSON array of `{"name", "parameters"}`.
pub(crate) fn parse_required(text: &str) -> Option<Vec<ToolCall>> {
    match serde_json::from_str::<Value>(text.trim()).ok()? {
        Value::Array(items) if !items.is_empty() => items
            .iter()
            .map(|i| call_from_value(i, &["parameters", "arguments"]))
            .collect(),
        _ => None,
    }
}

fn parse_llama3(text: &str) -> Option<Vec<ToolCall>> {
    let trimmed = text.trim();
    let body = trimmed.strip_prefix(PYTHON_TAG).unwrap_or(trimmed).trim();
    if !body.starts_with('{') {
        return None;
    }
    // One object, or several separated by `;`: all of them calls, or the reply is text.
    let mut calls = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let value = values.next()?.ok()?;
        calls.push(call_from_value(&value, &["parameters", "arguments"])?);
        rest = rest[values.byte_offset()..].trim_start();
        rest = rest.strip_prefix(';').unwrap_or(rest).trim_start();
    }
    Some(calls)
}

fn parse_mistral(text: &str) -> Option<Vec<ToolCall>> {
    // The marker is a special token a detokenizer may drop: then a reply that is a JSON
    // array of calls is one.
    let trimmed = text.trim();
    let array = trimmed.strip_prefix(MISTRAL_MARK).unwrap_or(trimmed);
    let calls: Vec<ToolCall> = match serde_json::from_str::<Value>(array.trim()).ok()? {
        Value::Array(items) => items
            .iter()
            .map(|i| call_from_value(i, &["arguments", "parameters"]))
            .collect::<Option<_>>()?,
        one @ Value::Object(_) => vec![call_from_value(&one, &["arguments", "parameters"])?],
        _ => return None,
    };
    (!calls.is_empty()).then_some(calls)
}

/// A call from the JSON text between markers.
pub(crate) fn call_from_json(json: &str, argument_keys: &[&str]) -> Option<ToolCall> {
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

#[cfg(test)]
mod tests;
