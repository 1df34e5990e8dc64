//! The chat templates the supported families ship (transcribed from their HF
//! `tokenizer_config.json` files into `tests/templates/`), rendered through [`ChatTemplate`]
//! and compared with the prompts their model cards show, written out by hand. What this
//! guards: that minijinja with Python's string methods, under HF's environment settings
//! (`trim_blocks`, `lstrip_blocks`), renders these templates as `transformers` does.

use tandem_text::{ChatMessage, ChatTemplate};

fn template(name: &str, bos: &str, eos: &str) -> ChatTemplate {
    let path = format!(
        "{}/tests/templates/{name}.jinja",
        env!("CARGO_MANIFEST_DIR")
    );
    let source = std::fs::read_to_string(&path).unwrap();
    // The JSON string a tokenizer_config holds has no trailing newline; the file here does.
    ChatTemplate::new(source.trim_end_matches('\n'), Some(bos), Some(eos)).unwrap()
}

fn chat(turns: &[(&str, &str)]) -> Vec<ChatMessage> {
    turns
        .iter()
        .map(|(r, c)| ChatMessage::new(*r, *c))
        .collect()
}

#[test]
fn qwen2_5_adds_its_default_system_prompt() {
    let t = template("qwen2.5", "", "<|im_end|>");
    let one = t
        .render(
            &chat(&[(
                "user",
                "Give me a short introduction to large language model.",
            )]),
            true,
        )
        .unwrap();
    assert_eq!(
        one,
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful \
         assistant.<|im_end|>\n<|im_start|>user\nGive me a short introduction to large \
         language model.<|im_end|>\n<|im_start|>assistant\n"
    );
    let turns = chat(&[
        ("system", "You are a helpful assistant."),
        ("user", "Hi"),
        ("assistant", "Hello!"),
        ("user", "How are you?"),
    ]);
    assert_eq!(
        t.render(&turns, true).unwrap(),
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi\
         <|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nHow are you?\
         <|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn qwen3_drops_earlier_reasoning_and_keeps_the_last() {
    let t = template("qwen3", "", "<|im_end|>");
    // Reasoning before the last user query leaves the history.
    let turns = chat(&[
        ("user", "Hi"),
        ("assistant", "<think>\nThe user greets.\n</think>\n\nHello!"),
        ("user", "2+2?"),
    ]);
    assert_eq!(
        t.render(&turns, true).unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n\
         <|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
    // After it, the reasoning stays, re-spaced.
    let turns = chat(&[
        ("system", "Be brief."),
        ("user", "2+2?"),
        ("assistant", "<think>\n\nadd\n</think>\n4"),
    ]);
    assert_eq!(
        t.render(&turns, false).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n\
         <|im_start|>assistant\n<think>\nadd\n</think>\n\n4<|im_end|>\n"
    );
}

#[test]
fn mistral_wraps_user_turns_in_inst() {
    let t = template("mistral-v0.1", "<s>", "</s>");
    let turns = chat(&[("user", "Hi"), ("assistant", "Hello"), ("user", "Again")]);
    assert_eq!(
        t.render(&turns, true).unwrap(),
        "<s>[INST] Hi [/INST]Hello</s>[INST] Again [/INST]"
    );
    let err = t
        .render(&chat(&[("system", "x"), ("user", "Hi")]), true)
        .unwrap_err();
    assert!(err.to_string().contains("alternate"), "{err}");
}

#[test]
fn phi3_tags_each_role() {
    let t = template("phi3-mini", "<s>", "<|endoftext|>");
    let turns = chat(&[("system", "Be brief."), ("user", "Hi")]);
    assert_eq!(
        t.render(&turns, true).unwrap(),
        "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    );
    assert_eq!(
        t.render(&chat(&[("user", "Hi")]), false).unwrap(),
        "<|user|>\nHi<|end|>\n<|endoftext|>"
    );
}

#[test]
fn gemma2_calls_the_assistant_model_and_refuses_system_turns() {
    let t = template("gemma2", "<bos>", "<eos>");
    let turns = chat(&[
        ("user", " Hi \n"),
        ("assistant", "Hello"),
        ("user", "Again"),
    ]);
    assert_eq!(
        t.render(&turns, true).unwrap(),
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n\
         <start_of_turn>user\nAgain<end_of_turn>\n<start_of_turn>model\n"
    );
    let err = t
        .render(&chat(&[("system", "Be brief."), ("user", "Hi")]), true)
        .unwrap_err();
    assert!(
        err.to_string().contains("System role not supported"),
        "{err}"
    );
}

#[test]
fn gemma3_folds_the_system_prompt_into_the_first_user_turn() {
    let t = template("gemma3", "<bos>", "<eos>");
    let turns = chat(&[("system", "Be brief."), ("user", "Hi")]);
    assert_eq!(
        t.render(&turns, true).unwrap(),
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    );
}

#[test]
fn llama3_puts_headers_around_each_turn() {
    let t = template("llama3", "<|begin_of_text|>", "<|eot_id|>");
    let turns = chat(&[("system", "Be brief."), ("user", " Hi ")]);
    assert_eq!(
        t.render(&turns, true).unwrap(),
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\n"
    );
}

/// Every family's template renders a 2000-turn conversation (1 MB of text) within the
/// instruction and output budgets a render gets (`tandem_text::RENDER_FUEL`).
#[test]
fn long_conversations_render_within_the_budgets() {
    for (name, bos, eos) in [
        ("qwen2.5", "", "<|im_end|>"),
        ("qwen3", "", "<|im_end|>"),
        ("mistral-v0.1", "<s>", "</s>"),
        ("phi3-mini", "<s>", "<|endoftext|>"),
        ("gemma2", "<bos>", "<eos>"),
        ("gemma3", "<bos>", "<eos>"),
        ("llama3", "<|begin_of_text|>", "<|eot_id|>"),
    ] {
        let t = template(name, bos, eos);
        let turns: Vec<ChatMessage> = (0..2000)
            .map(|i| {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                ChatMessage::new(role, format!("turn {i} ").repeat(60))
            })
            .collect();
        let out = t
            .render(&turns, true)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(out.len() > 2000 * 400, "{name}: {} bytes", out.len());
    }
}

/// A tool loop through Qwen2.5's template, as transformers renders it: the tools in its
/// system prompt, the assistant's call as `<tool_call>` JSON, the result as a
/// `<tool_response>` user turn; template variables cannot replace the conversation.
#[test]
fn qwen2_5_renders_tools_calls_and_results() {
    use serde_json::json;
    use tandem_text::RenderOptions;
    let t = template("qwen2.5", "", "<|im_end|>");
    let tool = json!({"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}});
    let mut call = ChatMessage::new("assistant", "");
    call.tool_calls = Some(vec![json!({"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}})]);
    let mut result = ChatMessage::new("tool", "{\"temp\": 21}");
    result.tool_call_id = Some("call_1".into());
    let mut options = RenderOptions {
        tools: Some(vec![tool.clone()]),
        ..RenderOptions::default()
    };
    options
        .kwargs
        .insert("messages".into(), json!("not the conversation"));
    let conversation = [ChatMessage::new("user", "Weather in Paris?"), call, result];
    let out = t.render_with(&conversation, true, &options).unwrap();
    let want = format!(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n\
         # Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{}\n</tools>\n\n\
         For each function call, return a json object with function name and arguments within \
         <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": \
         <args-json-object>}}\n</tool_call><|im_end|>\n\
         <|im_start|>user\nWeather in Paris?<|im_end|>\n\
         <|im_start|>assistant\n<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"Paris\"}}}}\n</tool_call><|im_end|>\n\
         <|im_start|>user\n<tool_response>\n{{\"temp\": 21}}\n</tool_response><|im_end|>\n\
         <|im_start|>assistant\n",
        // transformers' tojson: json.dumps, the request's key order, ", " and ": ".
        r#"{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}"#
    );
    assert_eq!(out, want);
}
