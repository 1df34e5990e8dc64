//! Structured output: a grammar that constrains what a sequence may generate (a JSON schema,
//! any JSON object, a regular expression, one of a list of strings, or a Lark grammar),
//! compiled by llguidance against the tokenizer's vocabulary.
//!
//! A [`GuideFactory`] holds one tokenizer's token trie (every token's bytes), built on the
//! first compilation (a server that never sees a grammar does not pay for it); each request
//! compiles its [`GuideSpec`] into a [`Guide`], which masks the logits of the tokens
//! the grammar does not allow next and follows the tokens actually sampled. When the grammar
//! is complete, only EOS is allowed; a guide that can take no more tokens says so
//! ([`Guide::is_finished`]). llguidance's own limits bound the work of every compilation and
//! every mask, so a hostile grammar costs bounded time; tandem bounds the grammar's size
//! (`MAX_GUIDE_BYTES`) before compiling it.

use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde::{Deserialize, Serialize};
use toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};

use crate::error::TextError;
use crate::tokenizer::{TextTokenizer, bytes_to_unicode};

/// Bytes of a grammar's text (schema, regex, Lark, or all choices together) at most.
pub const MAX_GUIDE_BYTES: usize = 64 * 1024;
/// Strings of a choice at most.
pub const MAX_GUIDE_CHOICES: usize = 1024;

/// What the output must match.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum GuideSpec {
    /// A JSON value valid against this schema (JSON text).
    JsonSchema(String),
    /// Any JSON object.
    JsonObject,
    /// The whole output matches this regular expression.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark syntax (`start: ...`).
    Lark(String),
}

impl GuideSpec {
    /// The request field a problem with this spec is reported under.
    pub fn name(&self) -> &'static str {
        match self {
            GuideSpec::JsonSchema(_) => "json_schema",
            GuideSpec::JsonObject => "json_object",
            GuideSpec::Regex(_) => "regex",
            GuideSpec::Choice(_) => "choice",
            GuideSpec::Lark(_) => "grammar",
        }
    }

    /// Checks the sizes, before anything is compiled.
    pub fn check_size(&self) -> Result<(), TextError> {
        let bytes = match self {
            GuideSpec::JsonSchema(s) | GuideSpec::Regex(s) | GuideSpec::Lark(s) => s.len(),
            GuideSpec::JsonObject => 0,
            GuideSpec::Choice(c) => {
                if c.is_empty() || c.len() > MAX_GUIDE_CHOICES {
                    return Err(TextError::Guide(format!(
                        "a choice needs 1 to {MAX_GUIDE_CHOICES} strings, got {}",
                        c.len()
                    )));
                }
                c.iter().map(String::len).sum()
            }
        };
        if bytes > MAX_GUIDE_BYTES {
            return Err(TextError::Guide(format!(
                "{bytes} bytes of {} (at most {MAX_GUIDE_BYTES})",
                self.name()
            )));
        }
        Ok(())
    }

    fn grammar(&self) -> Result<TopLevelGrammar, TextError> {
        Ok(match self {
            GuideSpec::JsonSchema(text) => {
                let schema: serde_json::Value = serde_json::from_str(text)
                    .map_err(|e| TextError::Guide(format!("the JSON schema is not JSON: {e}")))?;
                TopLevelGrammar::from_json_schema(compact(schema))
            }
            GuideSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
            }
            GuideSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GuideSpec::Choice(choices) => {
                let alternatives: Vec<String> =
                    choices.iter().map(|c| regex_syntax::escape(c)).collect();
                TopLevelGrammar::from_regex(&format!("({})", alternatives.join("|")))
            }
            GuideSpec::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        })
    }
}

/// JSON as `{"a": 1, "b": [2, 3]}`: one space after `:` and `,`, none elsewhere. Flexible
/// whitespace would let a model that likes newlines pad forever inside a valid object. A
/// schema that sets llguidance's own `x-guidance` options keeps them.
fn compact(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(object) = schema.as_object_mut() {
        object.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            })
        });
    }
    schema
}

/// Compiles guides for one tokenizer; cheap to clone (clones share the trie) and shared
/// across threads.
#[derive(Clone)]
pub struct GuideFactory {
    tokenizer: TextTokenizer,
    built: Arc<OnceLock<Result<Built, String>>>,
}

/// What the first compilation builds.
struct Built {
    factory: ParserFactory,
    /// Ids at or above this are not tokens of the vocabulary (a model's padded rows).
    vocab: usize,
}

impl std::fmt::Debug for GuideFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuideFactory")
            .field("built", &self.built.get().is_some())
            .finish_non_exhaustive()
    }
}

impl GuideFactory {
    /// A factory for `tokenizer`'s vocabulary; nothing is built yet.
    pub fn new(tokenizer: &TextTokenizer) -> Self {
        Self {
            tokenizer: tokenizer.clone(),
            built: Arc::new(OnceLock::new()),
        }
    }

