//! `TextTokenizer`: a `tokenizers::Tokenizer` plus what the serving path needs to know about
//! it (BOS/EOS ids, chat template), built from any of the sources tandem supports.
//!
//! GGUF files carry their vocabulary in their metadata, as a GPT-2 style byte-level BPE (with
//! merges; SmolLM2 needs the `smollm` pre-tokenizer, digits split one per token) or as
//! SentencePiece pieces with scores (`spm`); we rebuild the equivalent HF tokenizer from it.

use std::path::Path;

use serde::{Deserialize, Serialize};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

use crate::TextError;
use crate::bounded;
use crate::gguf::{self, GgufMetadata};
use crate::limits::{Ceiling, ModelLimits};

/// The pre-tokenizer regex of Llama 3 (`llama-bpe` in GGUF terms).
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizer regex of Qwen2, Qwen2.5 and Qwen3 (`qwen2` in GGUF terms): Llama 3's,
/// but digits one per piece.
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A ChatML template, used by the built-in byte-level tokenizer (and SmolLM2's is the same).
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// What the serving path needs besides the vocabulary itself. Travels with the
/// `tokenizer.json` text from a worker to the router.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenizerInfo {
    /// Token prepended by the template or the post-processor, if any.
    pub bos_token: Option<String>,
    /// Tokens that end generation unless `ignore_eos` is set.
    pub eos_token_ids: Vec<u32>,
    /// The first EOS token's text, for chat templates that print it.
    pub eos_token: Option<String>,
    /// Jinja chat template, when the model has one.
    pub chat_template: Option<String>,
}

/// A tokenizer and its serving metadata.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: Tokenizer,
    info: TokenizerInfo,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("info", &self.info)
            .finish()
    }
}

/// Parses a `tokenizer.json`. The tokenizers library panics on some malformed files (an
/// `expect` in its decoder's deserializer, found by the `tokenizer_json` fuzz target): a
/// model file must not take the process down, so a panic here is an error like any other.
fn parse_tokenizer_json(json: &[u8]) -> Result<Tokenizer, TextError> {
    match std::panic::catch_unwind(|| Tokenizer::from_bytes(json)) {
        Ok(parsed) => parsed.map_err(TextError::tokenizer),
        Err(_) => Err(TextError::Tokenizer(
            "malformed tokenizer.json (the tokenizers library could not read it)".into(),
        )),
    }
}

/// Loads a tokenizer from a `tokenizer.json` file, an HF model folder, or a GGUF file.
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer, TextError> {
    TextTokenizer::from_path(path).map(|t| t.inner)
}

impl TextTokenizer {
    pub fn new(inner: Tokenizer, info: TokenizerInfo) -> Self {
        Self { inner, info }
    }

    /// A tokenizer from a `tokenizer.json` file, an HF folder or a GGUF file, under the
    /// default [`ModelLimits`].
    pub fn from_path(path: &Path) -> Result<Self, TextError> {
        Self::from_path_with(path, &ModelLimits::default())
    }

    /// [`Self::from_path`] under `limits`.
    pub fn from_path_with(path: &Path, limits: &ModelLimits) -> Result<Self, TextError> {
        if path.is_dir() {
            Self::from_hf_dir_with(path, limits)
        } else if gguf::is_gguf(path) {
            Self::from_gguf_metadata_with(&gguf::read_metadata_with(path, limits)?, limits)
        } else {
            let inner = read_tokenizer_json(path, limits)?;
            Ok(Self {
                inner,
                info: TokenizerInfo::default(),
            })
        }
    }

    /// A tokenizer from its `tokenizer.json` text and the metadata that goes with it.
    pub fn from_json(json: &str, info: TokenizerInfo) -> Result<Self, TextError> {
        let inner = parse_tokenizer_json(json.as_bytes())?;
        Ok(Self { inner, info })
    }

    /// An HF model folder: `tokenizer.json`, plus `tokenizer_config.json` (chat template,
    /// special tokens) and `generation_config.json`/`config.json` (EOS ids) when present;
    /// under the default [`ModelLimits`].
    pub fn from_hf_dir(dir: &Path) -> Result<Self, TextError> {
        Self::from_hf_dir_with(dir, &ModelLimits::default())
    }

