//! Command-line options, named and defaulted as vLLM's `vllm bench serve` (0.13.0), plus the
//! tandem additions (`--layout`, `--preset`, list-valued sweep options, `book` options,
//! plotting, multi-turn conversations), and their validation into a [`BenchConfig`].

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use serde_json::{Map, Value};

use crate::backends::Backend;
use crate::datasets::{BookOverflow, BookSplit};
use crate::metrics::{GoodputSlos, MetricKind, PeakMethod, parse_goodput};
use crate::report::Layout;

/// `--dataset-name`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DatasetName {
    Random,
    /// vLLM's `prefix_repetition`: shared random prefixes plus per-request random suffixes.
    #[value(name = "prefix_repetition", alias = "prefix-repetition")]
    PrefixRepetition,
    Sharegpt,
    Sonnet,
    Book,
    Custom,
}

/// `--preset`: disaggregation-oriented runs printed under headings as in seed 002.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Preset {
    /// `# Prefill`: random prompts of `--random-input-len`, one output token.
    Prefill,
    /// `# Decode`: one-token prompts, `--random-output-len` output tokens, EOS ignored.
    Decode,
    /// Both, prefill first.
    Pd,
}

/// `--peak-method`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PeakMethodArg {
    /// vLLM 0.11+: one-second buckets.
    Buckets,
    /// Exact sweep-line over request start/end times.
    SweepLine,
}

/// vLLM-compatible serving benchmark. Prints vLLM's "Serving Benchmark Result" block.
#[derive(Debug, Clone, Parser)]
#[command(name = "tandem-bench", version, about)]
pub struct BenchArgs {
    #[command(flatten)]
    pub log: tandem_cli::LogArgs,
    /// API the server speaks.
    #[arg(long, value_enum, default_value = "openai")]
    pub backend: Backend,
    /// Server base URL (overrides --host/--port), e.g. http://127.0.0.1:8000.
    #[arg(long)]
    pub base_url: Option<String>,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// API path appended to the base URL.
    #[arg(long, default_value = "/v1/completions")]
    pub endpoint: String,
    /// Model name; asked from GET /v1/models when omitted.
    #[arg(long)]
    pub model: Option<String>,
    /// Name sent in the `model` field, if it differs from --model.
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// A tokenizer.json, an HF folder, a GGUF file, or `byte-level` (the tokenizer of tandem's
    /// `dummy:` models); defaults to --model as a path.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Label for the result file name and JSON (defaults to the backend).
    #[arg(long)]
    pub label: Option<String>,
    /// Bearer token sent as `Authorization`.
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Extra request header KEY=VALUE (repeatable).
    #[arg(long = "header", value_name = "KEY=VALUE")]
    pub headers: Vec<String>,
    /// JSON object merged into every request body.
    #[arg(long)]
    pub extra_body: Option<String>,
    /// Logprobs to request per token.
    #[arg(long)]
    pub logprobs: Option<u32>,
    /// Sampling temperature (vLLM 0.10–0.14 send 0.0 when omitted).
    #[arg(long)]
    pub temperature: Option<f64>,
    /// Prefix of the `x-request-id` header; the request index is appended.
    #[arg(long, default_value = "benchmark-serving")]
    pub request_id_prefix: String,

