//! SentencePiece vocabularies from GGUF metadata, built into tokenizers through the public
//! loader: merges by score, byte fallback, the space prefix, refusals.

use tandem_text::TextTokenizer;
use tandem_text::gguf::{GgufMetadata, GgufValue};

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