    /// [`Self::from_hf_dir`] under `limits`.
    pub fn from_hf_dir_with(dir: &Path, limits: &ModelLimits) -> Result<Self, TextError> {
        let inner = read_tokenizer_json(&dir.join("tokenizer.json"), limits)?;
        let mut info = TokenizerInfo::default();
        if let Some(cfg) = read_json_opt(&dir.join("tokenizer_config.json"), limits)? {
            info.chat_template = chat_template_from_config(&cfg);
            info.bos_token = special_token_text(cfg.get("bos_token"));
            info.eos_token = special_token_text(cfg.get("eos_token"));
        }
        for name in ["generation_config.json", "config.json"] {
            if let Some(cfg) = read_json_opt(&dir.join(name), limits)? {
                for id in json_ids(cfg.get("eos_token_id")) {
                    if !info.eos_token_ids.contains(&id) {
                        info.eos_token_ids.push(id);
                    }
                }
            }
        }
        if let Some(id) = info.eos_token.as_deref().and_then(|t| inner.token_to_id(t))
            && !info.eos_token_ids.contains(&id)
        {
            info.eos_token_ids.push(id);
        }
        Ok(Self { inner, info })
    }

    /// Rebuilds the tokenizer of GGUF metadata: a byte-level BPE (`gpt2`) or a SentencePiece
    /// vocabulary (`llama`, see `spm`), under the default [`ModelLimits`].
    pub fn from_gguf_metadata(meta: &GgufMetadata) -> Result<Self, TextError> {
        Self::from_gguf_metadata_with(meta, &ModelLimits::default())
    }

    /// [`Self::from_gguf_metadata`] under `limits`: the vocabulary and the merges (stored, or
    /// derived from a SentencePiece vocabulary) within their ceilings.
    pub fn from_gguf_metadata_with(
        meta: &GgufMetadata,
        limits: &ModelLimits,
    ) -> Result<Self, TextError> {
        let model = meta.get_str("tokenizer.ggml.model").unwrap_or("none");
        if !matches!(model, "gpt2" | "llama") {
            return Err(TextError::Unsupported(format!(
                "GGUF tokenizer model `{model}`: byte-level BPE (`gpt2`) and SentencePiece \
                 (`llama`) are supported; pass a tokenizer.json instead"
            )));
        }
        let tokens = meta.get_strings("tokenizer.ggml.tokens")?;
        // Ids are u32 wherever a tokenizer keeps them, whatever the ceiling says.
        limits.check(
            Ceiling::Vocab,
            tokens.len() as u64,
            "`tokenizer.ggml.tokens`: items",
        )?;
        if u32::try_from(tokens.len()).is_err() {
            return Err(TextError::Gguf(format!(
                "{} tokens do not fit u32 ids",
                tokens.len()
            )));
        }
        let types: Vec<u64> = meta
            .get("tokenizer.ggml.token_type")
            .and_then(|v| v.as_array())
            .map(|a| a.iter().map(|v| v.as_u64().unwrap_or(1)).collect())
            .unwrap_or_default();
        let mut inner = if model == "llama" {
            crate::spm::tokenizer(meta, &tokens, &types, limits)?
        } else {
            Self::byte_level_bpe(meta, &tokens, limits)?
        };

        // Control tokens (type 3) are special: matched whole in text and skipped on decode.
        // Without a type table, fall back on the `<|...|>` spelling.
        let special: Vec<AddedToken> = tokens
            .iter()
            .enumerate()
            .filter(|(i, t)| match types.get(*i) {
                Some(&ty) => ty == 3,
                None => t.starts_with("<|") && t.ends_with("|>"),
            })
            .map(|(_, t)| AddedToken::from(t.to_string(), true))
            .collect();
        inner
            .add_special_tokens(special)
            .map_err(TextError::tokenizer)?;
        let user_defined: Vec<AddedToken> = tokens
            .iter()
            .enumerate()
            .filter(|(i, _)| types.get(*i) == Some(&4))
            .map(|(_, t)| AddedToken::from(t.to_string(), false))
            .collect();
        inner
            .add_tokens(user_defined)
            .map_err(TextError::tokenizer)?;

        let token_text = |key: &str| {
            meta.get_u64(key)
                .and_then(|id| tokens.get(id as usize))
                .map(|t| t.to_string())
        };
        let mut eos_token_ids = Vec::new();
        for key in [
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        ] {
            if let Some(id) = meta.get_u64(key).and_then(|id| u32::try_from(id).ok())
                && (id as usize) < tokens.len()
                && !eos_token_ids.contains(&id)
            {
                eos_token_ids.push(id);
            }
        }
        let bos_token = token_text("tokenizer.ggml.bos_token_id");
        let add_bos = meta
            .get_bool("tokenizer.ggml.add_bos_token")
            .unwrap_or(false);
        if add_bos
            && let (Some(bos), Some(bos_id)) =
                (&bos_token, meta.get_u64("tokenizer.ggml.bos_token_id"))
        {
            let template = TemplateProcessing::builder()
                .try_single(format!("{bos} $A"))
                .and_then(|b| b.try_pair(format!("{bos} $A {bos} $B")))
                .map_err(TextError::tokenizer)?
                .special_tokens(vec![(bos.clone(), bos_id as u32)])
                .build()
                .map_err(TextError::tokenizer)?;
            inner.with_post_processor(Some(template));
        }
        let info = TokenizerInfo {
            bos_token,
            eos_token: token_text("tokenizer.ggml.eos_token_id"),
            eos_token_ids,
            chat_template: meta.get_str("tokenizer.chat_template").map(str::to_string),
        };
        Ok(Self { inner, info })
    }