    #[arg(long, value_enum, default_value = "random")]
    pub dataset_name: DatasetName,
    /// File for sharegpt, sonnet, custom and book.
    #[arg(long)]
    pub dataset_path: Option<PathBuf>,
    /// Prompts per block; a comma list (`1,2,4` or `1,2,...,4096`) runs one block per value.
    #[arg(long, alias = "num-prompt", default_value = "1000")]
    pub num_prompts: String,
    #[arg(long, default_value_t = 1024)]
    pub random_input_len: usize,
    #[arg(long, default_value_t = 128)]
    pub random_output_len: usize,
    #[arg(long, default_value_t = 0.0)]
    pub random_range_ratio: f64,
    #[arg(long, default_value_t = 0)]
    pub random_prefix_len: usize,
    /// Tokens of each shared prefix (prefix_repetition).
    #[arg(long, default_value_t = 256)]
    pub prefix_repetition_prefix_len: usize,
    /// Tokens of each request's own suffix after its prefix (prefix_repetition).
    #[arg(long, default_value_t = 256)]
    pub prefix_repetition_suffix_len: usize,
    /// Distinct prefixes; --num-prompts is spread evenly over them (prefix_repetition).
    #[arg(long, default_value_t = 10)]
    pub prefix_repetition_num_prefixes: usize,
    /// max_tokens of every request (prefix_repetition).
    #[arg(long, default_value_t = 128)]
    pub prefix_repetition_output_len: usize,
    #[arg(long)]
    pub sharegpt_output_len: Option<usize>,
    #[arg(long, default_value_t = 550)]
    pub sonnet_input_len: usize,
    #[arg(long, default_value_t = 150)]
    pub sonnet_output_len: usize,
    #[arg(long, default_value_t = 200)]
    pub sonnet_prefix_len: usize,
    #[arg(long, default_value_t = 256)]
    pub custom_output_len: usize,
    /// Send custom prompts as they are, without the tokenizer's chat template.
    #[arg(long)]
    pub skip_chat_template: bool,
    /// Tokens per book prompt (a maximum with --book-split lines).
    #[arg(long, default_value_t = 1024)]
    pub book_input_len: usize,
    /// max_tokens of every book request.
    #[arg(long, default_value_t = 256)]
    pub book_output_len: usize,
    #[arg(long, value_enum, default_value = "tokens")]
    pub book_split: BookSplit,
    /// When --num-prompts exceeds the book's prompts: cap the run or wrap around.
    #[arg(long, value_enum, default_value = "cap")]
    pub book_overflow: BookOverflow,
    /// Keep dataset file order (sharegpt, custom).
    #[arg(long)]
    pub disable_shuffle: bool,
    /// Send fewer requests rather than repeat samples when a dataset runs short.
    #[arg(long)]
    pub no_oversample: bool,
    /// Prefill-only and/or decode-only runs printed under `# Prefill` / `# Decode`.
    #[arg(long, value_enum)]
    pub preset: Option<Preset>,

    /// Requests per second ("inf" sends all at once); a comma list sweeps.
    #[arg(long, default_value = "inf")]
    pub request_rate: String,
    /// Gamma shape of inter-arrival times (1 = Poisson).
    #[arg(long, default_value_t = 1.0)]
    pub burstiness: f64,
    /// Cap on requests in flight; a comma list sweeps.
    #[arg(long)]
    pub max_concurrency: Option<String>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Ask the server to ignore EOS (forced for random prompts on OpenAI backends).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Seconds to retry the initial test request; 0 skips it.
    #[arg(long, default_value_t = 600)]
    pub ready_check_timeout_sec: u64,
    /// Warmup requests (copies of sample 0) before the timed run.
    #[arg(long, default_value_t = 0)]
    pub num_warmups: usize,
    /// POST {base}/start_profile and /stop_profile around the run.
    #[arg(long)]
    pub profile: bool,
    /// Multi-turn chat: each sampled prompt opens a conversation of this many turns, run in
    /// sequence; every later turn resends the whole conversation (user messages and the
    /// generated answers) plus a new user message. 0 = off.
    #[arg(long, default_value_t = 0)]
    pub multi_turn_turns: usize,
    /// Tokens of each later user message (random tokens, fixed by --seed) in multi-turn mode.
    #[arg(long, default_value_t = 64)]
    pub multi_turn_user_len: usize,
    /// Multi-turn as an agent: a shared system prompt with tool schemas opens every
    /// conversation and each later turn returns a tool result (`role: "tool"`, of
    /// --multi-turn-user-len tokens) instead of a user message.
    #[arg(long)]
    pub multi_turn_agent: bool,
    /// Agent mode: random tokens of the shared system prompt's instructions.
    #[arg(long, default_value_t = 512)]
    pub agent_system_len: usize,
    /// Agent mode: tool schemas described in the shared system prompt.
    #[arg(long, default_value_t = 4)]
    pub agent_tools: usize,
    /// Agent mode: milliseconds between an answer and the turn with its tool's result (the
    /// tool running; the conversation keeps its --max-concurrency slot).
    #[arg(long, default_value_t = 0)]
    pub agent_think_time_ms: u64,

