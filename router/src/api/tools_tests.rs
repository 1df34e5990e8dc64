//! The tool fields: each `tool_choice` form, the grammars, and the refusals.

use serde_json::json;

use super::*;

fn weather() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }})
}

fn clock() -> Value {
    json!({"type": "function", "function": {"name": "get_time"}})
}

fn param_of(e: ApiError) -> String {
    match e {
        ApiError::Invalid { param, .. } => param.unwrap_or_default(),
        other => panic!("not a 400: {other:?}"),
    }
}

#[test]
fn choices_pick_the_mode() {
    let tools = || Some(vec![weather(), clock()]);
    let hermes = Some(ToolSyntax::Hermes);
    let t = parse(tools(), None, None, hermes).unwrap();
    assert_eq!(
        t.mode,
        ToolMode::Auto {
            syntax: ToolSyntax::Hermes,
            parallel: true
        }
    );
    assert_eq!(t.guide, None);
    let rendered = t.rendered.unwrap();
    // A function without parameters gets an empty object schema, as templates expect.
    assert_eq!(
        rendered[1]["function"]["parameters"],
        json!({"type": "object", "properties": {}})
    );
    // No syntax in the template: Hermes'.
    let t = parse(tools(), Some(json!("auto")), Some(false), None).unwrap();
    assert_eq!(
        t.mode,
        ToolMode::Auto {
            syntax: ToolSyntax::Hermes,
            parallel: false
        }
    );
    // `none`: rendered (the prompt, and its cached prefix, stay the same), not parsed.
    let t = parse(tools(), Some(json!("none")), None, hermes).unwrap();
    assert_eq!((t.mode, t.rendered.is_some()), (ToolMode::Off, true));
    // No tools: off, whatever auto or none says.
    for choice in [
        None,
        Some(json!("auto")),
        Some(json!("none")),
        Some(Value::Null),
    ] {
        let t = parse(None, choice, None, hermes).unwrap();
        assert_eq!((t.mode, t.rendered), (ToolMode::Off, None));
    }
    // Named, three ways.
    for choice in [
        json!({"type": "function", "function": {"name": "get_weather"}}),
        json!({"function": {"name": "get_weather"}}),
        json!("get_weather"),
    ] {
        let t = parse(tools(), Some(choice), None, hermes).unwrap();
        assert_eq!(t.mode, ToolMode::Named("get_weather".into()));
        let guide = t.guide.unwrap();
        assert_eq!(
            guide.spec,
            GuideSpec::JsonSchema(weather()["function"]["parameters"].to_string())
        );
    }
}

#[test]
fn required_allows_every_function_by_name() {
    let t = parse(
        Some(vec![weather(), clock()]),
        Some(json!("required")),
        Some(false),
        None,
    )
    .unwrap();
    assert_eq!(t.mode, ToolMode::Required);
    let GuideSpec::JsonSchema(schema) = t.guide.unwrap().spec else {
        panic!("not a schema");
    };
    let schema: Value = serde_json::from_str(&schema).unwrap();
    assert_eq!(
        (schema["minItems"].clone(), schema["maxItems"].clone()),
        (json!(1), json!(1))
    );
    let calls = schema["items"]["anyOf"].as_array().unwrap();
    assert_eq!(
        calls[0]["properties"]["name"]["enum"],
        json!(["get_weather"])
    );
    assert_eq!(calls[1]["properties"]["name"]["enum"], json!(["get_time"]));
    assert_eq!(
        calls[0]["properties"]["parameters"],
        weather()["function"]["parameters"]
    );
    let parallel = parse(Some(vec![clock()]), Some(json!("required")), None, None).unwrap();
    let GuideSpec::JsonSchema(schema) = parallel.guide.unwrap().spec else {
        panic!("not a schema");
    };
    assert!(!schema.contains("maxItems"));
}

#[test]
fn bad_tool_fields_name_the_field() {
    let cases = [
        (Some(vec![json!("get_weather")]), None, "tools[0]"),
        (
            Some(vec![json!({"type": "retrieval"})]),
            None,
            "tools[0].type",
        ),
        (
            Some(vec![json!({"type": "function"})]),
            None,
            "tools[0].function",
        ),
        (
            Some(vec![json!({"type": "function", "function": {"name": ""}})]),
            None,
            "tools[0].function.name",
        ),
        (
            Some(vec![
                json!({"type": "function", "function": {"name": "f", "parameters": "x"}}),
            ]),
            None,
            "tools[0].function.parameters",
        ),
        (Some(vec![clock(), clock()]), None, "tools[1].function.name"),
        (None, Some(json!("required")), "tool_choice"),
        (
            None,
            Some(json!({"type": "function", "function": {"name": "f"}})),
            "tool_choice",
        ),
        (
            Some(vec![clock()]),
            Some(json!("get_weather")),
            "tool_choice",
        ),
        (
            Some(vec![clock()]),
            Some(json!({"type": "function"})),
            "tool_choice",
        ),
        (Some(vec![clock()]), Some(json!(3)), "tool_choice"),
    ];
    for (tools, choice, param) in cases {
        let e = parse(tools.clone(), choice.clone(), None, None).unwrap_err();
        assert_eq!(param_of(e), param, "{tools:?} {choice:?}");
    }
    let many = vec![clock(); MAX_TOOLS + 1];
    assert_eq!(
        param_of(parse(Some(many), None, None, None).unwrap_err()),
        "tools"
    );
}

#[test]
fn conversation_calls_reach_the_template_as_objects() {
    let calls = json!([{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]);
    let got = message_tool_calls(Some(calls), "assistant", 1)
        .unwrap()
        .unwrap();
    assert_eq!(
        got,
        [json!({"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}})]
    );
    let bad = json!([{"function": {"name": "f", "arguments": "{not json"}}]);
    assert_eq!(
        param_of(message_tool_calls(Some(bad), "assistant", 2).unwrap_err()),
        "messages[2].tool_calls[0].function.arguments"
    );
    assert_eq!(
        param_of(message_tool_calls(Some(json!([])), "user", 0).unwrap_err()),
        "messages[0].tool_calls"
    );
    assert_eq!(
        param_of(message_tool_call_id(Some(json!(5)), 3).unwrap_err()),
        "messages[3].tool_call_id"
    );
}

#[test]
fn call_ids_are_fresh() {
    let (a, b) = (call_id(), call_id());
    assert_ne!(a, b);
    assert_eq!(a.len(), "call_".len() + 24);
}