    /// A GPT-2 style byte-level BPE from a GGUF vocabulary and its merge list.
    fn byte_level_bpe(
        meta: &GgufMetadata,
        tokens: &[&str],
        limits: &ModelLimits,
    ) -> Result<Tokenizer, TextError> {
        let merges = meta.get_strings("tokenizer.ggml.merges")?;
        limits.check(
            Ceiling::Merges,
            merges.len() as u64,
            "`tokenizer.ggml.merges`: items",
        )?;
        let mut vocab = Vocab::default();
        for (i, t) in tokens.iter().enumerate() {
            vocab.insert(t.to_string(), i as u32);
        }
        let merges = merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| TextError::Gguf(format!("malformed merge `{m}`")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(TextError::tokenizer)?;
        let mut inner = Tokenizer::new(bpe);
        let pre = meta.get_str("tokenizer.ggml.pre").unwrap_or("default");
        inner.with_pre_tokenizer(Some(pre_tokenizer_for(pre)?));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        Ok(inner)
    }

    /// The built-in byte-level tokenizer of the tiny test model: `<|endoftext|>` = 0,
    /// `<|im_start|>` = 1, `<|im_end|>` = 2 (EOS), then one token per byte (id = 3 + byte).
    /// Every string round-trips, so tests can use any text.
    pub fn byte_level() -> Self {
        let specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
        let mut vocab = Vocab::default();
        for (i, s) in specials.iter().enumerate() {
            vocab.insert(s.to_string(), i as u32);
        }
        for (byte, ch) in bytes_to_unicode().iter().enumerate() {
            vocab.insert(ch.to_string(), specials.len() as u32 + byte as u32);
        }
        // A vocabulary with no merges cannot fail to build.
        let bpe = match BPE::builder().vocab_and_merges(vocab, Vec::new()).build() {
            Ok(bpe) => bpe,
            Err(e) => unreachable!("built-in byte-level vocabulary is valid: {e}"),
        };
        let mut inner = Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(ByteLevel::new(false, true, false)));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        let special: Vec<AddedToken> = specials
            .iter()
            .map(|s| AddedToken::from(s.to_string(), true))
            .collect();
        if let Err(e) = inner.add_special_tokens(special) {
            unreachable!("built-in special tokens are valid: {e}");
        }
        Self {
            inner,
            info: TokenizerInfo {
                bos_token: Some(specials[1].into()),
                eos_token: Some(specials[2].into()),
                eos_token_ids: vec![2],
                chat_template: Some(CHATML_TEMPLATE.into()),
            },
        }
    }

