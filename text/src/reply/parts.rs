//! The pieces a reply parser gives back, the ways calls are looked for, and the whitespace
//! rule at the seams between them (shared by the think and call splitters).

use crate::tools::{ToolCall, ToolSyntax};

/// A piece of a reply, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplyPart {
    /// Text of the model's thinking.
    Reasoning(String),
    /// Text of the answer.
    Content(String),
    /// A whole tool call.
    Call(ToolCall),
    /// A call to the function that `tool_choice` named opens: its arguments follow as
    /// [`ReplyPart::Arguments`].
    CallOpened(String),
    /// More of the named call's arguments (JSON text as the model writes it).
    Arguments(String),
}

/// How tool calls are found in a reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolMode {
    /// No tools, or `tool_choice: "none"`: everything is text.
    Off,
    /// `tool_choice: "auto"`: calls in the family's syntax, anywhere the syntax allows; with
    /// `parallel` false, the first call only.
    Auto { syntax: ToolSyntax, parallel: bool },
    /// `tool_choice: "required"`: the reply is the JSON array
    /// `[{"name": …, "parameters": {…}}, …]` that the grammar holds it to.
    Required,
    /// `tool_choice` names a function: the reply is that call's arguments object.
    Named(String),
}

/// Text released as it comes, with whitespace at a seam dropped: trailing whitespace is held
/// until more text follows (dropped if a seam comes first), and after a seam leading
/// whitespace is skipped.
#[derive(Debug, Default, Clone)]
pub(super) struct Seams {
    held: String,
    skip_leading: bool,
}

impl Seams {
    /// Releases `text` (less what a seam may still swallow) into `out`.
    pub(super) fn text(&mut self, text: &str, out: &mut String) {
        let text = if self.skip_leading {
            let trimmed = text.trim_start();
            if trimmed.is_empty() {
                return;
            }
            self.skip_leading = false;
            trimmed
        } else {
            text
        };
        let body = text.trim_end();
        if body.is_empty() {
            self.held.push_str(text);
            return;
        }
        out.push_str(&self.held);
        self.held.clear();
        out.push_str(body);
        self.held.push_str(&text[body.len()..]);
    }

    /// A seam: held whitespace is dropped, and the text after it starts at non-whitespace.
    /// Returns the state before it, for [`Self::undo`] when the seam turns out not to be one
    /// (a call that does not parse).
    pub(super) fn seam(&mut self) -> Seams {
        let before = std::mem::take(self);
        self.skip_leading = true;
        before
    }

    /// Puts back the state from before a seam.
    pub(super) fn undo(&mut self, before: Seams) {
        *self = before;
    }

    /// The end: held whitespace is the text's own.
    pub(super) fn finish(&mut self, out: &mut String) {
        out.push_str(&self.held);
        self.held.clear();
    }
}

/// The length of the longest end of `text` that begins `marker` (a marker that may still be
/// arriving), at a character boundary.
pub(super) fn partial_marker(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}
