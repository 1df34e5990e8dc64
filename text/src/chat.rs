//! Chat templates: the model's own Jinja template rendered with minijinja (plus its Python
//! compatibility methods, since HF templates call `.strip()`, `.items()` and friends).

use minijinja::{Environment, Error, ErrorKind, context};
use serde::{Deserialize, Serialize};

use crate::TextError;

/// One message of a conversation, already flattened to text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
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
        // Llama 3.1 templates print today's date.
        env.add_function("strftime_now", |_fmt: String| -> String {
            "26 Jul 2024".into()
        });
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| TextError::ChatTemplate(e.to_string()))?;
        Ok(Self {
            env,
            bos_token: bos_token.unwrap_or_default().to_string(),
            eos_token: eos_token.unwrap_or_default().to_string(),
        })
    }

    /// Renders the conversation; `add_generation_prompt` opens the assistant's turn.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TextError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TextError::ChatTemplate(e.to_string()))?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| TextError::ChatTemplate(e.to_string()))
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
    fn broken_template_is_an_error() {
        assert!(matches!(
            ChatTemplate::new("{% for %}", None, None),
            Err(TextError::ChatTemplate(_))
        ));
    }
}
