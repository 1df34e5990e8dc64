//! Multi-turn chat mode (`--multi-turn-turns T`, `--multi-turn-user-len L`): each sampled
//! request is the first user message of a conversation of T turns run strictly in sequence;
//! turn k resends the whole conversation so far (every user message and the text the server
//! actually generated) plus a new user message of L random tokens. It measures what a chat
//! workload gets from prefix caching and KV transfer as the shared context grows.
//!
//! Conversations arrive like single requests do (rate, burstiness) and each holds one
//! `--max-concurrency` slot for its whole life, so the cap bounds conversations in flight.
//! Every turn is one request in the usual metrics; [`TurnSummary`] adds per-turn means.
//! The chat backend sends the conversation as a `messages` array; the others send it as
//! plain text, `prompt(k) = prompt(k-1) + generated(k-1) + user(k)`, so each prompt extends
//! the previous one exactly. `--multi-turn-agent` gives conversations an agent's rhythm
//! (see `agent`): a shared system prompt first, and tool results instead of user messages.

use std::fmt::Write as _;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand::rngs::StdRng;
use serde_json::{Map, Value, json};

use crate::agent::{self, AgentShape};
use crate::backends::{ChatMessage, ChatRole, RequestInput, Target, send_request};
use crate::datasets::{DatasetError, allowed_ids, random_token_ids};
use crate::metrics::RequestOutput;
use crate::progress::Progress;
use crate::runner::{RunError, RunOutcome, TrafficSettings, arrival_offsets, start_run, stop_run};
use crate::tokenizer::BenchTokenizer;

/// Counts the prompt tokens of a later turn when the server reports none.
pub type TokenCounter = Arc<dyn Fn(&str) -> usize + Send + Sync>;

/// One conversation, prepared before the timed run so no tokenizer work delays it.
#[derive(Debug, Clone)]
pub struct Conversation {
    /// Turn 1: the dataset's request (behind the shared system prompt, for an agent).
    pub first: RequestInput,
    /// The messages of turns 2..=T: the user's, or an agent's tool results.
    pub later_users: Vec<String>,
    /// Who writes them.
    pub later_role: ChatRole,
    /// The pause before each later turn.
    pub think_time: Duration,
}

/// Opens one conversation per dataset request, with `turns - 1` later messages of
/// `user_len` random tokens each; message (c, k) depends only on `seed`, c and k. An
/// `agent` shape puts its system prompt before every first request and makes the later
/// messages tool results.
pub fn plan(
    inputs: Vec<RequestInput>,
    tokenizer: &BenchTokenizer,
    turns: usize,
    user_len: usize,
    seed: u64,
    agent: Option<&AgentShape>,
) -> Result<Vec<Conversation>, DatasetError> {
    let system = agent
        .map(|shape| agent::system_prompt(shape, tokenizer, seed))
        .transpose()?;
    let allowed = allowed_ids(tokenizer)?;
    let mut mismatched = 0i64;
    let mut conversations = Vec::with_capacity(inputs.len());
    for (index, mut first) in inputs.into_iter().enumerate() {
        if let Some(system) = &system {
            let task = std::mem::take(&mut first.prompt);
            first.prompt = format!("{system}\n\n{task}");
            first.prompt_len = tokenizer.count(&first.prompt, false)?;
            first.messages = Some(vec![
                ChatMessage {
                    role: ChatRole::System,
                    content: system.clone(),
                },
                ChatMessage {
                    role: ChatRole::User,
                    content: task,
                },
            ]);
        }
        let mut later_users = Vec::with_capacity(turns.saturating_sub(1));
        for turn in 1..turns {
            let mut rng = StdRng::seed_from_u64(message_seed(seed, index as u64, turn as u64));
            let (ids, mismatch) = random_token_ids(tokenizer, &allowed, user_len, &mut rng)?;
            mismatched += mismatch;
            later_users.push(tokenizer.decode(&ids)?);
        }
        conversations.push(Conversation {
            first,
            later_users,
            later_role: if agent.is_some() {
                ChatRole::Tool
            } else {
                ChatRole::User
            },
            think_time: agent.map_or(Duration::ZERO, |a| a.think_time),
        });
    }
    if mismatched != 0 {
        tracing::warn!(
            mismatched,
            "multi-turn user messages did not all re-tokenize to --multi-turn-user-len"
        );
    }
    Ok(conversations)
}

