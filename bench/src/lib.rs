//! tandem-bench: a faithful Rust port of vLLM's serving benchmark (`vllm bench serve` 0.13.0
//! and the legacy `benchmark_serving.py`), per `shared/bench-spec.md`.
//!
//! It owns the whole client side: datasets, arrival times, streamed requests to any server
//! speaking the OpenAI completions/chat or TGI `generate_stream` APIs, vLLM's metric math,
//! the byte-exact "Serving Benchmark Result" block, result JSON, sweeps and plots, and two
//! tandem additions: the server's cache/KV-transfer accounting in the result JSON and a
//! multi-turn chat mode. It speaks
//! HTTP only and links no serving code (of tandem it uses `tandem-text` for tokenizers and
//! `tandem-cli` for the shared logging flag), so it can measure vLLM, TGI or llama.cpp.
//!
//! Output discipline: stdout carries headings, blocks and sweep summaries only; the progress
//! bar and vLLM's informational lines go to stderr, logs go through `tracing` (stderr).

pub mod accounting;
pub mod agent;
pub mod backends;
pub mod cli;
pub mod datasets;
pub mod fake_server;
pub mod metrics;
pub mod multi_turn;
pub mod progress;
pub mod report;
pub mod runner;
pub mod sse;
pub mod sweep;
pub mod tokenizer;

use std::io::Write;
use std::path::PathBuf;

use crate::backends::{Backend, RequestInput, Target};
use crate::cli::{BenchConfig, ConfigError, DatasetName, Preset};
use crate::datasets::{
    BookConfig, DatasetConfig, DatasetError, PrefixRepetitionConfig, RandomConfig, SamplingOptions,
};
use crate::metrics::{BenchmarkMetrics, MetricsOptions, calculate_metrics};
use crate::report::{BlockOptions, ResultHeader};
use crate::runner::{RunError, TrafficSettings};
use crate::sweep::{SweepAxis, SweepPoint};
use crate::tokenizer::{BenchTokenizer, TokenizerError};

