//! Each family's calls: complete, several, in the middle of text, cut off, malformed.

use super::*;

fn call(name: &str, arguments: &str) -> ToolCall {
    ToolCall {
        name: name.into(),
        arguments: arguments.into(),
    }
}

fn text_only(text: &str) -> ParsedOutput {
    ParsedOutput {
        content: text.into(),
        calls: Vec::new(),
    }
}

#[test]
fn hermes_calls_anywhere_in_the_text() {
    let h = ToolSyntax::Hermes;
    assert_eq!(
        h.parse("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"),
        ParsedOutput {
            content: String::new(),
            calls: vec![call("get_weather", r#"{"city":"Paris"}"#)],
        }
    );
    // Two calls after some thinking-out-loud; the text around them stays.
    let out = h.parse(
        "Let me check both.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {\"x\": [1, 2]}}\n</tool_call>",
    );
    assert_eq!(out.content, "Let me check both.");
    assert_eq!(out.calls, [call("a", "{}"), call("b", r#"{"x":[1,2]}"#)]);
    // Arguments given as a JSON string holding an object.
    assert_eq!(
        h.parse(r#"<tool_call>{"name": "f", "arguments": "{\"n\": 1}"}</tool_call>"#)
            .calls,
        [call("f", r#"{"n":1}"#)]
    );
}

#[test]
fn hermes_keeps_what_is_not_a_call_as_text() {
    let h = ToolSyntax::Hermes;
    // Cut off at max_tokens.
    let cut = "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"argu";
    assert_eq!(h.parse(cut), text_only(cut));
    // Malformed JSON, no name, arguments that are not an object: text, and a good call
    // beside them still counts.
    for bad in [
        "<tool_call>{name: f}</tool_call>",
        "<tool_call>{\"arguments\": {}}</tool_call>",
        "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>",
    ] {
        assert_eq!(h.parse(bad), text_only(bad), "{bad}");
        let mixed = format!("{bad}<tool_call>{{\"name\": \"g\", \"arguments\": {{}}}}</tool_call>");
        let out = h.parse(&mixed);
        assert_eq!(
            (out.content.as_str(), out.calls),
            (bad, vec![call("g", "{}")])
        );
    }
    assert_eq!(h.parse("No tools needed."), text_only("No tools needed."));
}

#[test]
fn llama3_json_replies() {
    let l = ToolSyntax::Llama3Json;
    assert_eq!(
        l.parse(r#"{"name": "get_weather", "parameters": {"city": "Paris"}}"#)
            .calls,
        [call("get_weather", r#"{"city":"Paris"}"#)]
    );
    assert_eq!(
        l.parse("<|python_tag|>{\"name\": \"f\", \"parameters\": {\"code\": \"x = {};\"}}; {\"name\": \"g\", \"parameters\": {}}"),
        ParsedOutput {
            content: String::new(),
            calls: vec![call("f", r#"{"code":"x = {};"}"#), call("g", "{}")],
        }
    );
    for text in [
        "The weather is fine.",
        r#"{"name": "f", "parameters": {"a": 1}} and then some"#,
        r#"{"name": "f", "parameters": {"a": 1"#,
        r#"{"city": "Paris"}"#,
    ] {
        assert_eq!(l.parse(text), text_only(text), "{text}");
    }
}

#[test]
fn mistral_tool_call_arrays() {
    let m = ToolSyntax::Mistral;
    assert_eq!(
        m.parse(r#"[TOOL_CALLS] [{"name": "a", "arguments": {"q": "x"}}, {"name": "b", "arguments": {}}]"#),
        ParsedOutput {
            content: String::new(),
            calls: vec![call("a", r#"{"q":"x"}"#), call("b", "{}")],
        }
    );
    // The marker dropped by the detokenizer (a special token).
    assert_eq!(
        m.parse(r#"[{"name": "a", "arguments": {}}]"#).calls,
        [call("a", "{}")]
    );
    let cut = r#"[TOOL_CALLS] [{"name": "a", "argum"#;
    assert_eq!(m.parse(cut), text_only(cut));
    assert_eq!(m.parse("[1, 2, 3]"), text_only("[1, 2, 3]"));
}

#[test]
fn the_syntax_comes_from_the_template() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/templates");
    let read = |name: &str| std::fs::read_to_string(format!("{dir}/{name}.jinja")).unwrap();
    assert_eq!(
        ToolSyntax::for_template(&read("qwen2.5")),
        Some(ToolSyntax::Hermes)
    );
    assert_eq!(
        ToolSyntax::for_template(&read("qwen3")),
        Some(ToolSyntax::Hermes)
    );
    // Llama 3.0's template knows no tools; 3.1's asks for JSON with "parameters".
    assert_eq!(ToolSyntax::for_template(&read("llama3")), None);
    let llama31 = r#"{%- if tools is not none %}{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}{%- endif %}{{- '<|python_tag|>' }}"#;
    assert_eq!(
        ToolSyntax::for_template(llama31),
        Some(ToolSyntax::Llama3Json)
    );
    assert_eq!(ToolSyntax::for_template(&read("gemma2")), None);
    assert_eq!(
        ToolSyntax::for_template("[TOOL_CALLS]{{ x }}"),
        Some(ToolSyntax::Mistral)
    );
}
