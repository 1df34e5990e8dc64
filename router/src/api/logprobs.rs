//! The `logprobs` objects of OpenAI's responses, built from the tokens' log-probabilities
//! and their most likely alternatives as the workers report them (the sampling module of
//! `tandem-engine` defines the numbers: after logit bias and penalties, before temperature).
//!
//! Chat (`logprobs: true`, `top_logprobs: N`): `{"content": [{token, logprob, bytes,
//! top_logprobs: [N × {token, logprob, bytes}]}]}`. Completions (`logprobs: N`): the legacy
//! shape `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`, whose
//! dictionaries hold the N most likely tokens and the sampled one, as OpenAI documents (up to
//! N + 1 entries). Special tokens (an EOS that ends the text) are not reported, so the tokens
//! concatenate to the returned text. Streaming sends each token's entry in its own chunk.
//!
//! Prompt logprobs (the raw model output, see `flow::PromptEntry`): with `echo` on
//! completions, the prompt's tokens open the legacy object (the first with `null` logprob and
//! alternatives, as OpenAI's); vLLM's `prompt_logprobs` is a list with `null` for the first
//! token and then `{id: {logprob, rank, decoded_token}}` for the token and its alternatives.

use serde::Serialize;
use serde_json::{Map, Value};

use crate::flow::{PromptEntry, TokenOut};
use crate::model::ServedModel;

/// Which shape a request asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogprobsShape {
    Chat,
    Completion,
}

/// One alternative in a chat entry.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TopEntry {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// One token of a chat response's `logprobs.content`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatEntry {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopEntry>,
}

/// The `logprobs` object of a response or of one streamed chunk.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Logprobs {
    chat: Vec<ChatEntry>,
    tokens: Vec<String>,
    /// `None` for the prompt's first token (nothing predicts it).
    token_logprobs: Vec<Option<f32>>,
    top_logprobs: Vec<Option<Map<String, Value>>>,
    text_offset: Vec<usize>,
}

/// Builds the entries of one request, keeping the completion text's running offset.
#[derive(Debug)]
pub struct LogprobsBuilder {
    shape: LogprobsShape,
    /// Characters of completion text before the next token (the legacy `text_offset`).
    offset: usize,
}

/// OpenAI writes a logprob of -inf (a suppressed token) as a very negative number.
fn finite(logprob: f32) -> f32 {
    logprob.max(-9999.0)
}

impl LogprobsBuilder {
    pub fn new(shape: LogprobsShape) -> Self {
        Self { shape, offset: 0 }
    }

    /// Appends `token`'s entry to `into` (nothing for a special token).
    pub fn push(&mut self, model: &ServedModel, token: &TokenOut, into: &mut Logprobs) {
        if token.special {
            return;
        }
        let text = model.token_text(token.id);
        match self.shape {
            LogprobsShape::Chat => into.chat.push(ChatEntry {
                bytes: text.as_bytes().to_vec(),
                token: text,
                logprob: finite(token.logprob),
                top_logprobs: token
                    .top_logprobs
                    .iter()
                    .map(|&(id, logprob)| {
                        let token = model.token_text(id);
                        TopEntry {
                            bytes: token.as_bytes().to_vec(),
                            token,
                            logprob: finite(logprob),
                        }
                    })
                    .collect(),
            }),
            LogprobsShape::Completion => {
                let mut top = Map::new();
                for &(id, logprob) in &token.top_logprobs {
                    top.entry(model.token_text(id))
                        .or_insert_with(|| Value::from(finite(logprob)));
                }
                top.entry(text.clone())
                    .or_insert_with(|| Value::from(finite(token.logprob)));
                into.text_offset.push(self.offset);
                self.offset += text.chars().count();
                into.tokens.push(text);
                into.token_logprobs.push(Some(finite(token.logprob)));
                into.top_logprobs.push(Some(top));
            }
        }
    }

    /// Appends the prompt's tokens (completions with `echo`): `entries[i]` is the logprob of
    /// `prompt[i + 1]`; the first token has none.
    pub fn push_prompt(
        &mut self,
        model: &ServedModel,
        prompt: &[u32],
        entries: &[PromptEntry],
        into: &mut Logprobs,
    ) {
        for (i, &id) in prompt.iter().enumerate() {
            let text = model.token_text(id);
            let entry = i.checked_sub(1).and_then(|e| entries.get(e));
            into.text_offset.push(self.offset);
            self.offset += text.chars().count();
            into.token_logprobs.push(entry.map(|e| finite(e.logprob)));
            into.top_logprobs.push(entry.map(|e| {
                let mut top = Map::new();
                for &(alt, logprob) in &e.top_logprobs {
                    top.entry(model.token_text(alt))
                        .or_insert_with(|| Value::from(finite(logprob)));
                }
                top.entry(text.clone())
                    .or_insert_with(|| Value::from(finite(e.logprob)));
                top
            }));
            into.tokens.push(text);
        }
    }
}