/// Everything that can stop a benchmark.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    #[error(transparent)]
    Run(#[from] RunError),
    #[error("cannot build the HTTP client: {0}")]
    Client(String),
    #[error("no --model given and {url} did not name one: {message}")]
    ModelDiscovery { url: String, message: String },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Plot(#[from] sweep::PlotError),
}

/// One printed block and what it measured.
#[derive(Debug, Clone)]
pub struct BlockResult {
    /// `Some("Prefill")`/`Some("Decode")` under a preset.
    pub heading: Option<&'static str>,
    pub num_prompts: usize,
    pub request_rate: f64,
    pub max_concurrency: Option<usize>,
    pub duration: f64,
    pub metrics: BenchmarkMetrics,
    /// The block text exactly as printed.
    pub block: String,
    /// Multi-turn mode: the per-turn means printed after the block.
    pub multi_turn: Option<multi_turn::TurnSummary>,
    /// The result JSON file written for this block, if any.
    pub result_file: Option<PathBuf>,
}

/// The outcome of [`run`].
#[derive(Debug, Clone, Default)]
pub struct RunSummary {
    pub blocks: Vec<BlockResult>,
    /// Sweep plots written (one per preset phase).
    pub plot_files: Vec<PathBuf>,
}

/// A phase of a run: a dataset under an optional heading.
struct Phase {
    heading: Option<&'static str>,
    dataset: DatasetConfig,
    ignore_eos: bool,
}

/// Runs the configured benchmark: every phase, every sweep value, one block each, written to
/// `out`; vLLM's informational lines go to `log`.
pub async fn run(
    config: &BenchConfig,
    out: &mut (dyn Write + Send),
    log: &mut (dyn Write + Send),
) -> Result<RunSummary, BenchError> {
    let _ = writeln!(log, "{:?}", redacted(&config.args));
    let tokenizer_path = config
        .tokenizer
        .clone()
        .or_else(|| config.model.as_ref().map(PathBuf::from))
        .ok_or_else(|| {
            ConfigError("--tokenizer is required (no --model path to fall back on)".into())
        })?;
    let tokenizer = tokenizer::load_tokenizer(&tokenizer_path)?;
    let client = build_client(config)?;
    let model = match &config.model {
        Some(model) => model.clone(),
        None => discover_model(&client, config).await?,
    };
    let target = Target {
        backend: config.backend,
        url: config.api_url.clone(),
        headers: config.headers.clone(),
    };
    let phases = phases(config, &tokenizer)?;
    let turns = config.multi_turn_turns;
    let count_tokens: multi_turn::TokenCounter = {
        let tokenizer = tokenizer.clone();
        std::sync::Arc::new(move |text: &str| tokenizer.count(text, false).unwrap_or(0))
    };
    let (axis, values) = sweep_values(config);
    let date = report::timestamp(std::time::SystemTime::now());
    let mut summary = RunSummary::default();
    let mut points = Vec::new();
    let mut first_output = true;
    for phase in &phases {
        if let Some(heading) = phase.heading {
            let separator = if first_output { "" } else { "\n\n" };
            write_out(out, &format!("{separator}# {heading}\n\n"))?;
            first_output = true;
        }
        for value in &values {
            let (num_prompts, request_rate, max_concurrency) = value.resolve(config);
            let samples = datasets::sample(
                &phase.dataset,
                &tokenizer,
                num_prompts,
                SamplingOptions {
                    seed: config.seed,
                    shuffle: !config.args.disable_shuffle,
                    oversample: !config.args.no_oversample,
                },
            )?;
            let inputs = request_inputs(config, &model, phase.ignore_eos, samples);
            let settings = TrafficSettings {
                request_rate,
                burstiness: config.burstiness,
                max_concurrency,
                seed: config.seed,
                show_progress: config.show_progress,
                ready_check_timeout: config.ready_check_timeout,
                num_warmups: config.num_warmups,
                profile_base_url: config.profile.then(|| config.base_url.clone()),
            };
            let outcome = if turns > 0 {
                let conversations = multi_turn::plan(
                    inputs,
                    &tokenizer,
                    turns,
                    config.multi_turn_user_len,
                    config.seed,
                    config.agent.as_ref(),
                )?;
                multi_turn::run_conversations(
                    &client,
                    &target,
                    conversations,
                    turns,
                    count_tokens.clone(),
                    &settings,
                    log,
                )
                .await?
            } else {
                runner::run_block(&client, &target, inputs, &settings, log).await?
            };
            let count_tokens = |text: &str| tokenizer.count(text, false).unwrap_or(0);
            let (metrics, output_lens) = calculate_metrics(
                &outcome.outputs,
                &count_tokens,
                &MetricsOptions {
                    duration: outcome.duration,
                    percentiles: &config.metric_percentiles,
                    goodput: &config.goodput,
                    peak_method: config.peak_method,
                },
            );
            let block = report::format_block(
                &metrics,
                outcome.duration,
                &BlockOptions {
                    layout: config.layout,
                    max_concurrency,
                    request_rate,
                    goodput: !config.goodput.is_empty(),
                    percentile_metrics: config.percentile_metrics.clone(),
                },
            );
            let separator = if first_output { "" } else { "\n" };
            write_out(out, &format!("{separator}{block}"))?;
            first_output = false;
            let turn_summary =
                (turns > 0).then(|| multi_turn::TurnSummary::new(&outcome.outputs, turns));
            if let Some(summary) = &turn_summary {
                write_out(out, &format!("\n{}", summary.table()))?;
            }
            let result_file = if config.save_result {
                let header = ResultHeader {
                    date: date.clone(),
                    backend: config.backend.name().to_string(),
                    label: config.label.clone(),
                    model_id: model.clone(),
                    tokenizer_id: tokenizer_path.display().to_string(),
                    num_prompts,
                    metadata: config.metadata.clone(),
                    request_rate,
                    burstiness: config.burstiness,
                    max_concurrency,
                };
                let mut json = report::result_json(
                    &header,
                    &metrics,
                    outcome.duration,
                    &outcome.outputs,
                    &output_lens,
                    &config.percentile_metrics,
                    config.save_detailed,
                );
                if let (Some(summary), Some(map)) = (&turn_summary, json.as_object_mut()) {
                    map.insert("multi_turn".into(), summary.to_json());
                }
                let suffix = block_suffix(phase.heading, axis, value, phases.len(), values.len());
                let append =
                    config.append_result || summary.blocks.iter().any(|b| b.result_file.is_some());
                Some(save_result(config, &header, &json, &suffix, append)?)
            } else {
                None
            };
            if let Some(axis_value) = value.axis_value() {
                points.push((
                    phase.heading,
                    SweepPoint {
                        value: axis_value,
                        duration: outcome.duration,
                        metrics: metrics.clone(),
                    },
                ));
            }
            summary.blocks.push(BlockResult {
                heading: phase.heading,
                num_prompts,
                request_rate,
                max_concurrency,
                duration: outcome.duration,
                metrics,
                block,
                multi_turn: turn_summary,
                result_file,
            });
        }
    }
    if let Some(axis) = axis {
        summary.plot_files = finish_sweep(config, axis, &points, &date, out)?;
    }
    Ok(summary)
}

/// The options as vLLM prints its namespace, with secrets left out of the log.
fn redacted(args: &cli::BenchArgs) -> cli::BenchArgs {
    let mut args = args.clone();
    if args.api_key.is_some() {
        args.api_key = Some("<redacted>".into());
    }
    for header in &mut args.headers {
        if let Some((name, _)) = header.split_once('=') {
            *header = format!("{name}=<redacted>");
        }
    }
    args
}

fn write_out(out: &mut (dyn Write + Send), text: &str) -> Result<(), BenchError> {
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|source| BenchError::Write {
            path: PathBuf::from("<stdout>"),
            source,
        })
}

