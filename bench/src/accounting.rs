//! Server-reported accounting beyond vLLM's `completion_tokens`: `usage.prompt_tokens`,
//! OpenAI's `usage.prompt_tokens_details.cached_tokens`, and the `tandem` object tandem's
//! router adds (`mode`, `kv_bytes`, `transport`, `fallback_reason`, `cached_tokens`,
//! `kv_blocks`, `prefill_pulled_tokens`), read from a stream's chunks into [`RequestOutput`].
//!
//! Every field is optional and read leniently, as JSON values: other servers send none of
//! it, and one sending it in an unexpected shape must not fail requests that vLLM would
//! count as successful.

use serde::Deserialize;
use serde_json::Value;

use crate::metrics::{RequestOutput, TandemRun};

/// The accounting fields of an OpenAI `usage` object (flattened into the backend's usage).
#[derive(Debug, Default, Deserialize)]
pub(crate) struct UsageExtras {
    #[serde(default)]
    prompt_tokens: Option<Value>,
    #[serde(default)]
    prompt_tokens_details: Option<Value>,
    #[serde(default)]
    tandem: Option<Value>,
}

/// Server-reported accounting of one request, beyond `completion_tokens`.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Accounting {
    prompt_tokens: Option<usize>,
    /// `prompt_tokens_details.cached_tokens` (the OpenAI field, preferred).
    openai_cached: Option<usize>,
    /// `tandem.cached_tokens`.
    tandem_cached: Option<usize>,
    kv_bytes: Option<u64>,
    kv_blocks: Option<u64>,
    pulled_tokens: Option<u64>,
    tandem: Option<TandemRun>,
}

impl Accounting {
    pub(crate) fn read_usage(&mut self, usage: &UsageExtras) {
        if let Some(n) = usage.prompt_tokens.as_ref().and_then(as_count) {
            self.prompt_tokens = Some(n);
        }
        if let Some(n) = usage
            .prompt_tokens_details
            .as_ref()
            .and_then(|d| d.get("cached_tokens"))
            .and_then(as_count)
        {
            self.openai_cached = Some(n);
        }
        if let Some(tandem) = &usage.tandem {
            self.read_tandem(tandem);
        }
    }

    pub(crate) fn read_tandem(&mut self, tandem: &Value) {
        let Some(object) = tandem.as_object() else {
            return;
        };
        let number = |key: &str| object.get(key).and_then(Value::as_u64);
        let text = |key: &str| object.get(key).and_then(Value::as_str).map(str::to_string);
        if let Some(n) = number("cached_tokens") {
            self.tandem_cached = usize::try_from(n).ok();
        }
        if let Some(n) = number("kv_bytes") {
            self.kv_bytes = Some(n);
        }
        if let Some(n) = number("kv_blocks") {
            self.kv_blocks = Some(n);
        }
        if let Some(n) = number("prefill_pulled_tokens") {
            self.pulled_tokens = Some(n);
        }
        self.tandem = Some(TandemRun {
            mode: text("mode"),
            transport: text("transport"),
            fallback_reason: text("fallback_reason"),
        });
    }

    pub(crate) fn write_to(self, output: &mut RequestOutput) {
        output.server_prompt_tokens = self.prompt_tokens;
        output.cached_tokens = self.openai_cached.or(self.tandem_cached);
        output.kv_bytes = self.kv_bytes;
        output.kv_blocks = self.kv_blocks;
        output.pulled_tokens = self.pulled_tokens;
        output.tandem = self.tandem;
    }
}

fn as_count(value: &Value) -> Option<usize> {
    value.as_u64().and_then(|n| usize::try_from(n).ok())
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use crate::backends::{Backend, StreamState};
    use crate::metrics::RequestOutput;

    #[test]
    fn usage_accounting_of_tandem_and_openai_servers() {
        let t0 = Instant::now();
        let run = |messages: &[&str]| {
            let mut state = StreamState::new(Backend::Openai, t0);
            for m in messages {
                state.on_message(m, t0).unwrap();
            }
            let mut out = RequestOutput::default();
            state.finish(&mut out);
            out
        };
        let token = r#"data: {"choices":[{"text":"a"}]}"#;
        let out = run(&[
            token,
            r#"data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":3},"tandem":{"mode":"disaggregated","kv_bytes":4096,"transport":"shm","fallback_reason":null,"cached_tokens":3,"kv_blocks":2,"prefill_pulled_tokens":1}}}"#,
        ]);
        assert!(out.success);
        assert_eq!(out.output_tokens, Some(2));
        assert_eq!(out.server_prompt_tokens, Some(5));
        assert_eq!(out.cached_tokens, Some(3));
        assert_eq!(out.kv_bytes, Some(4096));
        assert_eq!(out.kv_blocks, Some(2));
        assert_eq!(out.pulled_tokens, Some(1));
        let tandem = out.tandem.unwrap();
        assert_eq!(tandem.mode.as_deref(), Some("disaggregated"));
        assert_eq!(tandem.transport.as_deref(), Some("shm"));
        assert_eq!(tandem.fallback_reason, None);
        // Another server: usage without any extras.
        let out = run(&[
            token,
            r#"data: {"choices":[],"usage":{"completion_tokens":1}}"#,
        ]);
        assert!(out.success);
        assert_eq!(
            (out.server_prompt_tokens, out.cached_tokens, out.kv_bytes),
            (None, None, None)
        );
        assert!(out.tandem.is_none() && out.kv_blocks.is_none());
        // Only tandem's count, on a finish chunk, and odd shapes that are ignored, not fatal.
        let out = run(&[
            r#"data: {"choices":[{"text":""}],"tandem":{"mode":"aggregated","kv_bytes":0,"transport":null,"fallback_reason":"no_prefill_worker","cached_tokens":7}}"#,
            r#"data: {"choices":[],"usage":{"prompt_tokens":"x","prompt_tokens_details":null,"tandem":[1]}}"#,
        ]);
        assert!(out.success);
        assert_eq!(out.cached_tokens, Some(7));
        assert_eq!(out.kv_bytes, Some(0));
        assert_eq!(out.server_prompt_tokens, None);
        assert_eq!(
            out.tandem.unwrap().fallback_reason.as_deref(),
            Some("no_prefill_worker")
        );
    }
}
