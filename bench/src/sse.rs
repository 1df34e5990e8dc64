//! Reading a streamed response body: [`SseSplitter`] cuts an OpenAI server-sent-event stream
//! into messages as vLLM's client does, [`LineSplitter`] cuts a TGI stream into lines.

/// Splits an OpenAI SSE byte stream into messages as vLLM 0.11+'s `StreamedResponseHandler`:
/// on blank lines, plus a trailing `data: …` message once it is complete JSON or `[DONE]`.
#[derive(Debug, Default)]
pub struct SseSplitter {
    buffer: Vec<u8>,
}

impl SseSplitter {
    /// Feeds one network read; appends every complete message (trimmed, non-empty).
    pub fn push(&mut self, chunk: &[u8], messages: &mut Vec<String>) {
        // CRLF line endings (allowed by SSE) are folded so one separator rule applies.
        self.buffer
            .extend(chunk.iter().copied().filter(|&b| b != b'\r'));
        let mut start = 0;
        while let Some(offset) = find_blank_line(&self.buffer[start..]) {
            push_trimmed(&self.buffer[start..start + offset], messages);
            start += offset + 2;
        }
        self.buffer.drain(..start);
        let rest = trim_ascii(&self.buffer);
        if let Some(content) = rest.strip_prefix(b"data:") {
            let content = trim_ascii(content);
            let complete = content == b"[DONE]"
                || (!content.is_empty() && serde_json::from_slice::<IgnoredAny>(content).is_ok());
            if complete {
                push_trimmed(&self.buffer, messages);
                self.buffer.clear();
            }
        }
    }

    /// Whatever is left when the stream ends (vLLM drops it; we hand it over for completeness).
    pub fn finish(&mut self, messages: &mut Vec<String>) {
        push_trimmed(&self.buffer, messages);
        self.buffer.clear();
    }
}

type IgnoredAny = serde::de::IgnoredAny;

fn find_blank_line(bytes: &[u8]) -> Option<usize> {
    bytes.windows(2).position(|w| w == b"\n\n")
}

fn trim_ascii(bytes: &[u8]) -> &[u8] {
    bytes.trim_ascii()
}

fn push_trimmed(bytes: &[u8], messages: &mut Vec<String>) {
    let trimmed = trim_ascii(bytes);
    if !trimmed.is_empty() {
        messages.push(String::from_utf8_lossy(trimmed).into_owned());
    }
}

/// Splits a byte stream into lines (TGI is read line by line, as aiohttp's `content`).
#[derive(Debug, Default)]
pub struct LineSplitter {
    buffer: Vec<u8>,
}

impl LineSplitter {
    pub fn push(&mut self, chunk: &[u8], lines: &mut Vec<String>) {
        self.buffer.extend_from_slice(chunk);
        let mut start = 0;
        while let Some(offset) = self.buffer[start..].iter().position(|&b| b == b'\n') {
            push_trimmed(&self.buffer[start..start + offset], lines);
            start += offset + 1;
        }
        self.buffer.drain(..start);
    }

    pub fn finish(&mut self, lines: &mut Vec<String>) {
        push_trimmed(&self.buffer, lines);
        self.buffer.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split_all(chunks: &[&str]) -> Vec<String> {
        let mut splitter = SseSplitter::default();
        let mut out = Vec::new();
        for chunk in chunks {
            splitter.push(chunk.as_bytes(), &mut out);
        }
        out
    }

    #[test]
    fn sse_messages_split_on_blank_lines_across_reads() {
        let out = split_all(&[
            "data: {\"a\":1}\n\nda",
            "ta: {\"b\"",
            ":2}\n\n: ping\n\ndata: [DONE]",
        ]);
        assert_eq!(
            out,
            vec![
                "data: {\"a\":1}",
                "data: {\"b\":2}",
                ": ping",
                "data: [DONE]"
            ]
        );
        // A complete trailing JSON message is taken without its separator; a partial one waits.
        assert_eq!(split_all(&["data: {\"a\":1}"]), vec!["data: {\"a\":1}"]);
        assert!(split_all(&["data: {\"a\":"]).is_empty());
        assert_eq!(
            split_all(&["data: {\"a\":1}\r\n\r\n"]),
            vec!["data: {\"a\":1}"]
        );
    }
}
