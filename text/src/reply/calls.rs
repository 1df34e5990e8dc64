//! Tool calls in the answer's text, as it streams. Hermes-style calls (`<tool_call>…`) are
//! settled one by one as each closes; a Llama 3 or Mistral reply that starts like a call is
//! held to its end (their syntax makes the whole reply the calls, or none of it); a named
//! function's arguments stream as they come; `required`'s array is read at the end.

use super::parts::{ReplyPart, Seams, ToolMode, partial_marker};
use crate::tools::{
    self, HERMES_CLOSE, HERMES_OPEN, MISTRAL_MARK, PYTHON_TAG, ToolCall, ToolSyntax,
};

#[derive(Debug)]
enum State {
    /// Text with no calls possible.
    Passthrough,
    /// Hermes: text, perhaps ending in the start of `<tool_call>`.
    HermesText,
    /// Hermes: inside a call.
    HermesCall,
    /// Llama 3 / Mistral: nothing but whitespace (or the start of a marker) yet.
    Undecided,
    /// Llama 3 / Mistral: text; Mistral's marker may still come.
    WholeText,
    /// Llama 3 / Mistral / `required`: the rest of the reply is read at its end.
    WholeCalls,
    /// A named function: every piece is its arguments.
    Named { opened: bool },
}

#[derive(Debug)]
pub(super) struct CallSplitter {
    mode: ToolMode,
    state: State,
    held: String,
    seams: Seams,
    /// The text's state before the open `<tool_call>`, to put back if it is no call.
    before_call: Seams,
    calls: usize,
}

impl CallSplitter {
    pub(super) fn new(mode: &ToolMode) -> Self {
        let state = match mode {
            ToolMode::Off => State::Passthrough,
            ToolMode::Auto {
                syntax: ToolSyntax::Hermes,
                ..
            } => State::HermesText,
            ToolMode::Auto { .. } => State::Undecided,
            ToolMode::Required => State::WholeCalls,
            ToolMode::Named(_) => State::Named { opened: false },
        };
        Self {
            mode: mode.clone(),
            state,
            held: String::new(),
            seams: Seams::default(),
            before_call: Seams::default(),
            calls: 0,
        }
    }

    pub(super) fn is_passthrough(&self) -> bool {
        matches!(self.state, State::Passthrough)
    }

    pub(super) fn push(&mut self, text: &str, out: &mut Vec<ReplyPart>) {
        match &mut self.state {
            State::Passthrough => content(text.to_string(), out),
            State::Named { opened } => {
                if !*opened {
                    *opened = true;
                    if let ToolMode::Named(name) = &self.mode {
                        out.push(ReplyPart::CallOpened(name.clone()));
                    }
                }
                if !text.is_empty() {
                    out.push(ReplyPart::Arguments(text.to_string()));
                }
            }
            State::WholeCalls => self.held.push_str(text),
            State::HermesText | State::HermesCall => {
                self.held.push_str(text);
                self.hermes(out);
            }
            State::Undecided | State::WholeText => {
                self.held.push_str(text);
                self.whole(out);
            }
        }
    }

    pub(super) fn finish(&mut self, out: &mut Vec<ReplyPart>) {
        let held = std::mem::take(&mut self.held);
        let mut text = String::new();
        match self.state {
            State::Passthrough | State::Named { .. } => {}
            State::HermesText | State::Undecided | State::WholeText => {
                self.seams.text(&held, &mut text)
            }
            State::HermesCall => {
                // Cut off inside a call: the text as the model wrote it.
                self.seams.undo(std::mem::take(&mut self.before_call));
                self.seams.text(&format!("{HERMES_OPEN}{held}"), &mut text)
            }
            State::WholeCalls => {
                let calls = match &self.mode {
                    ToolMode::Required => tools::parse_required(&held),
                    ToolMode::Auto { syntax, .. } => tools::parse_whole(*syntax, &held),
                    _ => None,
                };
                match calls {
                    Some(calls) => {
                        for call in calls {
                            self.call(call, out);
                        }
                    }
                    None => {
                        self.seams.undo(std::mem::take(&mut self.before_call));
                        self.seams.text(&held, &mut text)
                    }
                }
            }
        }
        self.seams.finish(&mut text);
        content(text, out);
    }

