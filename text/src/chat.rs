//! Chat templates: the model's own Jinja template rendered with minijinja (plus its Python
//! compatibility methods, since HF templates call `.strip()`, `.items()` and friends).
//!
//! A template comes with a model file, so it is hostile input: every render runs under an
//! instruction budget (minijinja's fuel) and an output budget (a fixed part plus a multiple
//! of the conversation's own bytes), and a template is rendered once on sample conversations
//! when it is compiled ([`ChatTemplate::new`]), so one that breaks them is refused at load.
//! minijinja bounds what a single operation may build (a repeated string, a range).

use minijinja::{Environment, Error, ErrorKind, context};

/// Instructions one render may run: every family's template renders a 2000-turn
/// conversation within it (`tests/family_templates.rs`), and a template that loops without
/// bound stops here in well under a second.
pub const RENDER_FUEL: u64 = 20_000_000;
/// Bytes one render may write beyond [`RENDER_BYTES_PER_INPUT_BYTE`] times its messages':
/// room for the fixed text templates add (default system prompts, tool preambles).
pub const RENDER_BASE_BYTES: usize = 1 << 20;
/// Bytes a render may write per byte of its messages' content (role markers and the like
/// are a few bytes per message; no template copies a message more than a few times).
pub const RENDER_BYTES_PER_INPUT_BYTE: usize = 4;
use serde::{Deserialize, Serialize};

use crate::TextError;

/// One message of a conversation, its content flattened to text; an assistant's tool calls
/// and a tool result's call id as the templates read them (OpenAI's shapes: `tool_calls`
/// items `{"id", "type": "function", "function": {"name", "arguments"}}`, arguments an
/// object). Absent fields are undefined in the template.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
        }
    }

    /// Bytes of this message a render may be charged for (content, role, calls, id).
    fn input_bytes(&self) -> usize {
        let calls = self
            .tool_calls
            .as_ref()
            .map_or(0, |c| c.iter().map(|v| v.to_string().len()).sum());
        self.content.len()
            + self.role.len()
            + calls
            + self.tool_call_id.as_ref().map_or(0, String::len)
    }
}

/// What a render passes the template besides the conversation.
#[derive(Debug, Clone, Default)]
pub struct RenderOptions {
    /// The request's tools (OpenAI's `{"type": "function", "function": {…}}` items), as the
    /// template's `tools`; `None` is `none` there.
    pub tools: Option<Vec<serde_json::Value>>,
    /// Further variables for the template (`chat_template_kwargs`, e.g. `enable_thinking`);
    /// they cannot replace the conversation, the tools or the special tokens.
    pub kwargs: serde_json::Map<String, serde_json::Value>,
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

const TEMPLATE_NAME: &str = "chat";

impl ChatTemplate {
    /// Compiles `source`; `bos_token`/`eos_token` are what the template sees under those names.
    pub fn new(
        source: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<Self, TextError> {
        let mut env = Environment::new();
        // transformers compiles chat templates with these two on: a block tag's own line
        // leaves no newline or indentation behind. Templates are written for that.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        // transformers' `tojson` is Python's json.dumps: ", " and ": " between items (or an
        // indent), non-ASCII as is, nothing escaped for HTML; tools and tool calls print
        // through it, and a model was trained on what it prints.
        env.add_filter("tojson", python_tojson);
        // Llama 3.1 templates print today's date.
        env.add_function("strftime_now", |_fmt: String| -> String {
            "26 Jul 2024".into()
        });
        env.set_fuel(Some(RENDER_FUEL));
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| TextError::ChatTemplate(e.to_string()))?;
        let template = Self {
            env,
            source: source.to_string(),
            bos_token: bos_token.unwrap_or_default().to_string(),
            eos_token: eos_token.unwrap_or_default().to_string(),
        };
        template.dry_render()?;
        Ok(template)
    }

