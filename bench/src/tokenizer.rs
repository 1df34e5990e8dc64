//! The tokenizer the benchmark counts with: loading (`tokenizer.json`, an HF folder, a GGUF
//! file) and the few HF-`transformers` notions vLLM's datasets use (`vocab_size`,
//! `all_special_ids`, `num_special_tokens_to_add`).
//!
//! Loading is `tandem-text`'s (it owns the file formats, GGUF included); this module adds
//! the counting helpers and the chat template vLLM applies to `sonnet` and `custom` prompts.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use tandem_text::{ChatMessage, ChatTemplate, TextTokenizer};
use tokenizers::tokenizer::PostProcessor;

/// Why a tokenizer could not be loaded or used.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot load tokenizer from {path}: {message}")]
    Load { path: PathBuf, message: String },
    #[error("tokenizer failed: {0}")]
    Run(String),
    #[error("chat template failed: {0}")]
    ChatTemplate(String),
}

/// A loaded tokenizer plus the constants vLLM's dataset code reads from it.
#[derive(Clone)]
pub struct BenchTokenizer {
    inner: tokenizers::Tokenizer,
    num_special_tokens: usize,
    vocab_size: usize,
    special_ids: Vec<u32>,
    chat_template: Option<Arc<ChatTemplate>>,
}

impl std::fmt::Debug for BenchTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BenchTokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("num_special_tokens", &self.num_special_tokens)
            .field("chat_template", &self.chat_template.is_some())
            .finish()
    }
}

/// The name that selects the byte-level tokenizer of tandem's `dummy:` models (no file
/// needed: benchmarks of dummy-model deployments run where nothing can be downloaded).
pub const BYTE_LEVEL: &str = "byte-level";

/// Loads a tokenizer from a `tokenizer.json` file, an HF folder holding one, or a GGUF file,
/// with the folder's chat template when it has one; [`BYTE_LEVEL`] (when no such file
/// exists) is the dummy models' tokenizer.
pub fn load_tokenizer(path: &Path) -> Result<BenchTokenizer, TokenizerError> {
    let load_error = |message: String| TokenizerError::Load {
        path: path.to_path_buf(),
        message,
    };
    let text = if path == Path::new(BYTE_LEVEL) && !path.exists() {
        TextTokenizer::byte_level()
    } else {
        TextTokenizer::from_path(path).map_err(|e| load_error(e.to_string()))?
    };
    let info = text.info();
    let chat_template = match &info.chat_template {
        Some(source) => Some(Arc::new(
            ChatTemplate::new(source, info.bos_token.as_deref(), info.eos_token.as_deref())
                .map_err(|e| load_error(e.to_string()))?,
        )),
        None => None,
    };
    let mut tokenizer = BenchTokenizer::new(text.inner().clone());
    tokenizer.chat_template = chat_template;
    Ok(tokenizer)
}

impl BenchTokenizer {
    /// Wraps a `tokenizers::Tokenizer`.
    pub fn new(inner: tokenizers::Tokenizer) -> Self {
        let num_special_tokens = inner
            .get_post_processor()
            .map(|p| p.added_tokens(false))
            .unwrap_or(0);
        let vocab_size = inner.get_vocab_size(false);
        let mut special_ids: Vec<u32> = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| token.special)
            .map(|(id, _)| id)
            .collect();
        special_ids.sort_unstable();
        Self {
            inner,
            num_special_tokens,
            vocab_size,
            special_ids,
            chat_template: None,
        }
    }

    /// HF's `apply_chat_template([{"role": "user", "content": prompt}],
    /// add_generation_prompt=True, tokenize=False)`; `None` when there is no template.
    pub fn apply_chat_template(&self, prompt: &str) -> Result<Option<String>, TokenizerError> {
        let Some(template) = &self.chat_template else {
            return Ok(None);
        };
        template
            .render(&[ChatMessage::new("user", prompt)], true)
            .map(Some)
            .map_err(|e| TokenizerError::ChatTemplate(e.to_string()))
    }

    /// HF's `tokenizer.vocab_size`: the base vocabulary, without added tokens.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// HF's `num_special_tokens_to_add()`: tokens the post-processor adds to one sequence.
    pub fn num_special_tokens(&self) -> usize {
        self.num_special_tokens
    }

    /// Ids of special added tokens (HF's `all_special_ids`), sorted.
    pub fn special_ids(&self) -> &[u32] {
        &self.special_ids
    }

    /// Token ids of `text`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        self.inner
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError::Run(e.to_string()))
    }

    /// Number of tokens in `text`.
    pub fn count(&self, text: &str, add_special_tokens: bool) -> Result<usize, TokenizerError> {
        self.inner
            .encode_fast(text, add_special_tokens)
            .map(|e| e.len())
            .map_err(|e| TokenizerError::Run(e.to_string()))
    }

    /// Text of `ids`, special tokens kept (HF's `decode` default).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, false)
            .map_err(|e| TokenizerError::Run(e.to_string()))
    }
}

