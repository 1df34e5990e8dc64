//! `ServedModel`: what the router serves, as learned from a decode worker's `GetInfo` — the
//! model name, context length, tokenizer and chat template — and the two tokenizations the
//! API routes need. The router owns tokenization so that prompt lengths are counted once, the
//! same way for validation, routing and the workers.

use std::sync::Arc;

use tandem_proto::v1::WorkerInfo;
use tandem_text::{
    ChatMessage, ChatTemplate, GuideFactory, GuideSpec, RenderOptions, TextError, TextTokenizer,
    TokenizerInfo, ToolSyntax,
};

use crate::error::ApiError;

/// The model behind the router, fixed once the first decode worker handed over its tokenizer.
pub struct ServedModel {
    /// The name clients send in `model` (`--served-model-name`, else the worker's).
    pub name: String,
    /// Prompt + generated tokens at most; 0 when the worker did not say.
    pub context_length: u32,
    /// Token ids must be below this; 0 when unknown.
    pub vocab_size: u32,
    /// Ids that end generation unless `ignore_eos`.
    pub eos_token_ids: Vec<u32>,
    /// Unix seconds when the router learned the model (the `created` of `/v1/models`).
    pub created: u64,
    tokenizer: TextTokenizer,
    chat_template: Option<ChatTemplate>,
    /// How the template teaches the model to call tools (`None`: it knows no tools).
    pub tool_syntax: Option<ToolSyntax>,
    /// The template knows `<think>` blocks: replies are split into reasoning and answer.
    pub reasoning: bool,
    /// Compiles structured-output grammars as the workers do (its trie is built on the first
    /// request that has one).
    guides: GuideFactory,
}

/// A rendered chat prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedChat {
    pub ids: Vec<u32>,
    /// The prompt ends inside an open `<think>` block (the template opened it): the reply
    /// starts by thinking.
    pub starts_thinking: bool,
}

/// What a chat template teaches its model: a tool-call syntax, and whether replies think in
/// `<think>` blocks.
fn template_traits(template: Option<&ChatTemplate>) -> (Option<ToolSyntax>, bool) {
    template.map_or((None, false), |t| {
        let source = t.source();
        (
            ToolSyntax::for_template(source),
            source.contains("<think>") || source.contains("</think>"),
        )
    })
}

/// A render's error as the client sees it.
fn render_error(e: TextError) -> ApiError {
    match e {
        // The model's template ran past a render's budgets: the model file's fault,
        // not the client's (the workers refuse such a template at load).
        TextError::ChatTemplateLimit(why) => {
            tracing::error!(why, "the chat template ran past its render budgets");
            ApiError::Internal
        }
        // Template errors are about the conversation (e.g. roles that must
        // alternate), raised by the template itself, so the client gets them.
        e => ApiError::invalid(
            "messages",
            format!("the chat template rejected the messages: {e}"),
        ),
    }
}

/// Whether `prompt` leaves a `<think>` block open at its end.
fn opens_thinking(prompt: &str) -> bool {
    match (prompt.rfind("<think>"), prompt.rfind("</think>")) {
        (Some(open), Some(close)) => open > close,
        (Some(_), None) => true,
        _ => false,
    }
}

impl std::fmt::Debug for ServedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServedModel")
            .field("name", &self.name)
            .field("context_length", &self.context_length)
            .field("vocab_size", &self.vocab_size)
            .field("has_chat_template", &self.chat_template.is_some())
            .field("tool_syntax", &self.tool_syntax)
            .field("reasoning", &self.reasoning)
            .finish()
    }
}

