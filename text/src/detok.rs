//! Incremental detokenization: turns a stream of token ids into text deltas that never
//! split a UTF-8 character and keep the spacing a whole-sequence decode would give.
//!
//! Same method as TGI and vLLM: decode a short window of recent tokens twice (with and
//! without the new ones) and emit the difference, holding back while the window ends in an
//! incomplete byte sequence (decoded as U+FFFD).

use crate::{TextError, TextTokenizer};

/// Per-sequence detokenizer state.
#[derive(Debug, Clone, Default)]
pub struct IncrementalDetokenizer {
    tokens: Vec<u32>,
    /// Start of the window decoded for context (so leading spaces come out right).
    prefix_offset: usize,
    /// End of the text already emitted.
    read_offset: usize,
    skip_special_tokens: bool,
}

impl IncrementalDetokenizer {
    /// `context` are tokens already seen (the prompt's tail); nothing of them is emitted.
    pub fn new(context: &[u32], skip_special_tokens: bool) -> Self {
        // A few tokens of context are enough for any tokenizer's spacing rules.
        let tail = &context[context.len().saturating_sub(6)..];
        Self {
            tokens: tail.to_vec(),
            prefix_offset: 0,
            read_offset: tail.len(),
            skip_special_tokens,
        }
    }

    /// Adds one token; returns the text it completes (possibly empty).
    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> Result<String, TextError> {
        self.tokens.push(id);
        let prefix = tok.decode(
            &self.tokens[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let full = tok.decode(&self.tokens[self.prefix_offset..], self.skip_special_tokens)?;
        if full.len() > prefix.len() && !full.ends_with('\u{fffd}') {
            let delta = match full.get(prefix.len()..) {
                Some(d) if full.starts_with(prefix.as_str()) => d.to_string(),
                // The window's text changed shape (rare normalizers): emit the new text whole.
                _ => tok.decode(&self.tokens[self.read_offset..], self.skip_special_tokens)?,
            };
            self.prefix_offset = self.read_offset;
            self.read_offset = self.tokens.len();
            // Keep the buffer short: only the window is ever decoded again.
            if self.prefix_offset > 64 {
                self.tokens.drain(..self.prefix_offset);
                self.read_offset -= self.prefix_offset;
                self.prefix_offset = 0;
            }
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }

    /// Text still held back at the end of the sequence (an incomplete character at the very
    /// end comes out as U+FFFD, as a whole-sequence decode would give it).
    pub fn finish(&mut self, tok: &TextTokenizer) -> Result<String, TextError> {
        if self.read_offset >= self.tokens.len() {
            return Ok(String::new());
        }
        let prefix = tok.decode(
            &self.tokens[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let full = tok.decode(&self.tokens[self.prefix_offset..], self.skip_special_tokens)?;
        self.prefix_offset = self.tokens.len();
        self.read_offset = self.tokens.len();
        Ok(full.get(prefix.len()..).unwrap_or_default().to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_splits_a_character_and_matches_full_decode() {
        let tok = TextTokenizer::byte_level();
        let text = "héllo wörld ✓ 🚀 done";
        let ids = tok.encode(text, false).unwrap();
        let mut detok = IncrementalDetokenizer::new(&[], true);
        let mut out = String::new();
        for &id in &ids {
            let delta = detok.push(&tok, id).unwrap();
            assert!(
                !delta.contains('\u{fffd}'),
                "half a character emitted: {delta:?}"
            );
            out.push_str(&delta);
        }
        out.push_str(&detok.finish(&tok).unwrap());
        assert_eq!(out, text);
    }

    #[test]
    fn holds_back_until_character_complete() {
        let tok = TextTokenizer::byte_level();
        let ids = tok.encode("🚀", false).unwrap();
        assert_eq!(ids.len(), 4);
        let mut detok = IncrementalDetokenizer::new(&[], true);
        for &id in &ids[..3] {
            assert_eq!(detok.push(&tok, id).unwrap(), "");
        }
        assert_eq!(detok.push(&tok, ids[3]).unwrap(), "🚀");
    }

    #[test]
    fn truncated_character_flushes_as_replacement() {
        let tok = TextTokenizer::byte_level();
        let ids = tok.encode("a🚀", false).unwrap();
        let mut detok = IncrementalDetokenizer::new(&[], true);
        let mut out = String::new();
        for &id in &ids[..3] {
            out.push_str(&detok.push(&tok, id).unwrap());
        }
        out.push_str(&detok.finish(&tok).unwrap());
        assert_eq!(out, "a\u{fffd}");
    }

    #[test]
    fn special_tokens_are_skipped_and_context_not_repeated() {
        let tok = TextTokenizer::byte_level();
        let prompt = tok.encode("<|im_start|>assistant\n", false).unwrap();
        let mut detok = IncrementalDetokenizer::new(&prompt, true);
        let mut out = String::new();
        for id in tok.encode("Hi!<|im_end|>", false).unwrap() {
            out.push_str(&detok.push(&tok, id).unwrap());
        }
        assert_eq!(out, "Hi!");
        // Long outputs keep the window bounded.
        let long: String = "abc ".repeat(100);
        let mut detok = IncrementalDetokenizer::new(&[], true);
        let mut out = String::new();
        for id in tok.encode(&long, false).unwrap() {
            out.push_str(&detok.push(&tok, id).unwrap());
        }
        assert_eq!(out, long);
        assert!(detok.tokens.len() < 80);
    }
}