    /// The token trie of the tokenizer (every token's bytes; special tokens marked as such).
    fn build(tokenizer: &TextTokenizer) -> Result<Built, String> {
        let words = token_bytes(tokenizer);
        let eos = tokenizer
            .info()
            .eos_token_ids
            .first()
            .copied()
            .unwrap_or_default();
        let info = TokRxInfo::new(words.len() as u32, eos);
        let trie = TokTrie::from(&info, &words);
        let env: toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| format!("building the token trie: {e}"))?;
        // Problems come back as errors; nothing is printed.
        factory.quiet();
        Ok(Built {
            factory,
            vocab: words.len(),
        })
    }

    /// Compiles `spec`: a grammar that is too large or that llguidance cannot compile is a
    /// [`TextError::Guide`] naming why (checked sizes first, before anything is built); a
    /// vocabulary the trie cannot be built from is a [`TextError::Unsupported`].
    pub fn compile(&self, spec: &GuideSpec) -> Result<Guide, TextError> {
        spec.check_size()?;
        let built = self
            .built
            .get_or_init(|| Self::build(&self.tokenizer))
            .as_ref()
            .map_err(|e| TextError::Unsupported(format!("structured output: {e}")))?;
        let parser = built
            .factory
            .create_parser(spec.grammar()?)
            .map_err(|e| TextError::Guide(format!("{}: {e}", spec.name())))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(TextError::Guide(format!("{}: {e}", spec.name())));
        }
        Ok(Guide {
            matcher,
            vocab: built.vocab,
        })
    }
}

/// One sequence's grammar state.
pub struct Guide {
    matcher: Matcher,
    vocab: usize,
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guide")
            .field("finished", &self.is_finished())
            .finish_non_exhaustive()
    }
}

impl Guide {
    /// The tokens the grammar allows next (once it is complete, only EOS). This is the
    /// expensive part: the engine computes it while the forward pass runs.
    pub fn allowed(&mut self) -> Result<Allowed, TextError> {
        let tokens = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| TextError::Guide(format!("computing the token mask: {e}")))?;
        Ok(Allowed {
            tokens,
            vocab: self.vocab,
        })
    }

    /// [`Guide::allowed`] applied to `logits` at once.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), TextError> {
        self.allowed()?.apply(logits);
        Ok(())
    }

    /// An independent copy in the same state (a fresh guide is copied instead of compiled
    /// twice).
    pub fn copy(&self) -> Guide {
        Guide {
            matcher: self.matcher.deep_clone(),
            vocab: self.vocab,
        }
    }

    /// Follows a sampled token (which the mask allowed).
    pub fn advance(&mut self, token: u32) -> Result<(), TextError> {
        self.matcher
            .consume_token(token)
            .map_err(|e| TextError::Guide(format!("token {token} does not fit the grammar: {e}")))
    }

    /// The grammar can take no more tokens: its text is complete (nothing may follow), it
    /// ended with EOS, or it failed.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

/// The set of tokens a grammar allows at one position.
#[derive(Debug, Clone)]
pub struct Allowed {
    tokens: toktrie::SimpleVob,
    vocab: usize,
}