    /// Sections printed: comma subset of ttft,tpot,itl,e2el.
    #[arg(long, default_value = "ttft,tpot,itl")]
    pub percentile_metrics: String,
    /// Percentiles printed per section, comma-separated.
    #[arg(long, default_value = "99")]
    pub metric_percentiles: String,
    /// SLOs for goodput, KEY:VALUE in ms (ttft, tpot, e2el); `ttft_per_token:MS` adds that
    /// much to each request's TTFT limit per prompt token.
    #[arg(long, num_args = 1..)]
    pub goodput: Vec<String>,
    /// Block layout: new (vLLM ≥ 0.13) or old (legacy script).
    #[arg(long, value_enum, default_value = "new")]
    pub layout: Layout,
    #[arg(long, value_enum, default_value = "buckets")]
    pub peak_method: PeakMethodArg,

    #[arg(long)]
    pub save_result: bool,
    /// Keep per-request lists (input_lens, ttfts, itls, …) in the result JSON.
    #[arg(long)]
    pub save_detailed: bool,
    #[arg(long)]
    pub append_result: bool,
    #[arg(long)]
    pub result_dir: Option<PathBuf>,
    #[arg(long)]
    pub result_filename: Option<String>,
    /// KEY=VALUE pairs added to the result JSON.
    #[arg(long, num_args = 0..)]
    pub metadata: Vec<String>,
    #[arg(long)]
    pub disable_tqdm: bool,
    /// Where a sweep writes its SVG plot (default: in --result-dir or the current folder).
    #[arg(long)]
    pub plot_file: Option<PathBuf>,
    /// Do not write a sweep plot.
    #[arg(long)]
    pub no_plot: bool,
}

/// A configuration error, reported before anything is sent.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

/// The validated settings of a run.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    pub backend: Backend,
    pub base_url: String,
    pub api_url: String,
    pub model: Option<String>,
    pub served_model_name: Option<String>,
    pub tokenizer: Option<PathBuf>,
    pub label: Option<String>,
    pub headers: reqwest::header::HeaderMap,
    pub extra_body: Option<Map<String, Value>>,
    pub logprobs: Option<u32>,
    pub temperature: Option<f64>,
    pub request_id_prefix: String,
    pub dataset_name: DatasetName,
    pub dataset_path: Option<PathBuf>,
    pub preset: Option<Preset>,
    pub num_prompts: Vec<usize>,
    pub request_rates: Vec<f64>,
    pub max_concurrencies: Vec<Option<usize>>,
    pub burstiness: f64,
    pub seed: u64,
    pub ignore_eos: bool,
    pub ready_check_timeout: Duration,
    pub num_warmups: usize,
    pub profile: bool,
    /// `--multi-turn-turns`; 0 is the usual one-request-per-prompt run.
    pub multi_turn_turns: usize,
    /// `--multi-turn-user-len`.
    pub multi_turn_user_len: usize,
    /// `--multi-turn-agent` and its options.
    pub agent: Option<crate::agent::AgentShape>,
    pub percentile_metrics: Vec<MetricKind>,
    pub metric_percentiles: Vec<f64>,
    pub goodput: GoodputSlos,
    pub layout: Layout,
    pub peak_method: PeakMethod,
    pub save_result: bool,
    pub save_detailed: bool,
    pub append_result: bool,
    pub result_dir: Option<PathBuf>,
    pub result_filename: Option<String>,
    pub metadata: Vec<(String, String)>,
    pub show_progress: bool,
    pub plot_file: Option<PathBuf>,
    pub plot: bool,
    pub args: BenchArgs,
}

/// Parses a comma list of numbers, expanding `a,b,...,z` (see [`expand_ellipsis`]).
pub fn parse_count_list(text: &str) -> Result<Vec<usize>, ConfigError> {
    let bad = |item: &str| ConfigError(format!("invalid count '{item}' in '{text}'"));
    let mut values: Vec<usize> = Vec::new();
    let items: Vec<&str> = text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    for (index, item) in items.iter().enumerate() {
        if *item == "..." {
            let end: usize = items
                .get(index + 1)
                .ok_or_else(|| {
                    ConfigError(format!(
                        "'...' must be followed by a last value in '{text}'"
                    ))
                })?
                .parse()
                .map_err(|_| bad(items[index + 1]))?;
            values = expand_ellipsis(&values, end).ok_or_else(|| {
                ConfigError(format!(
                    "cannot continue the sequence before '...' in '{text}'"
                ))
            })?;
            continue;
        }
        if index > 0 && items[index - 1] == "..." {
            continue; // the end value, already added by the expansion
        }
        values.push(item.parse().map_err(|_| bad(item))?);
    }
    if values.is_empty() || values.contains(&0) {
        return Err(ConfigError(format!("counts must be positive: '{text}'")));
    }
    Ok(values)
}

