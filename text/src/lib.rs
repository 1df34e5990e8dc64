//! Text handling shared by every tandem process that sees text: tokenizers (from a
//! `tokenizer.json`, an HF folder, GGUF metadata, or the built-in byte-level test tokenizer),
//! chat templates, the parts of a chat reply (reasoning, content, tool calls), incremental
//! detokenization, stop-string matching, and the grammars of
//! structured output (llguidance over the tokenizer's vocabulary).
//!
//! This crate holds no model code on purpose: the router and the benchmark tokenize and
//! render chat templates exactly as the workers do, without pulling in candle. The engine
//! depends on it for the same reason: one tokenizer implementation, so token counts agree
//! everywhere.

mod bounded;
mod chat;
mod detok;
mod error;
pub mod fuzzing;
pub mod gguf;
mod guided;
mod limits;
mod reply;
mod spm;
mod stop;
mod tokenizer;
mod tools;

pub use chat::{
    ChatMessage, ChatTemplate, RENDER_BASE_BYTES, RENDER_BYTES_PER_INPUT_BYTE, RENDER_FUEL,
    RenderOptions,
};
pub use detok::IncrementalDetokenizer;
pub use error::TextError;
pub use guided::{Allowed, Guide, GuideFactory, GuideSpec, MAX_GUIDE_BYTES, MAX_GUIDE_CHOICES};
pub use limits::{Ceiling, ModelLimits, SPM_BYTES_PER_MERGE};
pub use reply::{ParsedReply, ReplyOptions, ReplyParser, ReplyPart, ToolMode};
pub use stop::{StopMatch, StopStringMatcher};
pub use tokenizer::{TextTokenizer, TokenizerInfo, load_tokenizer};
pub use tools::{ParsedOutput, ToolCall, ToolSyntax};
