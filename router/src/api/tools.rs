//! Tool calling on `/v1/chat/completions`: the request's `tools`, `tool_choice` and
//! `parallel_tool_calls` validated into what the chat template renders, how the reply is
//! parsed ([`ToolMode`]) and, for `tool_choice` `required` or a named function, the grammar
//! that holds the reply to valid calls (as vLLM does: a JSON array of `{"name",
//! "parameters"}`, or the named function's arguments object, each against the function's
//! JSON schema); the conversation's tool calls and results as the templates read them; and
//! the ids of the calls a response returns.
//!
//! Accepted `tool_choice` forms: `"none"` (tools are rendered, replies are text), `"auto"`
//! (the default with tools: calls parsed in the template's syntax, Hermes' `<tool_call>` for
//! a template that teaches none), `"required"`, OpenAI's `{"type": "function", "function":
//! {"name"}}`, and TGI's `{"function": {"name"}}` or a bare function name.

use serde_json::{Map, Value, json};
use tandem_text::{ChatMessage, GuideSpec, ToolMode, ToolSyntax};

use super::structured::Structured;
use crate::error::ApiError;

/// Tools one request may offer.
pub const MAX_TOOLS: usize = 128;
/// Bytes of a function name at most.
pub const MAX_TOOL_NAME_BYTES: usize = 256;

/// What a chat request's tool fields validate into.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatTools {
    /// The tools as the template's `tools` (OpenAI's items, `parameters` filled in).
    pub rendered: Option<Vec<Value>>,
    pub mode: ToolMode,
    /// The grammar of `required` and named choices.
    pub guide: Option<Structured>,
}

/// One offered function.
struct Function {
    name: String,
    parameters: Value,
}

/// Validates the tool fields; `syntax` is the template's.
pub fn parse(
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    syntax: Option<ToolSyntax>,
) -> Result<ChatTools, ApiError> {
    let tools = tools.unwrap_or_default();
    if tools.len() > MAX_TOOLS {
        return Err(ApiError::invalid(
            "tools",
            format!(
                "at most {MAX_TOOLS} tools may be offered, not {}",
                tools.len()
            ),
        ));
    }
    let mut functions: Vec<Function> = Vec::with_capacity(tools.len());
    let mut rendered = Vec::with_capacity(tools.len());
    for (i, tool) in tools.into_iter().enumerate() {
        let (function, item) = function(tool, i)?;
        if functions.iter().any(|f| f.name == function.name) {
            return Err(ApiError::invalid(
                format!("tools[{i}].function.name"),
                format!("the function name `{}` is offered twice", function.name),
            ));
        }
        functions.push(function);
        rendered.push(item);
    }
    let parallel = parallel_tool_calls.unwrap_or(true);
    let choice = tool_choice.filter(|c| !c.is_null());
    let named = |name: &str| -> Result<&Function, ApiError> {
        functions.iter().find(|f| f.name == name).ok_or_else(|| {
            ApiError::invalid(
                "tool_choice",
                format!("`tool_choice` names `{name}`, which is not among `tools`"),
            )
        })
    };
    let needs_tools = || {
        ApiError::invalid(
            "tool_choice",
            "`tool_choice` asks for a tool call, but the request offers no `tools`",
        )
    };
    let mode = match choice.as_ref() {
        None if functions.is_empty() => ToolMode::Off,
        None => auto(syntax, parallel),
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolMode::Off,
            "auto" if functions.is_empty() => ToolMode::Off,
            "auto" => auto(syntax, parallel),
            "required" if functions.is_empty() => return Err(needs_tools()),
            "required" => ToolMode::Required,
            _ if functions.is_empty() => return Err(needs_tools()),
            // TGI: a bare function name.
            name => ToolMode::Named(named(name)?.name.clone()),
        },
        Some(Value::Object(o)) => {
            if o.get("type").is_some_and(|t| t != "function") {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "`tool_choice.type` must be \"function\"",
                ));
            }
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tool_choice",
                        "`tool_choice` must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            if functions.is_empty() {
                return Err(needs_tools());
            }
            ToolMode::Named(named(name)?.name.clone())
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "tool_choice",
                "`tool_choice` must be a string or an object",
            ));
        }
    };
    let guide = match &mode {
        ToolMode::Named(name) => Some(named(name)?.parameters.to_string()),
        ToolMode::Required => Some(required_schema(&functions, parallel).to_string()),
        _ => None,
    }
    .map(|schema| Structured {
        spec: GuideSpec::JsonSchema(schema),
        param: "tools",
    });
    Ok(ChatTools {
        rendered: (!rendered.is_empty()).then_some(rendered),
        mode,
        guide,
    })
}

fn auto(syntax: Option<ToolSyntax>, parallel: bool) -> ToolMode {
    ToolMode::Auto {
        syntax: syntax.unwrap_or(ToolSyntax::Hermes),
        parallel,
    }
}