/// Continues `seen` up to `end` inclusive: arithmetic when three or more terms share a step,
/// otherwise geometric when the last two terms have an integer ratio above 1 (so
/// `1,2,...,4096` is the powers of two, as seed 003's `--num-prompt=1,2,...,4096`), otherwise
/// arithmetic with the last step.
pub fn expand_ellipsis(seen: &[usize], end: usize) -> Option<Vec<usize>> {
    let n = seen.len();
    if n < 2 {
        return None;
    }
    let (a, b) = (seen[n - 2], seen[n - 1]);
    let arithmetic_three = n >= 3 && b.checked_sub(a) == a.checked_sub(seen[n - 3]);
    let mut values = seen.to_vec();
    if !arithmetic_three && a > 0 && b > a && b % a == 0 {
        let ratio = b / a;
        let mut next = b.checked_mul(ratio)?;
        while next <= end {
            values.push(next);
            next = next.checked_mul(ratio)?;
        }
    } else {
        let step = b.checked_sub(a).filter(|s| *s > 0)?;
        let mut next = b + step;
        while next <= end {
            values.push(next);
            next += step;
        }
    }
    if values.last() != Some(&end) {
        values.push(end);
    }
    Some(values)
}

fn parse_float_list(text: &str, what: &str) -> Result<Vec<f64>, ConfigError> {
    text.split(',')
        .map(str::trim)
        .map(|item| {
            item.parse::<f64>()
                .map_err(|_| ConfigError(format!("invalid {what} '{item}'")))
        })
        .collect()
}

fn parse_key_value(item: &str, what: &str) -> Result<(String, String), ConfigError> {
    item.split_once('=')
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .ok_or_else(|| {
            ConfigError(format!(
                "Invalid {what} format. Please use KEY=VALUE format."
            ))
        })
}