    pub fn info(&self) -> &TokenizerInfo {
        &self.info
    }

    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }

    /// The `tokenizer.json` text, so another process can rebuild this tokenizer.
    pub fn to_json(&self) -> Result<String, TextError> {
        self.inner.to_string(false).map_err(TextError::tokenizer)
    }

    /// Number of ids the tokenizer can produce, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The largest id the tokenizer can produce, added tokens included (`None` when empty).
    pub fn max_token_id(&self) -> Option<u32> {
        self.inner.get_vocab(true).into_values().max()
    }

    /// Token ids of `text`; `add_special_tokens` applies the post-processor (BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TextError> {
        self.inner
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(TextError::tokenizer)
    }

    /// Text of `ids`; special tokens are dropped when `skip_special_tokens`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TextError> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(TextError::tokenizer)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Whether the vocabulary is byte-level BPE (pieces spell bytes through GPT-2's table).
    pub fn is_byte_level(&self) -> bool {
        matches!(
            self.inner.get_decoder(),
            Some(tokenizers::DecoderWrapper::ByteLevel(_))
        )
    }

    /// Whether `id` is a special (control) token.
    pub fn is_special(&self, id: u32) -> bool {
        self.inner
            .get_added_tokens_decoder()
            .get(&id)
            .is_some_and(|t| t.special)
    }
}

/// GPT-2's reversible byte → printable character table, in byte order.
pub(crate) fn bytes_to_unicode() -> Vec<char> {
    let printable = |b: u32| {
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    };
    let mut next = 256u32;
    (0u32..256)
        .map(|b| {
            let code = if printable(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            char::from_u32(code).unwrap_or('\u{fffd}')
        })
        .collect()
}

fn pre_tokenizer_for(pre: &str) -> Result<PreTokenizerWrapper, TextError> {
    let byte_level =
        |use_regex| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, use_regex));
    Ok(match pre {
        "smollm" => PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            byte_level(true),
        ])),
        "default" | "gpt2" | "gpt-2" => byte_level(true),
        "llama-bpe" | "llama3" | "llama-v3" | "qwen2" => {
            let pattern = if pre == "qwen2" {
                QWEN2_PATTERN
            } else {
                LLAMA3_PATTERN
            };
            let split = Split::new(
                SplitPattern::Regex(pattern.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(TextError::tokenizer)?;
            PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Split(split),
                byte_level(false),
            ]))
        }
        other => {
            return Err(TextError::Unsupported(format!(
                "GGUF pre-tokenizer `{other}`; pass a tokenizer.json instead"
            )));
        }
    })
}

/// A `tokenizer.json` read under `limits`: its size, then its vocabulary and merges counted,
/// before the tokenizers library builds anything. Errors name the file.
fn read_tokenizer_json(path: &Path, limits: &ModelLimits) -> Result<Tokenizer, TextError> {
    let json = bounded::read_file(path, limits)?;
    bounded::check_tokenizer_json(&json, path, limits)?;
    parse_tokenizer_json(&json).map_err(|e| match e {
        TextError::Tokenizer(why) => TextError::Tokenizer(format!("{}: {why}", path.display())),
        other => other,
    })
}

fn read_json_opt(
    path: &Path,
    limits: &ModelLimits,
) -> Result<Option<serde_json::Value>, TextError> {
    if !path.exists() {
        return Ok(None);
    }
    let text = bounded::read_text(path, limits)?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| TextError::Tokenizer(format!("{}: {e}", path.display())))
}

/// `chat_template` is a string, or a list of `{name, template}` with a `default` entry.
fn chat_template_from_config(cfg: &serde_json::Value) -> Option<String> {
    match cfg.get("chat_template")? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(items) => items
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .or_else(|| items.first())
            .and_then(|t| t.get("template"))
            .and_then(|t| t.as_str())
            .map(str::to_string),
        _ => None,
    }
}