/// vLLM's `prompt_logprobs`: `null` for the first token, then each token's entry keyed by id
/// (its own, then its alternatives).
pub fn vllm_prompt_logprobs(model: &ServedModel, prompt: &[u32], entries: &[PromptEntry]) -> Value {
    let mut list = vec![Value::Null];
    for (&id, e) in prompt.iter().skip(1).zip(entries) {
        let mut map = Map::new();
        map.insert(
            id.to_string(),
            serde_json::json!({"logprob": finite(e.logprob), "rank": e.rank,
                               "decoded_token": model.token_text(id)}),
        );
        for (rank, &(alt, logprob)) in (1u32..).zip(&e.top_logprobs) {
            map.entry(alt.to_string()).or_insert_with(|| {
                serde_json::json!({"logprob": finite(logprob), "rank": rank,
                                   "decoded_token": model.token_text(alt)})
            });
        }
        list.push(Value::Object(map));
    }
    Value::Array(list)
}

impl Logprobs {
    /// The JSON object for a response's `logprobs` field.
    pub fn to_json(&self, shape: LogprobsShape) -> Value {
        match shape {
            LogprobsShape::Chat => serde_json::json!({ "content": self.chat }),
            LogprobsShape::Completion => serde_json::json!({
                "tokens": self.tokens,
                "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_text::TextTokenizer;

    fn model() -> ServedModel {
        ServedModel::new("m", 100, TextTokenizer::byte_level(), None)
    }

    /// The byte-level tokenizer's id of a byte.
    fn id(byte: u8) -> u32 {
        3 + u32::from(byte)
    }

    fn token(id: u32, logprob: f32, top: &[(u32, f32)], special: bool) -> TokenOut {
        TokenOut {
            choice: 0,
            id,
            text: String::new(),
            logprob,
            index: 0,
            special,
            top_logprobs: top.to_vec(),
        }
    }

    #[test]
    fn chat_entries_carry_token_text_bytes_and_alternatives() {
        let m = model();
        let mut b = LogprobsBuilder::new(LogprobsShape::Chat);
        let mut lp = Logprobs::default();
        b.push(
            &m,
            &token(
                id(b'h'),
                -0.25,
                &[(id(b'h'), -0.25), (id(b'j'), -2.0)],
                false,
            ),
            &mut lp,
        );
        b.push(&m, &token(id(b'i'), f32::NEG_INFINITY, &[], false), &mut lp);
        let json = lp.to_json(LogprobsShape::Chat);
        assert_eq!(
            json,
            serde_json::json!({"content": [
                {"token": "h", "logprob": -0.25, "bytes": [104], "top_logprobs": [
                    {"token": "h", "logprob": -0.25, "bytes": [104]},
                    {"token": "j", "logprob": -2.0, "bytes": [106]},
                ]},
                {"token": "i", "logprob": -9999.0, "bytes": [105], "top_logprobs": []},
            ]})
        );
    }

    #[test]
    fn echoed_prompts_open_the_legacy_object_and_vllm_lists_them_by_id() {
        let m = model();
        let prompt = [id(b'h'), id(b'i')];
        let entries = [PromptEntry {
            logprob: -3.0,
            rank: 4,
            top_logprobs: vec![(id(b'o'), -0.5)],
        }];
        let mut b = LogprobsBuilder::new(LogprobsShape::Completion);
        let mut lp = Logprobs::default();
        b.push_prompt(&m, &prompt, &entries, &mut lp);
        b.push(&m, &token(id(b'!'), -1.0, &[], false), &mut lp);
        assert_eq!(
            lp.to_json(LogprobsShape::Completion),
            serde_json::json!({
                "tokens": ["h", "i", "!"], "token_logprobs": [null, -3.0, -1.0],
                "top_logprobs": [null, {"o": -0.5, "i": -3.0}, {"!": -1.0}],
                "text_offset": [0, 1, 2],
            })
        );
        assert_eq!(
            vllm_prompt_logprobs(&m, &prompt, &entries),
            serde_json::json!([null, {
                id(b'i').to_string(): {"logprob": -3.0, "rank": 4, "decoded_token": "i"},
                id(b'o').to_string(): {"logprob": -0.5, "rank": 1, "decoded_token": "o"},
            }])
        );
    }

    #[test]
    fn completion_entries_are_the_legacy_shape_with_the_sampled_token_added() {
        let m = model();
        let mut b = LogprobsBuilder::new(LogprobsShape::Completion);
        let mut first = Logprobs::default();
        b.push(
            &m,
            &token(id(b'a'), -1.5, &[(id(b'b'), -0.5)], false),
            &mut first,
        );
        // A special token (EOS) is not reported; offsets continue from the text.
        b.push(&m, &token(id(b'c'), -0.1, &[], true), &mut first);
        let mut second = Logprobs::default();
        b.push(
            &m,
            &token(id(b'd'), -0.75, &[(id(b'd'), -0.75)], false),
            &mut second,
        );
        assert_eq!(
            first.to_json(LogprobsShape::Completion),
            serde_json::json!({
                "tokens": ["a"], "token_logprobs": [-1.5],
                "top_logprobs": [{"b": -0.5, "a": -1.5}], "text_offset": [0],
            })
        );
        assert_eq!(
            second.to_json(LogprobsShape::Completion),
            serde_json::json!({
                "tokens": ["d"], "token_logprobs": [-0.75],
                "top_logprobs": [{"d": -0.75}], "text_offset": [1],
            })
        );
    }
}