impl ServedModel {
    /// Builds the model from a decode worker's info, which must carry the tokenizer.
    pub fn from_worker_info(
        info: &WorkerInfo,
        served_model_name: Option<&str>,
    ) -> Result<Self, String> {
        let spec = info
            .tokenizer
            .as_ref()
            .ok_or_else(|| "the worker's info carries no tokenizer".to_string())?;
        let tokenizer = TextTokenizer::from_json(
            &spec.tokenizer_json,
            TokenizerInfo {
                bos_token: spec.bos_token.clone(),
                eos_token_ids: spec.eos_token_ids.clone(),
                eos_token: spec.eos_token.clone(),
                chat_template: spec.chat_template.clone(),
            },
        )
        .map_err(|e| format!("cannot build the tokenizer: {e}"))?;
        let chat_template = match spec.chat_template.as_deref() {
            None => None,
            Some(src) => {
                match ChatTemplate::new(src, spec.bos_token.as_deref(), spec.eos_token.as_deref()) {
                    Ok(t) => Some(t),
                    Err(e) => {
                        tracing::warn!(error = %e, "the model's chat template does not compile; chat completions are disabled");
                        None
                    }
                }
            }
        };
        let name = match served_model_name {
            Some(n) => n.to_string(),
            None if !info.model_name.is_empty() => info.model_name.clone(),
            None => "tandem".to_string(),
        };
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default();
        let guides = GuideFactory::new(&tokenizer);
        let (tool_syntax, reasoning) = template_traits(chat_template.as_ref());
        Ok(Self {
            name,
            context_length: info.context_length,
            vocab_size: info.vocab_size,
            eos_token_ids: spec.eos_token_ids.clone(),
            created,
            tokenizer,
            chat_template,
            tool_syntax,
            reasoning,
            guides,
        })
    }

    /// A model around a tokenizer directly (tests and embedders).
    pub fn new(
        name: &str,
        context_length: u32,
        tokenizer: TextTokenizer,
        chat_template: Option<ChatTemplate>,
    ) -> Self {
        let guides = GuideFactory::new(&tokenizer);
        let (tool_syntax, reasoning) = template_traits(chat_template.as_ref());
        Self {
            name: name.to_string(),
            context_length,
            vocab_size: u32::try_from(tokenizer.vocab_size()).unwrap_or(u32::MAX),
            eos_token_ids: tokenizer.info().eos_token_ids.clone(),
            created: 0,
            tokenizer,
            chat_template,
            tool_syntax,
            reasoning,
            guides,
        }
    }

    /// Compiles `spec` against this tokenizer with the code the workers run, so a grammar a
    /// worker would refuse gets a 400 naming `param` here. Milliseconds: call it through
    /// `AppState::encode`.
    pub fn check_guide(&self, spec: &GuideSpec, param: &str) -> Result<(), ApiError> {
        match self.guides.compile(spec) {
            Ok(_) => Ok(()),
            Err(TextError::Guide(e)) => Err(ApiError::invalid(param, format!("`{param}`: {e}"))),
            Err(e) => {
                tracing::error!(error = %e, "cannot build the structured-output token trie");
                Err(ApiError::Internal)
            }
        }
    }