impl Allowed {
    /// Sets the logit of every token outside the set to -inf (and of every row past the
    /// vocabulary: a model's padded rows are never tokens).
    pub fn apply(&self, logits: &mut [f32]) {
        let within = self.vocab.min(logits.len());
        self.tokens.iter_unset_entries(|id| {
            if id < within {
                logits[id] = f32::NEG_INFINITY;
            }
        });
        for l in logits.iter_mut().skip(within) {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// Every token's bytes, in id order. Byte-level BPE pieces map back through GPT-2's byte
/// table, SentencePiece pieces turn `▁` into a space and `<0xAB>` into the byte; special
/// tokens get toktrie's marker byte in front, so no grammar can produce them as text.
fn token_bytes(tokenizer: &TextTokenizer) -> Vec<Vec<u8>> {
    let byte_of: std::collections::HashMap<char, u8> = bytes_to_unicode()
        .into_iter()
        .enumerate()
        .map(|(b, c)| (c, b as u8))
        .collect();
    let byte_level = tokenizer.is_byte_level();
    (0..tokenizer.vocab_size() as u32)
        .map(|id| {
            let Some(piece) = tokenizer.id_to_token(id) else {
                return Vec::new();
            };
            if tokenizer.is_special(id) {
                let mut bytes = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                bytes.extend_from_slice(piece.as_bytes());
                return bytes;
            }
            if let Some(byte) = byte_fallback(&piece) {
                return vec![byte];
            }
            if byte_level && piece.chars().all(|c| byte_of.contains_key(&c)) {
                return piece.chars().map(|c| byte_of[&c]).collect();
            }
            piece.replace('\u{2581}', " ").into_bytes()
        })
        .collect()
}

/// SentencePiece's byte pieces: `<0x0A>` is the byte 0x0A.
fn byte_fallback(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2)
        .then(|| u8::from_str_radix(hex, 16).ok())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Greedy decoding under a guide over the byte-level tokenizer (id = 3 + byte), with
    /// `prefer` ordering the allowed tokens: the guide alone must make the output valid.
    fn generate(spec: &GuideSpec, prefer: impl Fn(u32) -> f32, max: usize) -> (String, bool) {
        let tok = TextTokenizer::byte_level();
        let factory = GuideFactory::new(&tok);
        let mut guide = factory.compile(spec).unwrap();
        let eos = tok.info().eos_token_ids[0];
        let mut out = Vec::new();
        for _ in 0..max {
            let mut logits: Vec<f32> = (0..tok.vocab_size() as u32 + 5).map(&prefer).collect();
            guide.mask(&mut logits).unwrap();
            let best = (0..logits.len())
                .max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)))
                .unwrap() as u32;
            assert!(logits[best as usize].is_finite(), "nothing allowed");
            guide.advance(best).unwrap();
            if best == eos {
                return (String::from_utf8(out).unwrap(), guide.is_finished());
            }
            out.push((best - 3) as u8);
            if guide.is_finished() {
                break;
            }
        }
        (String::from_utf8(out).unwrap(), guide.is_finished())
    }

    #[test]
    fn a_choice_yields_one_of_its_strings_and_then_only_eos() {
        let spec = GuideSpec::Choice(vec!["yes".into(), "no".into(), "maybe".into()]);
        // A model that loves 'm' and then 'z': the guide still completes "maybe".
        let (text, finished) = generate(
            &spec,
            |id| {
                if id == 3 + u32::from(b'm') {
                    5.0
                } else {
                    (id % 7) as f32
                }
            },
            20,
        );
        assert_eq!(text, "maybe");
        assert!(finished);
    }

    #[test]
    fn json_schema_output_parses_and_validates() {
        let schema = r#"{"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
                        "required": ["n", "ok"], "additionalProperties": false}"#;
        let spec = GuideSpec::JsonSchema(schema.into());
        // A model that likes closing things: the guide still fills every required field.
        let likes = |id: u32| match id.saturating_sub(3) as u8 {
            b'}' => 9.0,
            b',' => 8.0,
            b'"' => 7.0,
            b'1' => 6.0,
            b't' => 5.0,
            other => f32::from(other % 5) * 0.1,
        };
        let (text, finished) = generate(&spec, likes, 200);
        assert!(finished, "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert!(v["n"].is_i64() && v["ok"].is_boolean(), "{text}");
        assert_eq!(v.as_object().unwrap().len(), 2);
    }

    #[test]
    fn a_regex_and_any_json_object() {
        let (text, _) = generate(
            &GuideSpec::Regex("[0-9]{3}-[a-z]{2}".into()),
            |id| (id % 11) as f32,
            20,
        );
        assert_eq!(text.len(), 6);
        assert!(text.as_bytes()[..3].iter().all(u8::is_ascii_digit) && &text[3..4] == "-");
        let (text, finished) = generate(&GuideSpec::JsonObject, |id| ((id * 31) % 13) as f32, 300);
        if finished {
            assert!(
                serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(&text).is_ok(),
                "{text}"
            );
        } else {
            assert!(text.starts_with('{'), "{text}");
        }
    }

    #[test]
    fn bad_and_oversized_grammars_are_errors() {
        let factory = GuideFactory::new(&TextTokenizer::byte_level());
        for spec in [
            GuideSpec::JsonSchema("{not json".into()),
            GuideSpec::Regex("(unclosed".into()),
            GuideSpec::Lark("start: undefined_rule".into()),
            GuideSpec::Choice(Vec::new()),
            GuideSpec::Regex("a".repeat(MAX_GUIDE_BYTES + 1)),
        ] {
            assert!(
                matches!(factory.compile(&spec), Err(TextError::Guide(_))),
                "{spec:?}"
            );
        }
    }

    #[test]
    fn token_bytes_follow_the_byte_table_and_mark_specials() {
        let tok = TextTokenizer::byte_level();
        let words = token_bytes(&tok);
        assert_eq!(words[3 + 32], b" ");
        assert_eq!(words[3 + 0xe9], [0xe9]);
        assert_eq!(words[2][0], TokTrie::SPECIAL_TOKEN_MARKER);
        assert_eq!(byte_fallback("<0x0A>"), Some(10));
        assert_eq!(byte_fallback("<0xZZ>"), None);
        assert_eq!(byte_fallback("hello"), None);
    }
}
