//! The `<think>…</think>` block of Qwen3 and the DeepSeek-R1 distills: what is inside is
//! reasoning, what follows the answer. A reply that never opens the block has no reasoning;
//! one cut off inside it (at `max_tokens`) is all reasoning.

use super::parts::{ReplyPart, Seams, partial_marker};

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace yet: the reply may still open the block.
    Start,
    Thinking,
    Answer,
}

#[derive(Debug)]
pub(super) struct ThinkSplitter {
    state: State,
    /// Text not yet settled: the start of the reply, or the end of the reasoning that may be
    /// the start of `</think>`.
    held: String,
    reasoning: Seams,
    /// Whitespace between `</think>` and the answer is a seam.
    answer_started: bool,
    /// The last push was inside the block at some point (its token counts as reasoning).
    touched: bool,
    /// Tokens held at the reply's start (whitespace, or a `<think>` still arriving).
    start_tokens: u32,
}

impl ThinkSplitter {
    pub(super) fn new(starts_thinking: bool) -> Self {
        let mut reasoning = Seams::default();
        reasoning.seam();
        Self {
            state: if starts_thinking {
                State::Thinking
            } else {
                State::Start
            },
            held: String::new(),
            reasoning,
            answer_started: false,
            touched: false,
            start_tokens: 0,
        }
    }

    /// One token's text: reasoning goes to `out`, answer text to `answer` (for the call
    /// splitter). Returns the tokens that this one settles as reasoning: itself when it was
    /// (partly) inside the block, and those held at the reply's start when they turn out to
    /// open it.
    pub(super) fn push_token(
        &mut self,
        text: &str,
        out: &mut Vec<ReplyPart>,
        answer: &mut String,
    ) -> u32 {
        let before = self.state;
        self.touched = before == State::Thinking;
        self.push(text, out, answer);
        match (before, self.state) {
            (State::Start, State::Start) => {
                self.start_tokens += 1;
                0
            }
            (State::Start, _) if self.touched => std::mem::take(&mut self.start_tokens) + 1,
            _ => {
                self.start_tokens = 0;
                u32::from(self.touched)
            }
        }
    }

    fn push(&mut self, text: &str, out: &mut Vec<ReplyPart>, answer: &mut String) {
        match self.state {
            State::Answer => self.answer(text, answer),
            State::Start => {
                self.held.push_str(text);
                let start = self.held.trim_start();
                if let Some(rest) = start.strip_prefix(OPEN) {
                    let rest = rest.to_string();
                    self.held.clear();
                    self.state = State::Thinking;
                    self.touched = true;
                    return self.push(&rest, out, answer);
                }
                if OPEN.starts_with(start) {
                    return; // all whitespace, or `<think>` still arriving
                }
                self.state = State::Answer;
                let held = std::mem::take(&mut self.held);
                answer.push_str(&held);
                self.answer_started = true;
            }
            State::Thinking => {
                self.held.push_str(text);
                let mut reasoning = String::new();
                if let Some(at) = self.held.find(CLOSE) {
                    let rest = self.held[at + CLOSE.len()..].to_string();
                    self.reasoning.text(&self.held[..at], &mut reasoning);
                    self.held.clear();
                    self.state = State::Answer;
                    push_reasoning(reasoning, out);
                    return self.answer(&rest, answer);
                }
                let keep = partial_marker(&self.held, CLOSE);
                let settled = self.held.len() - keep;
                self.reasoning.text(&self.held[..settled], &mut reasoning);
                self.held.drain(..settled);
                push_reasoning(reasoning, out);
            }
        }
    }

    /// The end of the reply: what was held is what it would have been.
    pub(super) fn finish(&mut self, out: &mut Vec<ReplyPart>, answer: &mut String) {
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Start | State::Answer => answer.push_str(&held),
            State::Thinking => {
                let mut reasoning = String::new();
                self.reasoning.text(&held, &mut reasoning);
                push_reasoning(reasoning, out);
            }
        }
    }

    fn answer(&mut self, text: &str, answer: &mut String) {
        let text = if self.answer_started {
            text
        } else {
            let trimmed = text.trim_start();
            if trimmed.is_empty() {
                return;
            }
            self.answer_started = true;
            trimmed
        };
        answer.push_str(text);
    }
}

fn push_reasoning(text: String, out: &mut Vec<ReplyPart>) {
    if !text.is_empty() {
        out.push(ReplyPart::Reasoning(text));
    }
}
