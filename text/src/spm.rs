//! SentencePiece vocabularies from GGUF metadata (`tokenizer.ggml.model = llama`: Llama 2,
//! Mistral, Phi-3, Gemma files) rebuilt as an HF BPE tokenizer.
//!
//! A BPE-type SentencePiece model merges, at each step, the adjacent pair whose joined piece
//! has the highest score; the GGUF keeps the pieces and their scores but no merge list. The
//! merge list is therefore derived the way `transformers` derives it when it converts a
//! SentencePiece model: every split of every piece into two pieces of the vocabulary is a
//! merge, ranked by the joined piece's score. Spaces become `▁` (with one put in front of
//! the text unless the file says `add_space_prefix: false`, as Gemma's do), and characters
//! outside the vocabulary fall back to their UTF-8 bytes (`<0xNN>` pieces).

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::{DecoderWrapper, NormalizerWrapper, Tokenizer};

use crate::TextError;
use crate::gguf::GgufMetadata;

/// The piece SentencePiece writes for a space.
const SPACE: &str = "\u{2581}";

/// GGUF token types (llama.cpp's `llama_token_type`).
const TYPE_UNKNOWN: u64 = 2;

/// The tokenizer of a SentencePiece vocabulary: `tokens` with `scores`; `types` tells the
/// unknown piece. Special and user-defined tokens are added by the caller.
pub(crate) fn tokenizer(
    meta: &GgufMetadata,
    tokens: &[&str],
    types: &[u64],
) -> Result<Tokenizer, TextError> {
    let scores: Vec<f64> = meta
        .get("tokenizer.ggml.scores")
        .and_then(|v| v.as_array())
        .map(|a| a.iter().map(|v| v.as_f64().unwrap_or(0.0)).collect())
        .ok_or_else(|| TextError::Gguf("SentencePiece vocabulary without scores".into()))?;
    if scores.len() != tokens.len() {
        return Err(TextError::Gguf(format!(
            "{} tokens but {} scores",
            tokens.len(),
            scores.len()
        )));
    }
    let mut vocab = Vocab::default();
    for (i, t) in tokens.iter().enumerate() {
        vocab.insert(t.to_string(), i as u32);
    }
    let merges = merges(tokens, &scores, &vocab);
    let unk = types
        .iter()
        .position(|&t| t == TYPE_UNKNOWN)
        .map(|i| tokens[i].to_string())
        .or_else(|| vocab.contains_key("<unk>").then(|| "<unk>".to_string()));
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(unk);
    }
    let mut inner = Tokenizer::new(builder.build().map_err(TextError::tokenizer)?);

    let prefix = meta
        .get_bool("tokenizer.ggml.add_space_prefix")
        .unwrap_or(true);
    let space = Replace::new(" ", SPACE).map_err(TextError::tokenizer)?;
    let mut normalizers = Vec::new();
    if prefix {
        normalizers.push(NormalizerWrapper::Prepend(Prepend::new(SPACE.into())));
    }
    normalizers.push(NormalizerWrapper::Replace(space));
    inner
        .with_normalizer(Some(NormalizerSequence::new(normalizers)))
        .map_err(TextError::tokenizer)?;

    let mut decoders = vec![
        DecoderWrapper::Replace(Replace::new(SPACE, " ").map_err(TextError::tokenizer)?),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ];
    if prefix {
        decoders.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
    }
    inner.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(inner)
}