    /// Token ids of a completion prompt: the tokenizer's special tokens (BOS) included.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, ApiError> {
        self.encode_text(text, true)
    }

    /// Token ids of `text`, with the tokenizer's special tokens (BOS) or without.
    pub fn encode_text(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, ApiError> {
        self.tokenizer
            .encode(text, add_special_tokens)
            .map_err(|e| {
                tracing::warn!(error = %e, "tokenizer failed on a prompt");
                ApiError::invalid("prompt", "the prompt could not be tokenized")
            })
    }

    /// One token's text as logprobs report it: the id decoded on its own, special tokens
    /// included (a piece of a multi-byte character decodes to U+FFFD; an id outside the
    /// vocabulary to nothing).
    pub fn token_text(&self, id: u32) -> String {
        if self.vocab_size > 0 && id >= self.vocab_size {
            return String::new();
        }
        self.tokenizer.decode(&[id], false).unwrap_or_default()
    }

    /// Whether `id` is one of the tokenizer's special tokens.
    pub fn is_special(&self, id: u32) -> bool {
        self.tokenizer.is_special(id)
    }

    /// The vocabulary's piece of each id (`?` for an id outside it).
    pub fn pieces(&self, ids: &[u32]) -> Vec<String> {
        ids.iter()
            .map(|&id| self.tokenizer.id_to_token(id).unwrap_or_else(|| "?".into()))
            .collect()
    }

    /// Token ids of a conversation: the chat template with the assistant turn opened, encoded
    /// without adding special tokens, since the template writes its own.
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, ApiError> {
        self.encode_conversation(messages, true)
    }

    /// [`Self::encode_chat`], with the assistant turn opened or not.
    pub fn encode_conversation(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, ApiError> {
        let options = RenderOptions::default();
        self.render_chat(messages, add_generation_prompt, &options)
            .map(|chat| chat.ids)
    }

    /// A chat request's prompt: the conversation with the request's tools and template
    /// variables, the assistant turn opened.
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        options: &RenderOptions,
    ) -> Result<RenderedChat, ApiError> {
        let template = self.chat_template.as_ref().ok_or_else(|| {
            ApiError::invalid_body("this model has no chat template: use /v1/completions instead")
        })?;
        let render = |add_generation_prompt| {
            template
                .render_with(messages, add_generation_prompt, options)
                .map_err(render_error)
        };
        let text = render(add_generation_prompt)?;
        // Only the turn the template opens counts (a message may mention `<think>`): what
        // the generation prompt adds to the conversation.
        let starts_thinking = self.reasoning
            && add_generation_prompt
            && render(false)
                .ok()
                .and_then(|conversation| text.strip_prefix(conversation.as_str()))
                .is_some_and(opens_thinking);
        let ids = self.tokenizer.encode(&text, false).map_err(|e| {
            tracing::warn!(error = %e, "tokenizer failed on a rendered conversation");
            ApiError::invalid("messages", "the messages could not be tokenized")
        })?;
        Ok(RenderedChat {
            ids,
            starts_thinking,
        })
    }

    /// Each token of `text` (special tokens added) with its piece and the byte range of
    /// `text` it came from (TGI's `/tokenize`).
    pub fn tokenize_with_offsets(
        &self,
        text: &str,
    ) -> Result<Vec<(u32, String, usize, usize)>, ApiError> {
        let encoding = self.tokenizer.inner().encode(text, true).map_err(|e| {
            tracing::warn!(error = %e, "tokenizer failed on a prompt");
            ApiError::invalid("inputs", "the input could not be tokenized")
        })?;
        Ok(encoding
            .get_ids()
            .iter()
            .zip(encoding.get_offsets())
            .map(|(&id, &(start, stop))| {
                let piece = text.get(start..stop).unwrap_or_default().to_string();
                (id, piece, start, stop)
            })
            .collect())
    }

    /// The text of token ids (special tokens kept: `/detokenize` returns what was given).
    pub fn decode(&self, ids: &[u32], param: &str) -> Result<String, ApiError> {
        if self.vocab_size > 0
            && let Some(bad) = ids.iter().find(|&&id| id >= self.vocab_size)
        {
            return Err(ApiError::invalid(
                param,
                format!(
                    "token id {bad} is out of range: the vocabulary has {} tokens",
                    self.vocab_size
                ),
            ));
        }
        self.tokenizer.decode(ids, false).map_err(|e| {
            tracing::warn!(error = %e, "tokenizer failed to decode");
            ApiError::invalid(param, "the tokens could not be decoded")
        })
    }

    /// Whether `id` ends generation (when EOS is not ignored).
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_token_ids.contains(&id)
    }
}

/// Encodes on the blocking pool: long prompts take milliseconds of CPU that must not stall
/// the async workers serving other streams.
pub async fn encode_blocking<F, T>(model: Arc<ServedModel>, f: F) -> Result<T, ApiError>
where
    F: FnOnce(&ServedModel) -> Result<T, ApiError> + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(move || f(&model))
        .await
        .map_err(|e| {
            tracing::error!(error = %e, "tokenization task failed");
            ApiError::Internal
        })?
}