/// A special token is written as a string or as `{"content": ...}`.
fn special_token_text(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

fn json_ids(v: Option<&serde_json::Value>) -> Vec<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => n.as_u64().map(|n| n as u32).into_iter().collect(),
        Some(serde_json::Value::Array(items)) => items
            .iter()
            .filter_map(|n| n.as_u64().map(|n| n as u32))
            .collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{GgufValue, write_metadata};

    #[test]
    fn byte_level_round_trips_any_text() {
        let tok = TextTokenizer::byte_level();
        assert_eq!(tok.vocab_size(), 259);
        for text in [
            "hello world",
            "  spaced\n\ttabs",
            "héllo wörld ✓ 🚀",
            "12345",
        ] {
            let ids = tok.encode(text, false).unwrap();
            assert_eq!(ids.len(), text.len(), "one token per byte");
            assert_eq!(tok.decode(&ids, true).unwrap(), text);
        }
        let ids = tok.encode("<|im_start|>user", false).unwrap();
        assert_eq!(ids[0], 1);
        assert!(tok.is_special(2));
        assert!(!tok.is_special(100));
        assert_eq!(tok.decode(&ids, true).unwrap(), "user");
    }

    #[test]
    fn qwen2_pre_tokenizer_splits_digits_one_by_one() {
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
        let pieces = |pre: &str| -> Vec<String> {
            let mut text = PreTokenizedString::from("year 2025!");
            pre_tokenizer_for(pre)
                .unwrap()
                .pre_tokenize(&mut text)
                .unwrap();
            text.get_splits(OffsetReferential::Original, OffsetType::Char)
                .into_iter()
                .map(|(piece, _, _)| piece.to_string())
                .collect()
        };
        assert_eq!(pieces("qwen2"), ["year", "Ġ", "2", "0", "2", "5", "!"]);
        assert_eq!(pieces("llama-bpe"), ["year", "Ġ", "202", "5", "!"]);
    }

    #[test]
    fn json_round_trip_keeps_behaviour() {
        let tok = TextTokenizer::byte_level();
        let json = tok.to_json().unwrap();
        let back = TextTokenizer::from_json(&json, tok.info().clone()).unwrap();
        let text = "<|im_start|>assistant\nHi there 42<|im_end|>";
        assert_eq!(
            tok.encode(text, true).unwrap(),
            back.encode(text, true).unwrap()
        );
        assert_eq!(back.info().eos_token_ids, vec![2]);
    }

    /// A miniature SmolLM2-like GGUF vocabulary: checks the `smollm` pre-tokenizer splits
    /// digits one per token and that control tokens are special.
    #[test]
    fn gguf_vocabulary_with_smollm_pre_tokenizer() {
        let chars = bytes_to_unicode();
        let mut tokens: Vec<String> = vec![
            "<|endoftext|>".into(),
            "<|im_start|>".into(),
            "<|im_end|>".into(),
        ];
        tokens.extend(chars.iter().map(|c| c.to_string()));
        tokens.push("he".into());
        tokens.push("hel".into());
        tokens.push("12".into());
        let mut types = vec![GgufValue::I32(3); 3];
        types.extend(std::iter::repeat_n(GgufValue::I32(1), tokens.len() - 3));
        let s = |v: &str| GgufValue::String(v.into());
        let entries = vec![
            ("tokenizer.ggml.model", s("gpt2")),
            ("tokenizer.ggml.pre", s("smollm")),
            (
                "tokenizer.ggml.tokens",
                GgufValue::Array(tokens.iter().map(|t| s(t)).collect()),
            ),
            ("tokenizer.ggml.token_type", GgufValue::Array(types)),
            (
                "tokenizer.ggml.merges",
                GgufValue::Array(vec![s("h e"), s("he l"), s("1 2")]),
            ),
            ("tokenizer.ggml.bos_token_id", GgufValue::U32(1)),
            ("tokenizer.ggml.eos_token_id", GgufValue::U32(2)),
            ("tokenizer.ggml.add_bos_token", GgufValue::Bool(false)),
            ("tokenizer.chat_template", s(CHATML_TEMPLATE)),
        ];
        let mut buf = Vec::new();
        write_metadata(&mut buf, &entries, 0).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tok.gguf");
        std::fs::write(&path, buf).unwrap();

        let tok = TextTokenizer::from_path(&path).unwrap();
        let hel = tok.token_to_id("hel").unwrap();
        assert_eq!(tok.encode("hel", false).unwrap(), vec![hel]);
        // The merge "1 2" exists, yet digits stay one per token.
        let ids = tok.encode("12", false).unwrap();
        assert_eq!(ids.len(), 2);
        assert_eq!(tok.decode(&ids, false).unwrap(), "12");
        assert_eq!(tok.encode("<|im_end|>", false).unwrap(), vec![2]);
        assert!(tok.is_special(2));
        assert_eq!(tok.info().eos_token_ids, vec![2]);
        assert_eq!(tok.info().bos_token.as_deref(), Some("<|im_start|>"));
        assert!(tok.info().chat_template.is_some());
        assert!(load_tokenizer(&path).is_ok());
    }

    #[test]
    fn hf_folder_reads_config_files() {
        let dir = tempfile::tempdir().unwrap();
        let tok = TextTokenizer::byte_level();
        std::fs::write(dir.path().join("tokenizer.json"), tok.to_json().unwrap()).unwrap();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"chat_template": [{"name": "default", "template": "T"}], "bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>"}"#,
        )
        .unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"eos_token_id": [0, 2]}"#,
        )
        .unwrap();
        let loaded = TextTokenizer::from_path(dir.path()).unwrap();
        assert_eq!(loaded.info().chat_template.as_deref(), Some("T"));
        assert_eq!(loaded.info().bos_token.as_deref(), Some("<|im_start|>"));
        assert_eq!(loaded.info().eos_token_ids, vec![0, 2]);
    }

    #[test]
    fn unsupported_sources_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let mut buf = Vec::new();
        write_metadata(
            &mut buf,
            &[("tokenizer.ggml.model", GgufValue::String("rwkv".into()))],
            0,
        )
        .unwrap();
        let path = dir.path().join("rwkv.gguf");
        std::fs::write(&path, buf).unwrap();
        assert!(matches!(
            TextTokenizer::from_path(&path),
            Err(TextError::Unsupported(_))
        ));
        let missing = dir.path().join("nope.json");
        assert!(matches!(
            TextTokenizer::from_path(&missing),
            Err(TextError::Io { .. })
        ));
        std::fs::write(dir.path().join("bad.json"), "{not json").unwrap();
        assert!(TextTokenizer::from_path(&dir.path().join("bad.json")).is_err());
    }

    /// What a hostile vocabulary declares is refused by name before it is built: ids far past
    /// its entries, nesting past serde_json's depth limit, and a SentencePiece vocabulary of
    /// long pieces, whose merges would cost time and memory quadratic in the file's size.
    #[test]
    fn hostile_vocabularies_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, json: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, json).unwrap();
            path
        };
        let far = write(
            "far.json",
            r#"{"model":{"type":"WordLevel","vocab":{"a":0,"b":50000000},"unk_token":"a"}}"#,
        );
        let err = TextTokenizer::from_path(&far).unwrap_err().to_string();
        assert!(
            err.contains("far.json: token ids (the largest + 1): 50000001"),
            "{err}"
        );
        let deep = format!(
            r#"{{"model":{{"type":"WordLevel","vocab":{{}},"unk_token":{}"a"{}}}}}"#,
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        let err = TextTokenizer::from_path(&write("deep.json", &deep))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("deep.json") && err.contains("recursion limit"),
            "{err}"
        );
        // Pieces "a", "aa", ... of up to 3000 bytes: 4.5 MB of file, ~9e9 bytes to hash.
        let tokens: Vec<GgufValue> = (1..=3000)
            .map(|n| GgufValue::String("a".repeat(n)))
            .collect();
        let scores = vec![GgufValue::F32(0.0); tokens.len()];
        let mut buf = Vec::new();
        write_metadata(
            &mut buf,
            &[
                ("tokenizer.ggml.model", GgufValue::String("llama".into())),
                ("tokenizer.ggml.tokens", GgufValue::Array(tokens)),
                ("tokenizer.ggml.scores", GgufValue::Array(scores)),
            ],
            0,
        )
        .unwrap();
        let path = dir.path().join("spm.gguf");
        std::fs::write(&path, buf).unwrap();
        let started = std::time::Instant::now();
        let err = TextTokenizer::from_path(&path).unwrap_err().to_string();
        assert!(err.contains("SentencePiece merges to derive"), "{err}");
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
    }
}