/// Every way to join two pieces of the vocabulary into a third, ranked as `transformers`
/// ranks them: by the joined piece's score, highest first, then by the left piece's length
/// and the right one's, longest first; ties keep vocabulary order.
fn merges(tokens: &[&str], scores: &[f64], vocab: &Vocab) -> Vec<(String, String)> {
    struct Merge {
        score: f64,
        left_len: usize,
        right_len: usize,
        order: (usize, u32, u32),
    }
    let ids = vocab;
    let mut found: Vec<Merge> = Vec::new();
    for (i, (piece, &score)) in tokens.iter().zip(scores).enumerate() {
        for (split, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(split);
            if let (Some(&l), Some(&r)) = (ids.get(left), ids.get(right)) {
                found.push(Merge {
                    score,
                    left_len: left.chars().count(),
                    right_len: right.chars().count(),
                    order: (i, l, r),
                });
            }
        }
    }
    found.sort_by(|a, b| {
        b.score
            .total_cmp(&a.score)
            .then(b.left_len.cmp(&a.left_len))
            .then(b.right_len.cmp(&a.right_len))
            .then(a.order.cmp(&b.order))
    });
    found
        .into_iter()
        .map(|m| {
            let (_, l, r) = m.order;
            (
                tokens[l as usize].to_string(),
                tokens[r as usize].to_string(),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use crate::TextTokenizer;
    use crate::gguf::{GgufMetadata, GgufValue};

    /// A SentencePiece vocabulary small enough to merge by hand: `<unk>`, `<s>`, `</s>`, the
    /// 256 byte pieces, then pieces with the scores their merges go by.
    fn vocabulary(space_prefix: Option<bool>) -> GgufMetadata {
        let mut tokens: Vec<(String, f32, u64)> = vec![
            ("<unk>".into(), 0.0, 2),
            ("<s>".into(), 0.0, 3),
            ("</s>".into(), 0.0, 3),
        ];
        tokens.extend((0..=255u8).map(|b| (format!("<0x{b:02X}>"), 0.0, 6)));
        let pieces = [
            ("▁hello", -1.0),
            ("▁world", -2.0),
            ("▁he", -3.0),
            ("llo", -4.0),
            ("▁wor", -5.0),
            ("ld", -6.0),
            ("▁h", -7.0),
            ("el", -8.0),
            ("lo", -9.0),
            ("or", -10.0),
            ("▁w", -11.0),
            ("▁", -20.0),
            ("h", -21.0),
            ("e", -22.0),
            ("l", -23.0),
            ("o", -24.0),
            ("w", -25.0),
            ("r", -26.0),
            ("d", -27.0),
            ("<start_of_turn>", 0.0),
        ];
        for (p, s) in pieces {
            let ty = if p.starts_with('<') { 3 } else { 1 };
            tokens.push((p.into(), s, ty));
        }
        let mut m = GgufMetadata::default();
        let mut put = |k: &str, v: GgufValue| m.entries.insert(k.into(), v);
        put("tokenizer.ggml.model", GgufValue::String("llama".into()));
        let column = |f: &dyn Fn(&(String, f32, u64)) -> GgufValue| {
            GgufValue::Array(tokens.iter().map(f).collect())
        };
        put(
            "tokenizer.ggml.tokens",
            column(&|t| GgufValue::String(t.0.clone())),
        );
        put("tokenizer.ggml.scores", column(&|t| GgufValue::F32(t.1)));
        put(
            "tokenizer.ggml.token_type",
            column(&|t| GgufValue::I32(t.2 as i32)),
        );
        put("tokenizer.ggml.bos_token_id", GgufValue::U32(1));
        put("tokenizer.ggml.eos_token_id", GgufValue::U32(2));
        put("tokenizer.ggml.add_bos_token", GgufValue::Bool(true));
        if let Some(prefix) = space_prefix {
            put("tokenizer.ggml.add_space_prefix", GgufValue::Bool(prefix));
        }
        m
    }

    fn pieces(tok: &TextTokenizer, text: &str) -> Vec<String> {
        tok.encode(text, true)
            .unwrap()
            .iter()
            .map(|&id| tok.id_to_token(id).unwrap())
            .collect()
    }

    #[test]
    fn merges_follow_the_scores_and_bytes_fill_the_gaps() {
        let tok = TextTokenizer::from_gguf_metadata(&vocabulary(None)).unwrap();
        // Worked by hand: "▁hell" merges ▁h (-7), then ▁he (-3); "l l" has no piece.
        assert_eq!(pieces(&tok, "hello world"), ["<s>", "▁hello", "▁world"]);
        assert_eq!(pieces(&tok, "hell"), ["<s>", "▁he", "l", "l"]);
        // 'é' and '\n' are not pieces: their UTF-8 bytes are.
        assert_eq!(
            pieces(&tok, "hé\nw"),
            ["<s>", "▁h", "<0xC3>", "<0xA9>", "<0x0A>", "w"]
        );
        // Control pieces match whole and are skipped when decoding.
        assert_eq!(
            pieces(&tok, "<start_of_turn>hello"),
            ["<s>", "<start_of_turn>", "▁hello"]
        );
        for text in ["hello world", "hé\nw  world", " hello"] {
            let ids = tok.encode(text, true).unwrap();
            assert_eq!(tok.decode(&ids, true).unwrap(), text);
        }
        assert_eq!(tok.info().eos_token_ids, vec![2]);
    }

    #[test]
    fn gemma_files_put_no_space_in_front() {
        let tok = TextTokenizer::from_gguf_metadata(&vocabulary(Some(false))).unwrap();
        assert_eq!(
            pieces(&tok, "hello world"),
            ["<s>", "h", "el", "lo", "▁world"]
        );
        let ids = tok.encode("hello world", true).unwrap();
        assert_eq!(tok.decode(&ids, true).unwrap(), "hello world");
    }

    #[test]
    fn a_vocabulary_without_scores_is_refused() {
        let mut m = vocabulary(None);
        m.entries.remove("tokenizer.ggml.scores");
        let err = TextTokenizer::from_gguf_metadata(&m).unwrap_err();
        assert!(err.to_string().contains("scores"), "{err}");
    }
}