/// A small word-level tokenizer built in code, for tests and the fake-server benchmark:
/// words `w0`…`w{n-1}`, whitespace splitting, and a BOS `<s>` added like Llama's.
pub fn word_level_tokenizer_json(words: usize) -> String {
    let special = ["<s>", "</s>", "<unk>"];
    let mut vocab = serde_json::Map::new();
    for (id, token) in special.iter().enumerate() {
        vocab.insert((*token).to_string(), serde_json::json!(id));
    }
    for i in 0..words {
        vocab.insert(format!("w{i}"), serde_json::json!(i + special.len()));
    }
    let added: Vec<serde_json::Value> = special
        .iter()
        .enumerate()
        .map(|(id, token)| {
            serde_json::json!({"id": id, "content": token, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}
        },
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    })
    .to_string()
}

/// [`word_level_tokenizer_json`] loaded.
pub fn word_level_tokenizer(words: usize) -> Result<BenchTokenizer, TokenizerError> {
    let inner = tokenizers::Tokenizer::from_str(&word_level_tokenizer_json(words))
        .map_err(|e| TokenizerError::Run(e.to_string()))?;
    Ok(BenchTokenizer::new(inner))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn word_level_tokenizer_behaves_like_a_bos_tokenizer() {
        let tok = word_level_tokenizer(100).unwrap();
        assert_eq!(tok.vocab_size(), 103);
        assert_eq!(tok.num_special_tokens(), 1);
        assert_eq!(tok.special_ids(), &[0, 1, 2]);
        assert_eq!(tok.encode("w0 w1", true).unwrap(), vec![0, 3, 4]);
        assert_eq!(tok.count("w0 w1", false).unwrap(), 2);
        assert_eq!(tok.decode(&[3, 4, 5]).unwrap(), "w0 w1 w2");
    }

    #[test]
    fn loads_file_and_folder_with_its_chat_template() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("tokenizer.json");
        std::fs::write(&file, word_level_tokenizer_json(10)).unwrap();
        let from_file = load_tokenizer(&file).unwrap();
        assert_eq!(from_file.vocab_size(), 13);
        assert_eq!(from_file.apply_chat_template("w1").unwrap(), None);
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"chat_template": "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}{% if add_generation_prompt %} [assistant]{% endif %}"}"#,
        )
        .unwrap();
        let from_dir = load_tokenizer(dir.path()).unwrap();
        assert_eq!(from_dir.vocab_size(), 13);
        assert_eq!(
            from_dir.apply_chat_template("w1 w2").unwrap().as_deref(),
            Some("[user] w1 w2 [assistant]")
        );
        let empty = tempfile::tempdir().unwrap();
        assert!(load_tokenizer(empty.path()).is_err());
        let bytes = load_tokenizer(Path::new(BYTE_LEVEL)).unwrap();
        assert_eq!(bytes.vocab_size(), 259);
        assert!(load_tokenizer(&empty.path().join("missing.gguf")).is_err());
    }
}
