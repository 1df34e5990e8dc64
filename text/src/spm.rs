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
use crate::limits::{Ceiling, ModelLimits, SPM_BYTES_PER_MERGE};

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
    limits: &ModelLimits,
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
    let merges = merges(tokens, &scores, &vocab, limits)?;
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
///
/// Each split of a piece of `n` bytes hashes up to `n` bytes and each merge found keeps `n`,
/// so the work and the memory grow with the sum of the squared piece lengths, not with the
/// file's size: a few long pieces in a small file would take hours and gigabytes. That sum
/// is bounded before any merge is derived ([`SPM_BYTES_PER_MERGE`] per allowed merge), and
/// so is the number of merges found.
fn merges(
    tokens: &[&str],
    scores: &[f64],
    vocab: &Vocab,
    limits: &ModelLimits,
) -> Result<Vec<(String, String)>, TextError> {
    let max_merges = limits.get(Ceiling::Merges);
    let work: u64 = tokens
        .iter()
        .map(|t| (t.len() as u64).saturating_mul(t.len() as u64))
        .fold(0, u64::saturating_add);
    limits.check(
        Ceiling::Merges,
        work / SPM_BYTES_PER_MERGE,
        format_args!(
            "SentencePiece merges to derive: the squared piece lengths sum to {work} bytes, \
             at {SPM_BYTES_PER_MERGE} a merge"
        ),
    )?;
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
                if found.len() as u64 >= max_merges {
                    return Err(TextError::OverLimit {
                        what: "SentencePiece merges derived".into(),
                        value: found.len() as u64 + 1,
                        limit: max_merges,
                        key: Ceiling::Merges.key(),
                    });
                }
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
    Ok(found
        .into_iter()
        .map(|m| {
            let (_, l, r) = m.order;
            (
                tokens[l as usize].to_string(),
                tokens[r as usize].to_string(),
            )
        })
        .collect())
}