fn build_client(config: &BenchConfig) -> Result<reqwest::Client, BenchError> {
    let pool = config
        .max_concurrencies
        .iter()
        .copied()
        .max()
        .flatten()
        .unwrap_or(usize::MAX);
    reqwest::Client::builder()
        .pool_max_idle_per_host(pool)
        .tcp_nodelay(true)
        // vLLM's aiohttp timeout is six hours: long prompts may legitimately take minutes.
        .timeout(std::time::Duration::from_secs(6 * 3600))
        .build()
        .map_err(|e| BenchError::Client(e.to_string()))
}

/// vLLM 0.13 asks the server for its model when `--model` is omitted.
async fn discover_model(
    client: &reqwest::Client,
    config: &BenchConfig,
) -> Result<String, BenchError> {
    let url = format!("{}/v1/models", config.base_url);
    let failure = |message: String| BenchError::ModelDiscovery {
        url: url.clone(),
        message,
    };
    let response = client
        .get(&url)
        .headers(config.headers.clone())
        .send()
        .await
        .map_err(|e| failure(e.to_string()))?;
    let body: serde_json::Value = response.json().await.map_err(|e| failure(e.to_string()))?;
    body.pointer("/data/0/id")
        .and_then(|id| id.as_str())
        .map(str::to_string)
        .ok_or_else(|| failure("no data[0].id in the answer".into()))
}

fn phases(config: &BenchConfig, tokenizer: &BenchTokenizer) -> Result<Vec<Phase>, BenchError> {
    let random = RandomConfig {
        input_len: config.args.random_input_len,
        output_len: config.args.random_output_len,
        range_ratio: config.args.random_range_ratio,
        prefix_len: config.args.random_prefix_len,
    };
    let prefill = Phase {
        heading: Some("Prefill"),
        dataset: DatasetConfig::Random(RandomConfig {
            output_len: 1,
            ..random
        }),
        ignore_eos: config.ignore_eos || config.backend.is_openai(),
    };
    // One real token after whatever the tokenizer adds (BOS): a one-token prompt.
    let decode = Phase {
        heading: Some("Decode"),
        dataset: DatasetConfig::Random(RandomConfig {
            input_len: tokenizer.num_special_tokens() + 1,
            output_len: config.args.random_output_len,
            range_ratio: 0.0,
            prefix_len: 0,
        }),
        ignore_eos: true,
    };
    let phases = match config.preset {
        Some(Preset::Prefill) => vec![prefill],
        Some(Preset::Decode) => vec![decode],
        Some(Preset::Pd) => vec![prefill, decode],
        None => vec![Phase {
            heading: None,
            ignore_eos: config.ignore_eos
                || (config.dataset_name == DatasetName::Random && config.backend.is_openai()),
            dataset: dataset_config(config, random)?,
        }],
    };
    Ok(phases)
}

