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
    use super::*;

    fn usage(json: &str) -> UsageExtras {
        serde_json::from_str(json).unwrap()
    }

    fn written(accounting: Accounting) -> RequestOutput {
        let mut out = RequestOutput::default();
        accounting.write_to(&mut out);
        out
    }

    #[test]
    fn openai_usage_and_the_tandem_object() {
        let mut a = Accounting::default();
        a.read_usage(&usage(
            r#"{"prompt_tokens":5,"prompt_tokens_details":{"cached_tokens":3},"tandem":{"mode":"disaggregated","kv_bytes":4096,"transport":"shm","fallback_reason":null,"cached_tokens":4,"kv_blocks":2,"prefill_pulled_tokens":1}}"#,
        ));
        let out = written(a);
        assert_eq!(out.server_prompt_tokens, Some(5));
        assert_eq!(out.cached_tokens, Some(3), "OpenAI's count is preferred");
        assert_eq!(
            (out.kv_bytes, out.kv_blocks, out.pulled_tokens),
            (Some(4096), Some(2), Some(1))
        );
        let tandem = out.tandem.unwrap();
        assert_eq!(tandem.mode.as_deref(), Some("disaggregated"));
        assert_eq!(tandem.transport.as_deref(), Some("shm"));
        assert_eq!(tandem.fallback_reason, None);
    }

    #[test]
    fn missing_or_odd_fields_are_absent_not_errors() {
        let out = written(Accounting::default());
        assert_eq!(
            (out.server_prompt_tokens, out.cached_tokens, out.kv_bytes),
            (None, None, None)
        );
        assert!(out.tandem.is_none() && out.kv_blocks.is_none());
        let mut a = Accounting::default();
        a.read_tandem(
            &serde_json::json!({"mode":"aggregated","cached_tokens":7,"kv_bytes":0,
            "fallback_reason":"no_prefill_worker"}),
        );
        a.read_usage(&usage(
            r#"{"prompt_tokens":"x","prompt_tokens_details":null,"tandem":[1]}"#,
        ));
        let out = written(a);
        assert_eq!(
            out.cached_tokens,
            Some(7),
            "tandem's count when OpenAI's is absent"
        );
        assert_eq!(out.kv_bytes, Some(0));
        assert_eq!(out.server_prompt_tokens, None);
        assert_eq!(
            out.tandem.unwrap().fallback_reason.as_deref(),
            Some("no_prefill_worker")
        );
    }
}