/// One `tools` item checked: the function, and the item as the template sees it.
fn function(tool: Value, i: usize) -> Result<(Function, Value), ApiError> {
    let bad = |field: &str, why: &str| ApiError::invalid(format!("tools[{i}]{field}"), why);
    let Value::Object(mut tool) = tool else {
        return Err(bad(
            "",
            "each tool must be {\"type\": \"function\", \"function\": {...}}",
        ));
    };
    if tool.get("type").is_some_and(|t| t != "function") {
        return Err(bad(".type", "only \"function\" tools are supported"));
    }
    let Some(Value::Object(mut f)) = tool.remove("function") else {
        return Err(bad(".function", "a tool needs a `function` object"));
    };
    let name = match f.get("name") {
        Some(Value::String(n))
            if !n.is_empty()
                && n.len() <= MAX_TOOL_NAME_BYTES
                && !n.chars().any(char::is_control) =>
        {
            n.clone()
        }
        _ => {
            return Err(bad(
                ".function.name",
                "a function needs a name: a non-empty string of at most 256 bytes, no control characters",
            ));
        }
    };
    if f.get("description")
        .is_some_and(|d| !d.is_string() && !d.is_null())
    {
        return Err(bad(
            ".function.description",
            "a description must be a string",
        ));
    }
    let parameters = match f.remove("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p,
        Some(_) => {
            return Err(bad(
                ".function.parameters",
                "`parameters` must be a JSON schema object",
            ));
        }
    };
    f.insert("parameters".into(), parameters.clone());
    let mut item = Map::new();
    item.insert("type".into(), "function".into());
    item.insert("function".into(), Value::Object(f));
    Ok((Function { name, parameters }, Value::Object(item)))
}

/// `required`'s grammar: one call or more (one when calls may not run in parallel), each a
/// function of `tools` by name with arguments valid against its schema.
fn required_schema(functions: &[Function], parallel: bool) -> Value {
    let calls: Vec<Value> = functions
        .iter()
        .map(|f| {
            json!({
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [f.name]},
                    "parameters": f.parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": false,
            })
        })
        .collect();
    let mut schema = json!({"type": "array", "minItems": 1, "items": {"anyOf": calls}});
    if !parallel {
        schema["maxItems"] = json!(1);
    }
    schema
}

/// A message's `tool_calls` as the templates read them: OpenAI's items with each call's
/// `arguments` JSON text parsed into its object (Qwen's and Llama's templates print it
/// with `tojson`, as transformers hands it over).
pub fn message_tool_calls(
    calls: Option<Value>,
    role: &str,
    i: usize,
) -> Result<Option<Vec<Value>>, ApiError> {
    let param = format!("messages[{i}].tool_calls");
    let calls = match calls {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(calls)) if role == "assistant" => calls,
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid(
                param,
                "only assistant messages carry `tool_calls`",
            ));
        }
        Some(_) => return Err(ApiError::invalid(param, "`tool_calls` must be a list")),
    };
    let mut out = Vec::with_capacity(calls.len());
    for (j, call) in calls.into_iter().enumerate() {
        let at = format!("{param}[{j}]");
        let function = call.get("function").and_then(Value::as_object);
        let name = function
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
            .ok_or_else(|| {
                ApiError::invalid(
                    format!("{at}.function.name"),
                    "a tool call needs a function name",
                )
            })?;
        let arguments = match function.and_then(|f| f.get("arguments")) {
            None | Some(Value::Null) => json!({}),
            Some(Value::String(text)) => serde_json::from_str::<Value>(text).map_err(|e| {
                ApiError::invalid(
                    format!("{at}.function.arguments"),
                    format!("the arguments are not JSON: {e}"),
                )
            })?,
            Some(object) => object.clone(),
        };
        let mut item = Map::new();
        if let Some(id) = call.get("id").filter(|id| id.is_string()) {
            item.insert("id".into(), id.clone());
        }
        item.insert("type".into(), "function".into());
        item.insert(
            "function".into(),
            json!({"name": name, "arguments": arguments}),
        );
        out.push(Value::Object(item));
    }
    Ok(Some(out))
}

/// A tool result's `tool_call_id` (a string on `tool` messages).
pub fn message_tool_call_id(id: Option<Value>, i: usize) -> Result<Option<String>, ApiError> {
    match id {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(ApiError::invalid(
            format!("messages[{i}].tool_call_id"),
            "`tool_call_id` must be a string",
        )),
    }
}

/// The message as the template reads it.
pub fn chat_message(
    role: String,
    content: String,
    tool_calls: Option<Vec<Value>>,
    tool_call_id: Option<String>,
) -> ChatMessage {
    let mut message = ChatMessage::new(role, content);
    message.tool_calls = tool_calls;
    message.tool_call_id = tool_call_id;
    message
}

/// A new call id, unguessable (OpenAI's shape: `call_` and 24 characters).
pub fn call_id() -> String {
    format!("call_{:024x}", rand::random::<u128>() >> 32)
}

#[cfg(test)]
#[path = "tools_tests.rs"]
mod tests;