fn dataset_config(config: &BenchConfig, random: RandomConfig) -> Result<DatasetConfig, BenchError> {
    let args = &config.args;
    let path = || {
        config
            .dataset_path
            .clone()
            .ok_or_else(|| ConfigError("--dataset-path is required for this dataset".into()))
    };
    Ok(match config.dataset_name {
        DatasetName::Random => DatasetConfig::Random(random),
        DatasetName::PrefixRepetition => DatasetConfig::PrefixRepetition(PrefixRepetitionConfig {
            prefix_len: args.prefix_repetition_prefix_len,
            suffix_len: args.prefix_repetition_suffix_len,
            num_prefixes: args.prefix_repetition_num_prefixes,
            output_len: args.prefix_repetition_output_len,
        }),
        DatasetName::Sharegpt => DatasetConfig::ShareGpt {
            path: path()?,
            output_len: args.sharegpt_output_len,
        },
        DatasetName::Sonnet => DatasetConfig::Sonnet {
            path: path()?,
            input_len: args.sonnet_input_len,
            output_len: args.sonnet_output_len,
            prefix_len: args.sonnet_prefix_len,
            send_formatted: config.backend != Backend::OpenaiChat,
        },
        DatasetName::Custom => DatasetConfig::Custom {
            path: path()?,
            output_len: args.custom_output_len,
            chat_template: !args.skip_chat_template,
        },
        DatasetName::Book => DatasetConfig::Book(BookConfig {
            path: path()?,
            input_len: args.book_input_len,
            output_len: args.book_output_len,
            split: args.book_split,
            overflow: args.book_overflow,
        }),
    })
}

fn request_inputs(
    config: &BenchConfig,
    model: &str,
    ignore_eos: bool,
    samples: Vec<datasets::SampleRequest>,
) -> Vec<RequestInput> {
    let model_name = config
        .served_model_name
        .clone()
        .unwrap_or_else(|| model.to_string());
    samples
        .into_iter()
        .enumerate()
        .map(|(index, sample)| RequestInput {
            prompt: sample.prompt,
            prompt_len: sample.prompt_len,
            output_len: sample.expected_output_len,
            model: model_name.clone(),
            ignore_eos,
            logprobs: config.logprobs,
            temperature: config.temperature,
            extra_body: config.extra_body.clone(),
            request_id: Some(format!("{}{index}", config.request_id_prefix)),
            messages: None,
        })
        .collect()
}

/// One sweep step: which of the three options varies, and its value.
#[derive(Debug, Clone, Copy)]
enum SweepValue {
    Single,
    NumPrompts(usize),
    RequestRate(f64),
    MaxConcurrency(usize),
}

impl SweepValue {
    fn resolve(self, config: &BenchConfig) -> (usize, f64, Option<usize>) {
        let (mut n, mut rate, mut concurrency) = (
            config.num_prompts[0],
            config.request_rates[0],
            config.max_concurrencies[0],
        );
        match self {
            Self::Single => {}
            Self::NumPrompts(v) => n = v,
            Self::RequestRate(v) => rate = v,
            Self::MaxConcurrency(v) => concurrency = Some(v),
        }
        (n, rate, concurrency)
    }

    fn axis_value(self) -> Option<f64> {
        match self {
            Self::Single => None,
            Self::NumPrompts(v) | Self::MaxConcurrency(v) => Some(v as f64),
            Self::RequestRate(v) => Some(v),
        }
    }
}

fn sweep_values(config: &BenchConfig) -> (Option<SweepAxis>, Vec<SweepValue>) {
    if config.num_prompts.len() > 1 {
        let values = config
            .num_prompts
            .iter()
            .map(|&n| SweepValue::NumPrompts(n));
        (Some(SweepAxis::NumPrompts), values.collect())
    } else if config.request_rates.len() > 1 {
        let values = config
            .request_rates
            .iter()
            .map(|&r| SweepValue::RequestRate(r));
        (Some(SweepAxis::RequestRate), values.collect())
    } else if config.max_concurrencies.len() > 1 {
        let values = config
            .max_concurrencies
            .iter()
            .flatten()
            .map(|&c| SweepValue::MaxConcurrency(c));
        (Some(SweepAxis::MaxConcurrency), values.collect())
    } else {
        (None, vec![SweepValue::Single])
    }
}

