//! Replies split whole and streamed in every cut: reasoning, calls per mode, and text that
//! only looks like a marker.

use super::parts::partial_marker;
use super::*;

fn call(name: &str, arguments: &str) -> ToolCall {
    ToolCall {
        name: name.into(),
        arguments: arguments.into(),
    }
}

fn options(reasoning: bool, starts_thinking: bool, tools: ToolMode) -> ReplyOptions {
    ReplyOptions {
        reasoning,
        starts_thinking,
        tools,
    }
}

fn auto(syntax: ToolSyntax) -> ToolMode {
    ToolMode::Auto {
        syntax,
        parallel: true,
    }
}

/// The reply whole, one character a token, and in two pieces at every cut: all alike.
fn split(options: &ReplyOptions, text: &str) -> ParsedReply {
    let whole = ParsedReply::parse(options, [text]);
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let mut by_char = ParsedReply::parse(options, chars.iter().map(String::as_str));
    by_char.reasoning_tokens = whole.reasoning_tokens;
    assert_eq!(by_char, whole, "one character a token: {text:?}");
    for (at, _) in text.char_indices().skip(1) {
        let mut two = ParsedReply::parse(options, [&text[..at], &text[at..]]);
        two.reasoning_tokens = whole.reasoning_tokens;
        assert_eq!(two, whole, "cut at {at}: {text:?}");
    }
    whole
}

#[test]
fn plain_replies_pass_through_untouched() {
    let off = options(false, false, ToolMode::Off);
    assert!(ReplyParser::new(&off).is_passthrough());
    for text in [
        "  Hello,\n world  ",
        "<tool_call>{\"name\": \"f\"}</tool_call>",
        "",
    ] {
        let reply = split(&off, text);
        assert_eq!((reply.content.as_str(), reply.calls.len()), (text, 0));
        assert_eq!(reply.reasoning, None);
    }
}

#[test]
fn thinking_is_reasoning_and_the_rest_the_answer() {
    let think = options(true, false, ToolMode::Off);
    let reply = split(
        &think,
        "<think>\nLet me add: 2 + 2 = 4.\n</think>\n\nThe answer is 4.",
    );
    assert_eq!(reply.reasoning.as_deref(), Some("Let me add: 2 + 2 = 4."));
    assert_eq!(reply.content, "The answer is 4.");
    // A reply that does not open the block is all answer, as written.
    let reply = split(&think, " The answer <think> is 4. ");
    assert_eq!(reply.reasoning, None);
    assert_eq!(reply.content, " The answer <think> is 4. ");
    // Cut off while thinking: all reasoning.
    let reply = split(&think, "<think>\nStill thinking about");
    assert_eq!(reply.reasoning.as_deref(), Some("Still thinking about"));
    assert_eq!(reply.content, "");
    // The template opened the block (DeepSeek-R1): the reply starts inside it.
    let opened = options(true, true, ToolMode::Off);
    let reply = split(&opened, "Hmm, 4.\n</think>\n\n4");
    assert_eq!(
        (reply.reasoning.as_deref(), reply.content.as_str()),
        (Some("Hmm, 4."), "4")
    );
    // `enable_thinking: false` leaves an empty block in the prompt: the reply is all answer.
    assert_eq!(split(&think, "4").content, "4");
}

#[test]
fn reasoning_tokens_count_the_block_and_its_tags() {
    let think = options(true, false, ToolMode::Off);
    let tokens = ["<think>", "\n", "hmm", "\n", "</think>", "\n\n", "Yes", "."];
    let reply = ParsedReply::parse(&think, tokens);
    assert_eq!(reply.reasoning_tokens, 5);
    assert_eq!(reply.content, "Yes.");
    assert_eq!(ParsedReply::parse(&think, ["Yes", "."]).reasoning_tokens, 0);
    // The tag split over tokens: every piece of it counts.
    let pieces = ["<", "think", ">", "hm", "</think>", "Yes"];
    assert_eq!(ParsedReply::parse(&think, pieces).reasoning_tokens, 5);
    // A start that looked like the tag but was not: none.
    assert_eq!(
        ParsedReply::parse(&think, ["<", "thin", "g>"]).reasoning_tokens,
        0
    );
}