    /// Renders sample conversations under the budgets: a template that runs past them on
    /// these will on every request. Its own refusals (`raise_exception` for a role it does
    /// not take, say) are the template's business, not an error here.
    fn dry_render(&self) -> Result<(), TextError> {
        let samples = [
            vec![ChatMessage::new("user", "Hello!")],
            vec![
                ChatMessage::new("system", "You are a helpful assistant."),
                ChatMessage::new("user", "What is 2 + 2?"),
                ChatMessage::new("assistant", "4"),
                ChatMessage::new("user", "And 3 + 3?"),
            ],
        ];
        for sample in &samples {
            match self.render(sample, true) {
                Err(e @ TextError::ChatTemplateLimit(_)) => return Err(e),
                _ => continue,
            }
        }
        Ok(())
    }

    /// The template's Jinja source (what tool syntax and think tags it teaches).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders the conversation; `add_generation_prompt` opens the assistant's turn.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TextError> {
        self.render_with(messages, add_generation_prompt, &RenderOptions::default())
    }

    /// [`Self::render`] with the request's tools and template variables.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        options: &RenderOptions,
    ) -> Result<String, TextError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TextError::ChatTemplate(e.to_string()))?;
        let input: usize = messages.iter().map(ChatMessage::input_bytes).sum::<usize>()
            + options
                .tools
                .as_ref()
                .map_or(0, |t| t.iter().map(|v| v.to_string().len()).sum())
            + serde_json::Value::Object(options.kwargs.clone())
                .to_string()
                .len();
        let limit = input
            .saturating_mul(RENDER_BYTES_PER_INPUT_BYTE)
            .saturating_add(RENDER_BASE_BYTES);
        let mut out = Bounded {
            written: Vec::new(),
            limit,
        };
        let rendered = template.render_captured_to(
            context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
                tools => &options.tools,
                ..minijinja::Value::from_serialize(&options.kwargs)
            },
            &mut out,
        );
        match rendered {
            Ok(_) => String::from_utf8(out.written)
                .map_err(|_| TextError::ChatTemplate("the render is not UTF-8".into())),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(TextError::ChatTemplateLimit(
                format!("the template ran past its budget of {RENDER_FUEL} instructions"),
            )),
            Err(e) if e.kind() == ErrorKind::WriteFailure => Err(TextError::ChatTemplateLimit(
                format!("the template wrote more than {limit} bytes for {input} bytes of messages"),
            )),
            Err(e) if e.kind() == ErrorKind::InvalidOperation && hit_a_bound(&e) => {
                Err(TextError::ChatTemplateLimit(format!(
                    "the template ran into minijinja's bound: {}",
                    e.detail().unwrap_or_default()
                )))
            }
            Err(e) => Err(TextError::ChatTemplate(e.to_string())),
        }
    }
}

/// Whether a render stopped at one of the bounds minijinja puts on a single operation: its
/// recursion depth, the length of a `range`, the length of a repeated string. Like running
/// out of fuel, hitting one means the template asked for unbounded work (a macro that calls
/// itself forever, a loop of a billion turns), not that a conversation was refused; minijinja
/// tells them apart only by their words.
fn hit_a_bound(e: &Error) -> bool {
    const BOUNDS: [&str; 3] = [
        "recursion limit exceeded",
        "range has too many elements",
        "repeated string is too large",
    ];
    e.detail()
        .is_some_and(|d| BOUNDS.iter().any(|b| d.contains(b)))
}

/// `value | tojson(indent=N)` as transformers prints it (`json.dumps`).
fn python_tojson(
    value: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> Result<minijinja::Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let mut ser = serde_json::Serializer::with_formatter(
                &mut out,
                serde_json::ser::PrettyFormatter::with_indent(&pad),
            );
            serde::Serialize::serialize(&json, &mut ser)
        }
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonFormatter);
            serde::Serialize::serialize(&json, &mut ser)
        }
    };
    written.map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let text = String::from_utf8(out)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(minijinja::Value::from_safe_string(text))
}

/// serde_json's compact output with Python's default separators.
struct PythonFormatter;

