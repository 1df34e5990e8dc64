//! A chat reply taken apart as it streams: a reasoning model's thinking (`<think>…</think>`),
//! the answer's text, and the tool calls in it, each family's syntax or the JSON that
//! `tool_choice` `required` and named functions constrain the model to write.
//!
//! [`ReplyParser`] takes the reply one token's text at a time and gives back what can be
//! said for sure so far ([`ReplyPart`]s); text that may still turn out to be a marker (the
//! start of `<tool_call>`, say) is held until the next token decides. A whole response is
//! the same parser fed every token, so streamed and whole replies split alike.
//!
//! What the model writes is not trusted: a call that does not parse, lacks a name or is cut
//! off stays in the content as written; parsing never fails. Whitespace at a seam (next to a
//! think tag or a call) is dropped; everywhere else the text is as the model wrote it, and
//! a reply with neither thinking nor tools passes through untouched.

mod calls;
mod parts;
mod think;

use crate::tools::{ParsedOutput, ToolCall, ToolSyntax};
use calls::CallSplitter;
pub use parts::{ReplyPart, ToolMode};
use think::ThinkSplitter;

/// What a reply is parsed for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplyOptions {
    /// The template knows `<think>`: a reply that opens with it thinks first.
    pub reasoning: bool,
    /// The rendered prompt ends inside an open `<think>` (the template opened it, as
    /// DeepSeek-R1's does): the reply starts by thinking.
    pub starts_thinking: bool,
    pub tools: ToolMode,
}

/// One reply's parser (one per choice).
pub struct ReplyParser {
    think: Option<ThinkSplitter>,
    calls: CallSplitter,
    reasoning_tokens: u32,
    calls_made: usize,
}

impl ReplyParser {
    pub fn new(options: &ReplyOptions) -> Self {
        let think = (options.reasoning || options.starts_thinking)
            .then(|| ThinkSplitter::new(options.starts_thinking));
        Self {
            think,
            calls: CallSplitter::new(&options.tools),
            reasoning_tokens: 0,
            calls_made: 0,
        }
    }

    /// Whether the parser may change the text at all (else a caller may pass text through).
    pub fn is_passthrough(&self) -> bool {
        self.think.is_none() && self.calls.is_passthrough()
    }

    /// One token's text; what it settles.
    pub fn push_token(&mut self, text: &str) -> Vec<ReplyPart> {
        let mut out = Vec::new();
        match self.think.as_mut() {
            None => self.calls.push(text, &mut out),
            Some(think) => {
                let mut answer = String::new();
                let reasoning = think.push_token(text, &mut out, &mut answer);
                self.reasoning_tokens = self.reasoning_tokens.saturating_add(reasoning);
                if !answer.is_empty() {
                    self.calls.push(&answer, &mut out);
                }
            }
        }
        self.count(out)
    }

    /// The end of the reply: everything still held.
    pub fn finish(&mut self) -> Vec<ReplyPart> {
        let mut out = Vec::new();
        if let Some(think) = self.think.as_mut() {
            let mut answer = String::new();
            think.finish(&mut out, &mut answer);
            if !answer.is_empty() {
                self.calls.push(&answer, &mut out);
            }
        }
        self.calls.finish(&mut out);
        self.count(out)
    }

    /// Tokens spent thinking (the think tags included).
    pub fn reasoning_tokens(&self) -> u32 {
        self.reasoning_tokens
    }

    /// Whether the reply made a tool call so far.
    pub fn made_calls(&self) -> bool {
        self.calls_made > 0
    }

    fn count(&mut self, parts: Vec<ReplyPart>) -> Vec<ReplyPart> {
        self.calls_made += parts
            .iter()
            .filter(|p| matches!(p, ReplyPart::Call(_) | ReplyPart::CallOpened(_)))
            .count();
        parts
    }
}

impl ToolSyntax {
    /// Splits a finished generation into text and calls (all calls kept), as
    /// [`ReplyParser`] streams them.
    pub fn parse(self, text: &str) -> ParsedOutput {
        let options = ReplyOptions {
            reasoning: false,
            starts_thinking: false,
            tools: ToolMode::Auto {
                syntax: self,
                parallel: true,
            },
        };
        let reply = ParsedReply::parse(&options, [text]);
        ParsedOutput {
            content: reply.content,
            calls: reply.calls,
        }
    }
}

/// A whole reply parsed: the parts joined by kind.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ParsedReply {
    pub reasoning: Option<String>,
    pub content: String,
    pub calls: Vec<ToolCall>,
    pub reasoning_tokens: u32,
}

impl ParsedReply {
    /// Parses `tokens` (each token's text) as [`ReplyParser`] would stream them.
    pub fn parse<'a>(options: &ReplyOptions, tokens: impl IntoIterator<Item = &'a str>) -> Self {
        let mut parser = ReplyParser::new(options);
        let mut reply = Self::default();
        for token in tokens {
            let parts = parser.push_token(token);
            reply.absorb(parts);
        }
        let parts = parser.finish();
        reply.absorb(parts);
        reply.reasoning_tokens = parser.reasoning_tokens();
        reply
    }

    /// Adds streamed parts in order.
    pub fn absorb(&mut self, parts: Vec<ReplyPart>) {
        for part in parts {
            match part {
                ReplyPart::Reasoning(t) => self.reasoning.get_or_insert_default().push_str(&t),
                ReplyPart::Content(t) => self.content.push_str(&t),
                ReplyPart::Call(call) => self.calls.push(call),
                ReplyPart::CallOpened(name) => self.calls.push(ToolCall {
                    name,
                    arguments: String::new(),
                }),
                ReplyPart::Arguments(t) => {
                    if let Some(call) = self.calls.last_mut() {
                        call.arguments.push_str(&t);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