#[test]
fn hermes_calls_settle_as_each_closes() {
    let hermes = options(false, false, auto(ToolSyntax::Hermes));
    let text = "Let me check both.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {\"x\": [1, 2]}}\n</tool_call>";
    let reply = split(&hermes, text);
    assert_eq!(reply.content, "Let me check both.");
    assert_eq!(reply.calls, [call("a", "{}"), call("b", r#"{"x":[1,2]}"#)]);
    // Streamed, the first call is out before the second starts.
    let mut parser = ReplyParser::new(&hermes);
    let first_end = text.find("</tool_call>").unwrap() + "</tool_call>".len();
    let parts = parser.push_token(&text[..first_end]);
    assert_eq!(
        parts,
        [
            ReplyPart::Content("Let me check both.".into()),
            ReplyPart::Call(call("a", "{}"))
        ]
    );
    assert!(parser.made_calls());
    // Text that only starts like the marker is released once it cannot be one.
    let mut parser = ReplyParser::new(&hermes);
    assert_eq!(
        parser.push_token("x <tool"),
        [ReplyPart::Content("x".into())]
    );
    assert_eq!(
        parser.push_token("box> y"),
        [ReplyPart::Content(" <toolbox> y".into())]
    );
    assert_eq!(parser.finish(), []);
}

#[test]
fn thinking_then_a_call() {
    let qwen3 = options(true, false, auto(ToolSyntax::Hermes));
    let reply = split(
        &qwen3,
        "<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
    );
    assert_eq!(
        reply.reasoning.as_deref(),
        Some("The user wants the weather.")
    );
    assert_eq!(reply.content, "");
    assert_eq!(reply.calls, [call("get_weather", r#"{"city":"Paris"}"#)]);
}

#[test]
fn one_call_when_parallel_calls_are_off() {
    let single = options(
        false,
        false,
        ToolMode::Auto {
            syntax: ToolSyntax::Hermes,
            parallel: false,
        },
    );
    let reply = split(
        &single,
        "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"b\", \"arguments\": {}}</tool_call>",
    );
    assert_eq!(reply.calls, [call("a", "{}")]);
}

#[test]
fn llama3_and_mistral_replies_are_all_calls_or_all_text() {
    let llama = options(false, false, auto(ToolSyntax::Llama3Json));
    let reply = split(
        &llama,
        r#" {"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}"#,
    );
    assert_eq!(reply.calls, [call("f", r#"{"a":1}"#), call("g", "{}")]);
    assert_eq!(reply.content, "");
    for text in [
        "The weather is fine.",
        r#"{"name": "f", "parameters": {"a": 1}} and then some"#,
        r#"{"city": "Paris"}"#,
    ] {
        let reply = split(&llama, text);
        assert_eq!((reply.content.as_str(), reply.calls.len()), (text, 0));
    }
    let mistral = options(false, false, auto(ToolSyntax::Mistral));
    let reply = split(
        &mistral,
        r#"Calling it. [TOOL_CALLS] [{"name": "a", "arguments": {"q": "x"}}]"#,
    );
    assert_eq!(
        (reply.content.as_str(), reply.calls),
        ("Calling it.", vec![call("a", r#"{"q":"x"}"#)])
    );
    for text in [
        "[1, 2, 3]",
        r#"[TOOL_CALLS] [{"name": "a", "argum"#,
        "[x] marks",
    ] {
        let reply = split(&mistral, text);
        assert_eq!((reply.content.as_str(), reply.calls.len()), (text, 0));
    }
}

#[test]
fn required_and_named_replies() {
    let required = options(false, false, ToolMode::Required);
    let reply = split(
        &required,
        r#"[{"name": "a", "parameters": {"n": 1}}, {"name": "b", "parameters": {}}]"#,
    );
    assert_eq!(reply.calls, [call("a", r#"{"n":1}"#), call("b", "{}")]);
    // Cut off at max_tokens: the text, not a call.
    let cut = r#"[{"name": "a", "param"#;
    let reply = split(&required, cut);
    assert_eq!((reply.content.as_str(), reply.calls.len()), (cut, 0));

    let named = options(false, false, ToolMode::Named("get_weather".into()));
    let mut parser = ReplyParser::new(&named);
    assert_eq!(
        parser.push_token("{\"city\""),
        [
            ReplyPart::CallOpened("get_weather".into()),
            ReplyPart::Arguments("{\"city\"".into())
        ]
    );
    assert_eq!(
        parser.push_token(": \"Paris\"}"),
        [ReplyPart::Arguments(": \"Paris\"}".into())]
    );
    assert_eq!(parser.finish(), []);
    let reply = split(&named, r#"{"city": "Paris"}"#);
    assert_eq!(reply.calls, [call("get_weather", r#"{"city": "Paris"}"#)]);
}

#[test]
fn partial_markers_end_at_character_boundaries() {
    assert_eq!(partial_marker("abc <tool", "<tool_call>"), 5);
    assert_eq!(partial_marker("abc", "<tool_call>"), 0);
    assert_eq!(partial_marker("é<", "<tool_call>"), 1);
    assert_eq!(partial_marker("<tool_call", "<tool_call>"), 10);
}