/// SplitMix64 finaliser: mixes the run seed with the conversation and turn indices so every
/// message has its own stream, stable across Rust versions (unlike `DefaultHasher`).
fn message_seed(seed: u64, conversation: u64, turn: u64) -> u64 {
    fn mix(mut z: u64) -> u64 {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    mix(mix(mix(seed) ^ conversation) ^ turn)
}

/// Runs one block of conversations: the usual ready check and warmups with the first turn
/// of conversation 0, then every conversation from its arrival time. Outputs are
/// conversation-major: `outputs[c * turns + k]` is turn k of conversation c.
pub async fn run_conversations(
    client: &reqwest::Client,
    target: &Target,
    conversations: Vec<Conversation>,
    turns: usize,
    count_tokens: TokenCounter,
    settings: &TrafficSettings,
    log: &mut (dyn Write + Send),
) -> Result<RunOutcome, RunError> {
    let Some(test_input) = conversations.first().map(|c| c.first.clone()) else {
        return Err(RunError::NoRequests);
    };
    if turns == 0 {
        return Err(RunError::Traffic(
            "a conversation needs at least one turn".into(),
        ));
    }
    let semaphore = start_run(client, target, &test_input, settings, log).await?;
    let offsets = arrival_offsets(
        conversations.len(),
        settings.request_rate,
        settings.burstiness,
        settings.seed,
    )?;
    let progress = Progress::new(conversations.len() * turns, settings.show_progress);
    let target_arc = Arc::new(target.clone());
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(conversations.len());
    for (conversation, offset) in conversations.into_iter().zip(offsets) {
        if offset > 0.0 {
            tokio::time::sleep_until((start + Duration::from_secs_f64(offset)).into()).await;
        }
        let (client, target, semaphore, progress, count_tokens) = (
            client.clone(),
            target_arc.clone(),
            semaphore.clone(),
            progress.clone(),
            count_tokens.clone(),
        );
        tasks.push(tokio::spawn(async move {
            // One slot for the whole conversation: its turns follow each other at once.
            let _permit = match &semaphore {
                Some(semaphore) => semaphore.clone().acquire_owned().await.ok(),
                None => None,
            };
            converse(
                &client,
                &target,
                conversation,
                turns,
                &*count_tokens,
                &progress,
                start,
            )
            .await
        }));
    }
    let mut outputs = Vec::with_capacity(tasks.len() * turns);
    for task in tasks {
        match task.await {
            Ok(turn_outputs) => outputs.extend(turn_outputs),
            Err(e) => outputs.extend((0..turns).map(|_| RequestOutput {
                error: format!("conversation task failed: {e}"),
                ..Default::default()
            })),
        }
    }
    progress.close();
    let duration = start.elapsed().as_secs_f64();
    stop_run(client, target, &test_input, settings, log).await;
    Ok(RunOutcome { outputs, duration })
}

/// Runs the turns of one conversation in order; returns exactly `turns` outputs. After a
/// failed turn there is no answer to build on, so the remaining turns are recorded as
/// failed without being sent.
async fn converse(
    client: &reqwest::Client,
    target: &Target,
    conversation: Conversation,
    turns: usize,
    count_tokens: &(dyn Fn(&str) -> usize + Send + Sync),
    progress: &Progress,
    start: Instant,
) -> Vec<RequestOutput> {
    let mut outputs = Vec::with_capacity(turns);
    let mut input = conversation.first;
    let base_id = input.request_id.clone();
    let mut messages = input.messages.clone().unwrap_or_else(|| {
        vec![ChatMessage {
            role: ChatRole::User,
            content: input.prompt.clone(),
        }]
    });
    for turn in 0..turns {
        if turn > 0 && !conversation.think_time.is_zero() {
            // The agent runs its tool: the conversation's slot stays held, no request runs.
            tokio::time::sleep(conversation.think_time).await;
        }
        let mut output = send_request(client, target, &input, start).await;
        progress.advance();
        if turn > 0
            && let Some(n) = output.server_prompt_tokens
        {
            // The server's count includes its chat template; the bench can only count text.
            output.prompt_len = n;
        }
        let success = output.success;
        let generated = output.generated_text.clone();
        outputs.push(output);
        if turn + 1 == turns {
            break;
        }
        if !success {
            for skipped in turn + 1..turns {
                progress.advance();
                outputs.push(RequestOutput {
                    error: format!("not sent: turn {turn} of this conversation failed"),
                    ..Default::default()
                });
                tracing::debug!(skipped, "multi-turn conversation cut short");
            }
            break;
        }
        let user = conversation
            .later_users
            .get(turn)
            .cloned()
            .unwrap_or_default();
        input.prompt = format!("{}{generated}{user}", input.prompt);
        input.prompt_len = count_tokens(&input.prompt);
        messages.push(ChatMessage {
            role: ChatRole::Assistant,
            content: generated,
        });
        messages.push(ChatMessage {
            role: conversation.later_role,
            content: user,
        });
        input.messages = Some(messages.clone());
        input.request_id = base_id.as_ref().map(|id| format!("{id}-{}", turn + 1));
    }
    outputs
}

/// Per-turn means over the successful requests of each turn (0 where a turn had none, as
/// vLLM's statistics of an empty list).
#[derive(Debug, Clone, PartialEq)]
pub struct TurnSummary {
    pub turns: usize,
    /// Successful requests per turn.
    pub completed: Vec<usize>,
    pub mean_ttft_ms: Vec<f64>,
    pub mean_prompt_tokens: Vec<f64>,
    /// Present when the server reported cached tokens for any request of the run.
    pub mean_cached_tokens: Option<Vec<f64>>,
    /// The prefix-cache hit rate of each turn: its cached prompt tokens over its prompt
    /// tokens as the server counted them (present with the cached tokens).
    pub cache_hit_rate: Option<Vec<f64>>,
    /// Present when the server reported KV bytes for any request of the run.
    pub mean_kv_bytes: Option<Vec<f64>>,
}

impl TurnSummary {
    /// Summarises conversation-major `outputs` of `turns`-turn conversations.
    pub fn new(outputs: &[RequestOutput], turns: usize) -> Self {
        let turns = turns.max(1);
        let of_turn = |k: usize| {
            outputs
                .iter()
                .skip(k)
                .step_by(turns)
                .filter(|o| o.success)
                .collect::<Vec<_>>()
        };
        let mean = |values: &[f64]| {
            if values.is_empty() {
                0.0
            } else {
                values.iter().sum::<f64>() / values.len() as f64
            }
        };
        let per_turn = |f: &dyn Fn(&RequestOutput) -> Option<f64>| -> Vec<f64> {
            (0..turns)
                .map(|k| {
                    let values: Vec<f64> = of_turn(k).into_iter().filter_map(f).collect();
                    mean(&values)
                })
                .collect()
        };
        let any_cached = outputs.iter().any(|o| o.cached_tokens.is_some());
        let any_kv = outputs.iter().any(|o| o.kv_bytes.is_some());
        Self {
            turns,
            completed: (0..turns).map(|k| of_turn(k).len()).collect(),
            mean_ttft_ms: per_turn(&|o| Some(o.ttft * 1000.0)),
            mean_prompt_tokens: per_turn(&|o| Some(o.prompt_len as f64)),
            mean_cached_tokens: any_cached
                .then(|| per_turn(&|o| o.cached_tokens.map(|n| n as f64))),
            cache_hit_rate: any_cached.then(|| {
                (0..turns)
                    .map(|k| {
                        // Over the server's own count where it gave one (its chat template's
                        // tokens included), as its cached count is.
                        let (cached, prompt) = of_turn(k).iter().fold((0, 0), |(c, p), o| {
                            let prompt = o.server_prompt_tokens.unwrap_or(o.prompt_len);
                            (c + o.cached_tokens.unwrap_or(0), p + prompt)
                        });
                        if prompt == 0 {
                            0.0
                        } else {
                            cached as f64 / prompt as f64
                        }
                    })
                    .collect()
            }),
            mean_kv_bytes: any_kv.then(|| per_turn(&|o| o.kv_bytes.map(|n| n as f64))),
        }
    }

    /// The table printed after the standard block (stdout), one row per turn, 1-based.
    pub fn table(&self) -> String {
        let mut columns = vec!["Turn", "Requests", "Mean TTFT (ms)", "Mean prompt tokens"];
        if self.mean_cached_tokens.is_some() {
            columns.push("Mean cached tokens");
            columns.push("Cache hit rate");
        }
        if self.mean_kv_bytes.is_some() {
            columns.push("Mean KV bytes");
        }
        let mut out = String::new();
        let _ = writeln!(out, "{:=^50}", " Multi-turn Per-turn Result ");
        let _ = writeln!(out, "{}", columns.join("  "));
        let at = |values: &[f64], k: usize| format!("{:.2}", values.get(k).copied().unwrap_or(0.0));
        for k in 0..self.turns {
            let mut values = vec![
                (k + 1).to_string(),
                self.completed.get(k).copied().unwrap_or(0).to_string(),
                at(&self.mean_ttft_ms, k),
                at(&self.mean_prompt_tokens, k),
            ];
            for optional in [
                &self.mean_cached_tokens,
                &self.cache_hit_rate,
                &self.mean_kv_bytes,
            ]
            .into_iter()
            .flatten()
            {
                values.push(at(optional, k));
            }
            // Each value right-aligned under its column label.
            let cells: Vec<String> = columns
                .iter()
                .zip(&values)
                .map(|(label, value)| format!("{value:>w$}", w = label.len()))
                .collect();
            let _ = writeln!(out, "{}", cells.join("  "));
        }
        let _ = writeln!(out, "{}", "=".repeat(50));
        out
    }

    /// The result JSON's `multi_turn` object.
    pub fn to_json(&self) -> Value {
        let mut map = Map::new();
        map.insert("turns".into(), json!(self.turns));
        map.insert("completed".into(), json!(self.completed));
        map.insert("mean_ttft_ms".into(), json!(self.mean_ttft_ms));
        map.insert("mean_prompt_tokens".into(), json!(self.mean_prompt_tokens));
        if let Some(values) = &self.mean_cached_tokens {
            map.insert("mean_cached_tokens".into(), json!(values));
        }
        if let Some(values) = &self.cache_hit_rate {
            map.insert("cache_hit_rate".into(), json!(values));
        }
        if let Some(values) = &self.mean_kv_bytes {
            map.insert("mean_kv_bytes".into(), json!(values));
        }
        Value::Object(map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backends::{Backend, request_body};
    use crate::tokenizer::word_level_tokenizer;

    fn input(prompt: &str, index: usize) -> RequestInput {
        RequestInput {
            prompt: prompt.into(),
            prompt_len: 3,
            output_len: 4,
            model: "m".into(),
            ignore_eos: false,
            logprobs: None,
            temperature: None,
            extra_body: None,
            request_id: Some(format!("r{index}")),
            messages: None,
        }
    }

    #[test]
    fn later_user_messages_are_fixed_by_seed_conversation_and_turn() {
        let tok = word_level_tokenizer(300).unwrap();
        let inputs = vec![input("w1 w2 w3", 0), input("w4 w5 w6", 1)];
        let a = plan(inputs.clone(), &tok, 3, 6, 7, None).unwrap();
        assert_eq!(a.len(), 2);
        for conversation in &a {
            assert_eq!(conversation.later_users.len(), 2);
            for user in &conversation.later_users {
                assert_eq!(tok.count(user, false).unwrap(), 6);
                assert!(!user.contains('<'), "no special tokens: {user}");
            }
        }
        assert_ne!(a[0].later_users[0], a[0].later_users[1]);
        assert_ne!(a[0].later_users[0], a[1].later_users[0]);
        // The messages of a conversation do not depend on how many others there are.
        let alone = plan(vec![inputs[0].clone()], &tok, 3, 6, 7, None).unwrap();
        assert_eq!(alone[0].later_users, a[0].later_users);
        let other_seed = plan(inputs.clone(), &tok, 3, 6, 8, None).unwrap();
        assert_ne!(other_seed[0].later_users, a[0].later_users);
        assert!(
            plan(inputs, &tok, 1, 6, 7, None).unwrap()[0]
                .later_users
                .is_empty()
        );
    }

    fn turn(success: bool, ttft: f64, prompt_len: usize, cached: Option<usize>) -> RequestOutput {
        RequestOutput {
            success,
            ttft,
            prompt_len,
            cached_tokens: cached,
            kv_bytes: cached.map(|n| n as u64 * 10),
            ..Default::default()
        }
    }

    #[test]
    fn per_turn_means_skip_failures_and_optional_columns() {
        // Two conversations of two turns, conversation-major.
        let outputs = vec![
            turn(true, 0.010, 10, Some(0)),
            turn(true, 0.004, 30, Some(12)),
            turn(true, 0.020, 20, Some(0)),
            turn(false, 0.0, 0, None),
        ];
        let summary = TurnSummary::new(&outputs, 2);
        assert_eq!(summary.completed, vec![2, 1]);
        assert!((summary.mean_ttft_ms[0] - 15.0).abs() < 1e-9);
        assert!((summary.mean_ttft_ms[1] - 4.0).abs() < 1e-9);
        assert_eq!(summary.mean_prompt_tokens, vec![15.0, 30.0]);
        assert_eq!(summary.mean_cached_tokens, Some(vec![0.0, 12.0]));
        assert_eq!(summary.mean_kv_bytes, Some(vec![0.0, 120.0]));
        let table = summary.table();
        assert!(table.starts_with(&format!("{:=^50}\n", " Multi-turn Per-turn Result ")));
        assert!(table.contains(
            "Turn  Requests  Mean TTFT (ms)  Mean prompt tokens  Mean cached tokens  Cache hit rate  Mean KV bytes"
        ));
        // Turn 2: 12 of 30 prompt tokens cached.
        assert_eq!(summary.cache_hit_rate, Some(vec![0.0, 0.4]));
        assert!(
            table.contains("   2         1            4.00               30.00"),
            "{table}"
        );
        let json = summary.to_json();
        assert_eq!(json["turns"], 2);
        assert_eq!(json["mean_cached_tokens"], json!([0.0, 12.0]));
        // A server without accounting: no cached/KV columns or keys.
        let plain: Vec<RequestOutput> = outputs
            .iter()
            .map(|o| RequestOutput {
                cached_tokens: None,
                kv_bytes: None,
                ..o.clone()
            })
            .collect();
        let summary = TurnSummary::new(&plain, 2);
        assert!(!summary.table().contains("cached"));
        assert!(summary.to_json().get("mean_kv_bytes").is_none());
    }

    #[test]
    fn chat_conversations_are_sent_as_messages() {
        let mut conversation = input("hi", 0);
        let message = |role, content: &str| ChatMessage {
            role,
            content: content.into(),
        };
        conversation.messages = Some(vec![
            message(ChatRole::System, "s"),
            message(ChatRole::User, "u1"),
            message(ChatRole::Assistant, "a1"),
            message(ChatRole::User, "u2"),
            message(ChatRole::Assistant, "a2"),
            message(ChatRole::Tool, "t1"),
        ]);
        let chat = request_body(Backend::OpenaiChat, &conversation);
        assert_eq!(
            chat["messages"],
            json!([
                {"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "u1"}]},
                {"role": "assistant", "content": "a1"},
                {"role": "user", "content": [{"type": "text", "text": "u2"}]},
                {"role": "assistant", "content": "a2"},
                {"role": "tool", "tool_call_id": "call_0", "content": "t1"},
            ])
        );
        // Completions backends send the plain-text prompt.
        let completions = request_body(Backend::Openai, &conversation);
        assert_eq!(completions["prompt"], "hi");
        assert!(completions.get("messages").is_none());
    }
}