/// Distinguishes the result files of a multi-block run (vLLM names one file per run).
fn block_suffix(
    heading: Option<&str>,
    axis: Option<SweepAxis>,
    value: &SweepValue,
    phases: usize,
    values: usize,
) -> String {
    let mut suffix = String::new();
    if phases > 1
        && let Some(heading) = heading
    {
        suffix.push('-');
        suffix.push_str(&heading.to_lowercase());
    }
    if let (Some(axis), Some(v), true) = (axis, value.axis_value(), values > 1) {
        suffix.push_str(&format!(
            "-{}{}",
            axis.label(),
            report::python_float(v).trim_end_matches(".0")
        ));
    }
    suffix
}

fn save_result(
    config: &BenchConfig,
    header: &ResultHeader,
    json: &serde_json::Value,
    suffix: &str,
    append_to_named_file: bool,
) -> Result<PathBuf, BenchError> {
    let (name, append) = match &config.result_filename {
        // A named file collects every block of the run, one JSON document per line.
        Some(name) => (name.clone(), append_to_named_file),
        None => {
            let name = report::default_result_filename(header);
            let stem = name.trim_end_matches(".json");
            (format!("{stem}{suffix}.json"), config.append_result)
        }
    };
    let path = match &config.result_dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).map_err(|source| BenchError::Write {
                path: dir.clone(),
                source,
            })?;
            dir.join(name)
        }
        None => PathBuf::from(name),
    };
    let write = || -> std::io::Result<()> {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(&path)?;
        if append && file.metadata()?.len() > 0 {
            file.write_all(b"\n")?;
        }
        serde_json::to_writer(&mut file, json)?;
        Ok(())
    };
    write().map_err(|source| BenchError::Write {
        path: path.clone(),
        source,
    })?;
    Ok(path)
}

fn finish_sweep(
    config: &BenchConfig,
    axis: SweepAxis,
    points: &[(Option<&'static str>, SweepPoint)],
    date: &str,
    out: &mut (dyn Write + Send),
) -> Result<Vec<PathBuf>, BenchError> {
    let mut headings: Vec<Option<&'static str>> = points.iter().map(|(h, _)| *h).collect();
    headings.dedup();
    let mut plot_files = Vec::new();
    for heading in headings {
        let phase_points: Vec<SweepPoint> = points
            .iter()
            .filter(|(h, _)| *h == heading)
            .map(|(_, p)| p.clone())
            .collect();
        let title = heading
            .map(|h| format!("# {h} sweep\n"))
            .unwrap_or_default();
        write_out(
            out,
            &format!("\n{title}{}", sweep::summary_table(axis, &phase_points)),
        )?;
        if !config.plot {
            continue;
        }
        let phase = heading
            .map(|h| format!("-{}", h.to_lowercase()))
            .unwrap_or_default();
        let path = match (&config.plot_file, &config.result_dir) {
            (Some(path), _) if phase.is_empty() => path.clone(),
            (Some(path), _) => {
                let stem = path
                    .file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default();
                path.with_file_name(format!("{stem}{phase}.svg"))
            }
            (None, dir) => {
                let name = format!("sweep-{}{phase}-{date}.svg", axis.label());
                dir.as_ref()
                    .map_or_else(|| PathBuf::from(&name), |d| d.join(&name))
            }
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| BenchError::Write {
                path: dir.to_path_buf(),
                source,
            })?;
        }
        sweep::write_plot(&path, axis, &phase_points)?;
        tracing::info!(path = %path.display(), "wrote sweep plot");
        plot_files.push(path);
    }
    Ok(plot_files)
}

/// Raises the soft open-file limit to the hard one, so thousands of streams fit.
pub fn raise_fd_limit() {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => tracing::debug!(limit, "open-file limit"),
        Err(error) => tracing::warn!(%error, "cannot raise the open-file limit"),
    }
}