/// Python's ", " before every array item and object entry but the first.
fn item_separator<W: ?Sized + std::io::Write>(writer: &mut W, first: bool) -> std::io::Result<()> {
    if first {
        Ok(())
    } else {
        writer.write_all(b", ")
    }
}

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        item_separator(writer, first)
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        item_separator(writer, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

/// A render's output, refusing to grow past `limit` bytes (minijinja then stops with a write
/// failure).
struct Bounded {
    written: Vec<u8>,
    limit: usize,
}

impl std::io::Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.written.len().saturating_add(buf.len()) > self.limit {
            return Err(std::io::Error::other("render output budget exceeded"));
        }
        self.written.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::CHATML_TEMPLATE;

    #[test]
    fn renders_chatml() {
        let t = ChatTemplate::new(CHATML_TEMPLATE, None, None).unwrap();
        let out = t
            .render(
                &[ChatMessage::new("user", "What is the capital of France?")],
                true,
            )
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn block_tags_leave_no_whitespace_as_in_transformers() {
        // Rendered by jinja2 with trim_blocks and lstrip_blocks: "  Hi\n  Yo\n".
        let src = "{% for m in messages %}\n    {% if true %}\n  {{ m.content }}\n    {% endif %}\n{% endfor %}\n";
        let t = ChatTemplate::new(src, None, None).unwrap();
        let out = t
            .render(
                &[
                    ChatMessage::new("user", "Hi"),
                    ChatMessage::new("user", "Yo"),
                ],
                false,
            )
            .unwrap();
        assert_eq!(out, "  Hi\n  Yo\n");
    }

    #[test]
    fn python_methods_and_raise_exception() {
        let src = "{{ bos_token }}{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}{{ m.content.strip() }}|{% endfor %}";
        let t = ChatTemplate::new(src, Some("<s>"), Some("</s>")).unwrap();
        assert_eq!(
            t.render(&[ChatMessage::new("user", "  hi  ")], false)
                .unwrap(),
            "<s>hi|"
        );
        let err = t
            .render(&[ChatMessage::new("tool", "x")], false)
            .unwrap_err();
        assert!(err.to_string().contains("bad role tool"), "{err}");
    }

    /// The constructs the Qwen2.5/Qwen3 and Phi-3 templates lean on (reversed slices, a
    /// namespace updated inside a loop, `split(...)[-1]`, `lstrip`, `startswith`, `is
    /// defined`, `length`), in a template of ours shaped like theirs: the last user turn is
    /// found from the end, and earlier assistant turns lose their reasoning.
    #[test]
    fn reasoning_template_constructs() {
        let src = concat!(
            "{%- if messages[0].role == 'system' -%}",
            "{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}",
            "{%- endif -%}",
            "{%- set ns = namespace(last_query=-1) -%}",
            "{%- for m in messages[::-1] -%}",
            "{%- if ns.last_query < 0 and m.role == 'user' ",
            "and not m.content.startswith('<tool_response>') -%}",
            "{%- set ns.last_query = messages|length - 1 - loop.index0 -%}",
            "{%- endif -%}",
            "{%- endfor -%}",
            "{%- for m in messages -%}",
            "{%- if m.role == 'user' -%}",
            "{{- '<|im_start|>user\n' + m.content + '<|im_end|>\n' -}}",
            "{%- elif m.role == 'assistant' -%}",
            "{%- set answer = m.content.split('</think>')[-1].lstrip('\n') -%}",
            "{%- if loop.index0 > ns.last_query -%}{%- set answer = m.content -%}{%- endif -%}",
            "{{- '<|im_start|>assistant\n' + answer + '<|im_end|>\n' -}}",
            "{%- endif -%}",
            "{%- endfor -%}",
            "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}",
            "{%- if enable_thinking is defined and not enable_thinking -%}",
            "{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}{%- endif -%}",
        );
        let t = ChatTemplate::new(src, None, None).unwrap();
        let conversation = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "2+2?"),
            ChatMessage::new("assistant", "<think>\nadd\n</think>\n\n4"),
            ChatMessage::new("user", "<tool_response>ok</tool_response>"),
            ChatMessage::new("user", "And 3+3?"),
        ];
        assert_eq!(
            t.render(&conversation, true).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n\
             <|im_start|>user\n2+2?<|im_end|>\n\
             <|im_start|>assistant\n4<|im_end|>\n\
             <|im_start|>user\n<tool_response>ok</tool_response><|im_end|>\n\
             <|im_start|>user\nAnd 3+3?<|im_end|>\n\
             <|im_start|>assistant\n"
        );
    }

    #[test]
    fn templates_that_loop_or_print_without_bound_are_refused_at_load() {
        let started = std::time::Instant::now();
        for (what, src) in [
            (
                "loops",
                "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            ),
            (
                "prints",
                "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",
            ),
            ("one huge string", "{{ 'x' * 50000000 }}"),
            // minijinja's own bounds on one operation: as much a sign of unbounded work.
            (
                "recurses",
                "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
            ),
            (
                "a billion-turn range",
                "{% for i in range(1000000000) %}{% endfor %}",
            ),
            ("a string past 100 MB", "{{ 'x' * 1000000000 }}"),
        ] {
            match ChatTemplate::new(src, None, None) {
                Err(TextError::ChatTemplateLimit(_)) => {}
                Err(e) => panic!("{what}: {e}"),
                Ok(_) => panic!("{what}: accepted"),
            }
        }
        // The template's own refusal is not a bound: it loads, and says no per request.
        let refuses = "{{ raise_exception('no system role') }}";
        let t = ChatTemplate::new(refuses, None, None).unwrap();
        assert!(matches!(
            t.render(&[ChatMessage::new("user", "hi")], true),
            Err(TextError::ChatTemplate(_))
        ));
        // Bounded: all of it takes well under the time a request may wait.
        assert!(started.elapsed() < std::time::Duration::from_secs(10));
    }

    /// A template that passes the samples but explodes on some input stops at the budget of
    /// that request.
    #[test]
    fn a_render_that_explodes_on_some_input_stops_at_its_budget() {
        let src = "{% if messages[0].content == 'boom' %}{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}{% endif %}{{ messages[0].content }}";
        let t = ChatTemplate::new(src, None, None).unwrap();
        assert_eq!(
            t.render(&[ChatMessage::new("user", "hi")], true).unwrap(),
            "hi"
        );
        let err = t
            .render(&[ChatMessage::new("user", "boom")], true)
            .unwrap_err();
        assert!(
            matches!(&err, TextError::ChatTemplateLimit(m) if m.contains("more than")),
            "{err}"
        );
    }

    #[test]
    fn a_long_conversation_renders_within_the_budgets() {
        let t = ChatTemplate::new(CHATML_TEMPLATE, None, None).unwrap();
        let conversation: Vec<ChatMessage> = (0..2000)
            .map(|i| {
                ChatMessage::new(
                    if i % 2 == 0 { "user" } else { "assistant" },
                    "x".repeat(500),
                )
            })
            .collect();
        let out = t.render(&conversation, true).unwrap();
        assert!(out.len() > 2000 * 500);
    }

    #[test]
    fn a_template_that_refuses_a_sample_role_still_loads() {
        let src = "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}{% endif %}{{ m.content }}{% endfor %}";
        let t = ChatTemplate::new(src, None, None).unwrap();
        assert_eq!(
            t.render(&[ChatMessage::new("user", "hi")], false).unwrap(),
            "hi"
        );
    }

    #[test]
    fn tojson_prints_as_python_json_dumps() {
        let src =
            "{{ {'b': '<i>', 'a': ['é', 1.5, none]} | tojson }}|{{ {'a': 1} | tojson(indent=2) }}";
        let t = ChatTemplate::new(src, None, None).unwrap();
        assert_eq!(
            t.render(&[], false).unwrap(),
            "{\"b\": \"<i>\", \"a\": [\"é\", 1.5, null]}|{\n  \"a\": 1\n}"
        );
    }

    #[test]
    fn broken_template_is_an_error() {
        assert!(matches!(
            ChatTemplate::new("{% for %}", None, None),
            Err(TextError::ChatTemplate(_))
        ));
    }
}