    /// Hermes: settles text up to a possible marker and every call that closed.
    fn hermes(&mut self, out: &mut Vec<ReplyPart>) {
        loop {
            match self.state {
                State::HermesText => {
                    if !self.text_until(HERMES_OPEN, out) {
                        return;
                    }
                    self.held.drain(..HERMES_OPEN.len());
                    self.state = State::HermesCall;
                }
                State::HermesCall => {
                    let Some(at) = self.held.find(HERMES_CLOSE) else {
                        return;
                    };
                    let end = at + HERMES_CLOSE.len();
                    match tools::call_from_json(&self.held[..at], &["arguments", "parameters"]) {
                        Some(call) => {
                            self.call(call, out);
                            self.seams.seam();
                        }
                        None => {
                            // Not a call: the text as the model wrote it.
                            self.seams.undo(std::mem::take(&mut self.before_call));
                            let raw = format!("{HERMES_OPEN}{}", &self.held[..end]);
                            let mut text = String::new();
                            self.seams.text(&raw, &mut text);
                            content(text, out);
                        }
                    }
                    self.held.drain(..end);
                    self.state = State::HermesText;
                }
                _ => return,
            }
        }
    }

    /// Llama 3 and Mistral: decides from the reply's start whether it is calls.
    fn whole(&mut self, out: &mut Vec<ReplyPart>) {
        let ToolMode::Auto { syntax, .. } = self.mode else {
            return;
        };
        if let State::Undecided = self.state {
            let start = self.held.trim_start();
            let calls_start = match syntax {
                ToolSyntax::Mistral => [MISTRAL_MARK, "[{"],
                _ => [PYTHON_TAG, "{"],
            };
            if calls_start.iter().any(|m| start.starts_with(m)) {
                self.state = State::WholeCalls;
                return;
            }
            if start.is_empty() || calls_start.iter().any(|m| m.starts_with(start)) {
                return;
            }
            self.state = State::WholeText;
        }
        // Text; Mistral's marker may still open calls after it (read whole, marker and all).
        if syntax == ToolSyntax::Mistral {
            if self.text_until(MISTRAL_MARK, out) {
                self.state = State::WholeCalls;
            }
            return;
        }
        let held = std::mem::take(&mut self.held);
        let mut text = String::new();
        self.seams.text(&held, &mut text);
        content(text, out);
    }

    /// Releases the held text before `marker` as content. When the marker has come, that is
    /// everything before it, a seam follows, `held` starts at the marker, and it returns
    /// true; else everything but an end that may still begin the marker.
    fn text_until(&mut self, marker: &str, out: &mut Vec<ReplyPart>) -> bool {
        let found = self.held.find(marker);
        let settled = found.unwrap_or(self.held.len() - partial_marker(&self.held, marker));
        let mut text = String::new();
        self.seams.text(&self.held[..settled], &mut text);
        self.held.drain(..settled);
        if found.is_some() {
            self.before_call = self.seams.seam();
        }
        content(text, out);
        found.is_some()
    }

    /// A settled call, unless `parallel_tool_calls: false` already let one through.
    fn call(&mut self, call: ToolCall, out: &mut Vec<ReplyPart>) {
        let single = matches!(
            self.mode,
            ToolMode::Auto {
                parallel: false,
                ..
            }
        );
        if single && self.calls > 0 {
            tracing::debug!(name = %call.name, "a second tool call dropped: parallel_tool_calls is false");
            return;
        }
        self.calls += 1;
        out.push(ReplyPart::Call(call));
    }
}

fn content(text: String, out: &mut Vec<ReplyPart>) {
    if !text.is_empty() {
        out.push(ReplyPart::Content(text));
    }
}
