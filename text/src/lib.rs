//! Text handling shared by every tandem process that sees text: tokenizers (from a
//! `tokenizer.json`, an HF folder, GGUF metadata, or the built-in byte-level test tokenizer),
//! chat templates, incremental detokenization and stop-string matching.
//!
//! This crate holds no model code on purpose: the router and the benchmark tokenize and
//! render chat templates exactly as the workers do, without pulling in candle. The engine
//! depends on it for the same reason: one tokenizer implementation, so token counts agree
//! everywhere.

mod chat;
mod detok;
mod error;
pub mod gguf;
mod spm;
mod stop;
mod tokenizer;

pub use chat::{ChatMessage, ChatTemplate};
pub use detok::IncrementalDetokenizer;
pub use error::TextError;
pub use stop::{StopMatch, StopStringMatcher};
pub use tokenizer::{TextTokenizer, TokenizerInfo, load_tokenizer};