impl BenchArgs {
    /// Validates the options into a [`BenchConfig`].
    pub fn into_config(self) -> Result<BenchConfig, ConfigError> {
        let base_url = self
            .base_url
            .clone()
            .unwrap_or_else(|| format!("http://{}:{}", self.host, self.port))
            .trim_end_matches('/')
            .to_string();
        let api_url = format!("{base_url}{}", self.endpoint);
        self.backend.validate_url(&api_url).map_err(ConfigError)?;

        let mut headers = reqwest::header::HeaderMap::new();
        if let Some(key) = &self.api_key {
            let value = format!("Bearer {key}")
                .parse()
                .map_err(|_| ConfigError("API key is not a valid header value".into()))?;
            headers.insert(reqwest::header::AUTHORIZATION, value);
        }
        for item in &self.headers {
            let (key, value) = parse_key_value(item, "header")?;
            let name: reqwest::header::HeaderName = key
                .parse()
                .map_err(|_| ConfigError(format!("invalid header name '{key}'")))?;
            let value = value
                .parse()
                .map_err(|_| ConfigError(format!("invalid value for header '{key}'")))?;
            headers.insert(name, value);
        }
        let extra_body = match &self.extra_body {
            None => None,
            Some(text) => match serde_json::from_str::<Value>(text) {
                Ok(Value::Object(map)) => Some(map),
                _ => return Err(ConfigError("--extra-body must be a JSON object".into())),
            },
        };

        if !matches!(
            self.dataset_name,
            DatasetName::Random | DatasetName::PrefixRepetition
        ) && self.preset.is_none()
            && self.dataset_path.is_none()
        {
            return Err(ConfigError(
                format!(
                    "--dataset-path is required for --dataset-name {:?}",
                    self.dataset_name
                )
                .to_lowercase(),
            ));
        }
        let num_prompts = parse_count_list(&self.num_prompts)?;
        let request_rates = parse_float_list(&self.request_rate, "request rate")?;
        if request_rates.iter().any(|r| r.is_nan() || *r <= 0.0) {
            return Err(ConfigError("--request-rate must be positive".into()));
        }
        let max_concurrencies: Vec<Option<usize>> = match &self.max_concurrency {
            None => vec![None],
            Some(text) => parse_count_list(text)?.into_iter().map(Some).collect(),
        };
        let swept = [
            num_prompts.len(),
            request_rates.len(),
            max_concurrencies.len(),
        ]
        .iter()
        .filter(|n| **n > 1)
        .count();
        if swept > 1 {
            return Err(ConfigError(
                "only one of --num-prompts, --request-rate, --max-concurrency may be a list".into(),
            ));
        }
        if self.multi_turn_turns > 0 && self.preset.is_some() {
            return Err(ConfigError(
                "--multi-turn-turns cannot be combined with --preset".into(),
            ));
        }
        if self.multi_turn_agent && self.multi_turn_turns == 0 {
            return Err(ConfigError(
                "--multi-turn-agent needs --multi-turn-turns".into(),
            ));
        }
        if self.multi_turn_turns > 1 && self.multi_turn_user_len == 0 {
            return Err(ConfigError(
                "--multi-turn-user-len must be at least 1 with more than one turn".into(),
            ));
        }
        if self.burstiness.is_nan() || self.burstiness <= 0.0 {
            return Err(ConfigError(format!(
                "A positive burstiness factor is expected, but given {}.",
                self.burstiness
            )));
        }

        let mut percentile_metrics = Vec::new();
        for key in self.percentile_metrics.split(',').map(str::trim) {
            let kind = MetricKind::from_key(key).ok_or_else(|| {
                ConfigError(format!("unknown metric '{key}' in --percentile-metrics"))
            })?;
            if !percentile_metrics.contains(&kind) {
                percentile_metrics.push(kind);
            }
        }
        let metric_percentiles = parse_float_list(&self.metric_percentiles, "percentile")?;
        if metric_percentiles
            .iter()
            .any(|p| !(0.0..=100.0).contains(p))
        {
            return Err(ConfigError("percentiles must be within [0, 100]".into()));
        }
        let goodput = parse_goodput(&self.goodput).map_err(ConfigError)?;
        let metadata = self
            .metadata
            .iter()
            .map(|item| parse_key_value(item, "metadata"))
            .collect::<Result<Vec<_>, _>>()?;

        Ok(BenchConfig {
            backend: self.backend,
            base_url,
            api_url,
            model: self.model.clone(),
            served_model_name: self.served_model_name.clone(),
            tokenizer: self.tokenizer.clone(),
            label: self.label.clone(),
            headers,
            extra_body,
            logprobs: self.logprobs,
            temperature: self.temperature,
            request_id_prefix: self.request_id_prefix.clone(),
            dataset_name: self.dataset_name,
            dataset_path: self.dataset_path.clone(),
            preset: self.preset,
            num_prompts,
            request_rates,
            max_concurrencies,
            burstiness: self.burstiness,
            seed: self.seed,
            ignore_eos: self.ignore_eos,
            ready_check_timeout: Duration::from_secs(self.ready_check_timeout_sec),
            num_warmups: self.num_warmups,
            profile: self.profile,
            multi_turn_turns: self.multi_turn_turns,
            multi_turn_user_len: self.multi_turn_user_len,
            agent: self.multi_turn_agent.then(|| crate::agent::AgentShape {
                system_len: self.agent_system_len,
                tools: self.agent_tools,
                think_time: Duration::from_millis(self.agent_think_time_ms),
            }),
            percentile_metrics,
            metric_percentiles,
            goodput,
            layout: self.layout,
            peak_method: match self.peak_method {
                PeakMethodArg::Buckets => PeakMethod::Buckets,
                PeakMethodArg::SweepLine => PeakMethod::SweepLine,
            },
            save_result: self.save_result,
            save_detailed: self.save_detailed,
            append_result: self.append_result,
            result_dir: self.result_dir.clone(),
            result_filename: self.result_filename.clone(),
            metadata,
            show_progress: !self.disable_tqdm,
            plot_file: self.plot_file.clone(),
            plot: !self.no_plot,
            args: self,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn count_lists_and_ellipses() {
        assert_eq!(parse_count_list("1000").unwrap(), vec![1000]);
        assert_eq!(parse_count_list("1, 2,4").unwrap(), vec![1, 2, 4]);
        let powers: Vec<usize> = (0..13).map(|k| 1 << k).collect();
        assert_eq!(parse_count_list("1,2,...,4096").unwrap(), powers);
        assert_eq!(
            parse_count_list("1,2,4,...,2048").unwrap(),
            powers[..12].to_vec()
        );
        assert_eq!(
            parse_count_list("10,20,30,...,60").unwrap(),
            vec![10, 20, 30, 40, 50, 60]
        );
        assert_eq!(
            parse_count_list("3,5,...,10").unwrap(),
            vec![3, 5, 7, 9, 10]
        );
        assert!(parse_count_list("1,...").is_err());
        assert!(parse_count_list("0").is_err());
        assert!(parse_count_list("x").is_err());
    }

    fn args(extra: &[&str]) -> BenchArgs {
        let mut argv = vec!["tandem-bench", "--model", "m"];
        argv.extend_from_slice(extra);
        BenchArgs::parse_from(argv)
    }

    #[test]
    fn defaults_follow_vllm() {
        let config = args(&[]).into_config().unwrap();
        assert_eq!(config.api_url, "http://127.0.0.1:8000/v1/completions");
        assert_eq!(config.num_prompts, vec![1000]);
        assert!(config.request_rates[0].is_infinite());
        assert_eq!(config.max_concurrencies, vec![None]);
        assert_eq!(
            config.percentile_metrics,
            vec![MetricKind::Ttft, MetricKind::Tpot, MetricKind::Itl]
        );
        assert_eq!(config.metric_percentiles, vec![99.0]);
        assert_eq!(config.ready_check_timeout, Duration::from_secs(600));
        assert_eq!(config.layout, Layout::New);
    }

    #[test]
    fn validation_refuses_bad_combinations() {
        assert!(args(&["--backend", "openai-chat"]).into_config().is_err());
        assert!(
            args(&[
                "--backend",
                "openai-chat",
                "--endpoint",
                "/v1/chat/completions"
            ])
            .into_config()
            .is_ok()
        );
        assert!(
            args(&["--backend", "tgi", "--endpoint", "/generate_stream"])
                .into_config()
                .is_ok()
        );
        assert!(args(&["--dataset-name", "book"]).into_config().is_err());
        assert!(
            args(&["--num-prompts", "1,2", "--request-rate", "1,2"])
                .into_config()
                .is_err()
        );
        assert!(
            args(&["--percentile-metrics", "ttft,foo"])
                .into_config()
                .is_err()
        );
        assert!(args(&["--goodput", "ttft:x"]).into_config().is_err());
        assert!(args(&["--metadata", "novalue"]).into_config().is_err());
        assert!(args(&["--extra-body", "[1]"]).into_config().is_err());
        assert!(args(&["--burstiness", "0"]).into_config().is_err());
        let config = args(&["--num-prompt=1,2,...,8", "--goodput", "ttft:300", "tpot:50"])
            .into_config()
            .unwrap();
        assert_eq!(config.num_prompts, vec![1, 2, 4, 8]);
        assert_eq!(config.goodput.limit(MetricKind::Tpot, 1), Some(50.0));
    }

    #[test]
    fn prefix_repetition_and_multi_turn_options() {
        let config = args(&["--dataset-name", "prefix_repetition"])
            .into_config()
            .unwrap();
        assert_eq!(config.dataset_name, DatasetName::PrefixRepetition);
        assert_eq!(config.args.prefix_repetition_prefix_len, 256);
        assert_eq!(config.args.prefix_repetition_suffix_len, 256);
        assert_eq!(config.args.prefix_repetition_num_prefixes, 10);
        assert_eq!(config.args.prefix_repetition_output_len, 128);
        assert_eq!(config.multi_turn_turns, 0);
        assert_eq!(config.multi_turn_user_len, 64);
        let config = args(&[
            "--dataset-name",
            "prefix-repetition",
            "--multi-turn-turns",
            "3",
            "--multi-turn-user-len",
            "8",
        ])
        .into_config()
        .unwrap();
        assert_eq!(config.dataset_name, DatasetName::PrefixRepetition);
        assert_eq!(
            (config.multi_turn_turns, config.multi_turn_user_len),
            (3, 8)
        );
        assert!(
            args(&["--multi-turn-turns", "2", "--preset", "pd"])
                .into_config()
                .is_err()
        );
        assert!(
            args(&["--multi-turn-turns", "2", "--multi-turn-user-len", "0"])
                .into_config()
                .is_err()
        );
    }
}
