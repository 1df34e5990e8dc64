//! Whole in-process runs against the fake server for tandem's additions: the multi-turn chat
//! mode (turn order, prompts that extend the previous prompt plus its answer, chat
//! `messages`, the agent shape, the concurrency cap per conversation, failures
//! mid-conversation), the
//! `prefix_repetition` dataset, and server cache/KV accounting in the printed table and the
//! result JSON.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tandem_bench::fake_server::{
    ReceivedRequest, Responder, ScriptedEvent, ScriptedResponse, SyntheticTiming, synthetic,
    synthetic_tandem,
};

mod common;
use common::InProcess;

struct Run {
    summary: tandem_bench::RunSummary,
    stdout: String,
    /// The saved result JSON.
    json: Value,
}

/// The synthetic server with `ttft_ms` before the first token and 1 ms between tokens.
fn timing(ttft_ms: u64) -> SyntheticTiming {
    common::timing(ttft_ms, 1)
}

/// A run that also saves its result JSON.
async fn run(bench: &InProcess, extra: &[&str]) -> Run {
    let results = tempfile::tempdir().unwrap();
    let mut argv = vec![
        "--save-result",
        "--result-dir",
        results.path().to_str().unwrap(),
        "--result-filename",
        "result.json",
    ];
    argv.extend_from_slice(extra);
    let (summary, stdout) = bench.run(&argv).await;
    let saved = std::fs::read_to_string(results.path().join("result.json")).unwrap();
    Run {
        summary,
        stdout,
        json: serde_json::from_str(&saved).unwrap(),
    }
}

/// The requests of each conversation in turn order, keyed by conversation index, from the
/// `x-request-id` (`benchmark-serving{c}` for turn 1, `benchmark-serving{c}-{k}` after).
fn conversations(requests: &[ReceivedRequest]) -> BTreeMap<usize, Vec<ReceivedRequest>> {
    let mut by_id: BTreeMap<(usize, usize), ReceivedRequest> = BTreeMap::new();
    for request in requests {
        let id = request.header("x-request-id").unwrap();
        let rest = id.strip_prefix("benchmark-serving").unwrap();
        let (c, k) = match rest.split_once('-') {
            Some((c, k)) => (c.parse().unwrap(), k.parse().unwrap()),
            None => (rest.parse().unwrap(), 0),
        };
        assert!(
            by_id.insert((c, k), request.clone()).is_none(),
            "{id} sent twice"
        );
    }
    let mut out: BTreeMap<usize, Vec<ReceivedRequest>> = BTreeMap::new();
    for ((c, k), request) in by_id {
        let turns = out.entry(c).or_default();
        assert_eq!(
            turns.len(),
            k,
            "turns of conversation {c} are numbered in order"
        );
        turns.push(request);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_turns_extend_the_previous_prompt_and_its_answer() {
    let bench = InProcess::start(synthetic_tandem(timing(5))).await;
    let result = run(
        &bench,
        &[
            "--num-prompts",
            "4",
            "--random-input-len",
            "9",
            "--random-output-len",
            "3",
            "--multi-turn-turns",
            "3",
            "--multi-turn-user-len",
            "5",
        ],
    )
    .await;
    let block = &result.summary.blocks[0];
    assert_eq!((block.metrics.completed, block.metrics.failed), (12, 0));
    // The standard block is printed as ever, then the per-turn table.
    assert!(result.stdout.starts_with(&block.block));
    assert!(
        block
            .block
            .contains(&format!("{:<40} {:<10}\n", "Successful requests:", 12))
    );
    let table = &result.stdout[block.block.len()..];
    assert!(table.starts_with("\n==========="), "{table}");
    assert!(table.contains("Multi-turn Per-turn Result"));
    assert!(
        table.contains("Mean cached tokens  Cache hit rate  Mean KV bytes"),
        "{table}"
    );
    assert_eq!(table.lines().count(), 1 + 1 + 1 + 3 + 1, "{table}");

    let conversations = conversations(&bench.server.requests());
    assert_eq!(conversations.len(), 4);
    for turns in conversations.values() {
        assert_eq!(turns.len(), 3);
        for k in 1..3 {
            let previous = turns[k - 1].body["prompt"].as_str().unwrap();
            let prompt = turns[k].body["prompt"].as_str().unwrap();
            // The fake server answers three tokens "w0 w1 w2 "; the new user message follows.
            let expected_start = format!("{previous}w0 w1 w2 ");
            assert!(prompt.starts_with(&expected_start), "{prompt:?}");
            let user = &prompt[expected_start.len()..];
            assert_eq!(user.split_whitespace().count(), 5, "{user:?}");
            assert_eq!(turns[k].body["max_tokens"], 3);
            assert!(turns[k].body.get("messages").is_none());
        }
    }

    let json = &result.json;
    let multi = &json["multi_turn"];
    assert_eq!(multi["turns"], 3);
    assert_eq!(multi["completed"], serde_json::json!([4, 4, 4]));
    let prompt_tokens: Vec<f64> = multi["mean_prompt_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(prompt_tokens.len(), 3);
    assert_eq!(
        prompt_tokens[0], 8.0,
        "turn 1: the dataset's count (BOS excluded)"
    );
    assert!(prompt_tokens[0] < prompt_tokens[1] && prompt_tokens[1] < prompt_tokens[2]);
    let cached: Vec<f64> = multi["mean_cached_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    // Each later turn finds the previous prompt (less the word its answer glued onto) cached.
    assert!(cached[1] >= prompt_tokens[0] - 1.0, "{cached:?}");
    assert!(cached[2] >= prompt_tokens[1] - 1.0, "{cached:?}");
    assert_eq!(multi["mean_ttft_ms"].as_array().unwrap().len(), 3);
    assert_eq!(multi["mean_kv_bytes"].as_array().unwrap().len(), 3);
    // The hit rate is each turn's cached tokens over its prompt tokens.
    let hit_rate = multi["cache_hit_rate"].as_array().unwrap();
    for k in 0..3 {
        let rate = hit_rate[k].as_f64().unwrap();
        assert!(
            (rate - cached[k] / prompt_tokens[k]).abs() < 1e-9,
            "{hit_rate:?}"
        );
    }
    assert_eq!(json["cached_tokens"].as_array().unwrap().len(), 12);
    assert_eq!(json["kv_bytes"].as_array().unwrap().len(), 12);
    let total_cached = json["total_cached_tokens"].as_u64().unwrap();
    assert!(total_cached as f64 >= 4.0 * (cached[1] + cached[2]) - 1e-9);
    assert!(json["total_kv_bytes"].as_u64().unwrap() > 0);
    assert!(json["total_kv_blocks"].as_u64().unwrap() > 0);
    assert_eq!(block.multi_turn.as_ref().unwrap().completed, vec![4, 4, 4]);
    bench.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_turns_send_the_conversation_as_messages() {
    let bench = InProcess::start(synthetic(timing(2))).await;
    let result = run(
        &bench,
        &[
            "--backend",
            "openai-chat",
            "--endpoint",
            "/v1/chat/completions",
            "--num-prompts",
            "2",
            "--random-input-len",
            "6",
            "--random-output-len",
            "2",
            "--multi-turn-turns",
            "3",
            "--multi-turn-user-len",
            "4",
        ],
    )
    .await;
    assert_eq!(result.summary.blocks[0].metrics.completed, 6);
    for turns in conversations(&bench.server.requests()).values() {
        assert_eq!(turns.len(), 3);
        for (k, request) in turns.iter().enumerate() {
            let messages = request.body["messages"].as_array().unwrap();
            assert_eq!(messages.len(), 2 * k + 1);
            for (i, message) in messages.iter().enumerate() {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                assert_eq!(message["role"], role);
                if role == "assistant" {
                    assert_eq!(
                        message["content"], "w0 w1 ",
                        "the text the server generated"
                    );
                } else {
                    assert!(message["content"][0]["text"].is_string());
                }
            }
            if k > 0 {
                let previous = turns[k - 1].body["messages"].as_array().unwrap();
                assert_eq!(&messages[..previous.len()], &previous[..]);
            }
            assert_eq!(request.body["max_completion_tokens"], 2);
        }
    }
    // A server without accounting: no cached/KV columns, keys or totals.
    assert!(!result.stdout.contains("cached"));
    assert!(result.stdout.contains("Multi-turn Per-turn Result"));
    assert!(
        result.json["multi_turn"]
            .get("mean_cached_tokens")
            .is_none()
    );
    assert!(result.json.get("total_cached_tokens").is_none());
    bench.shutdown().await;
}

/// `--multi-turn-agent`: every conversation opens with the same system prompt (with the
/// tool schemas), tool results follow each answer, and the think time passes between turns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_conversations_share_a_system_prompt_and_return_tool_results() {
    let bench = InProcess::start(synthetic(timing(2))).await;
    let started = std::time::Instant::now();
    let result = run(
        &bench,
        &[
            "--backend",
            "openai-chat",
            "--endpoint",
            "/v1/chat/completions",
            "--num-prompts",
            "3",
            "--random-input-len",
            "6",
            "--random-output-len",
            "2",
            "--multi-turn-turns",
            "3",
            "--multi-turn-user-len",
            "4",
            "--multi-turn-agent",
            "--agent-system-len",
            "12",
            "--agent-tools",
            "2",
            "--agent-think-time-ms",
            "100",
        ],
    )
    .await;
    assert_eq!(result.summary.blocks[0].metrics.completed, 9);
    // Two pauses in each conversation, all three in parallel.
    assert!(started.elapsed() >= Duration::from_millis(200));
    let conversations = conversations(&bench.server.requests());
    let system = conversations[&0][0].body["messages"][0].clone();
    assert_eq!(system["role"], "system");
    assert!(system["content"].as_str().unwrap().contains("tool_1"));
    for turns in conversations.values() {
        for (k, request) in turns.iter().enumerate() {
            let messages = request.body["messages"].as_array().unwrap();
            assert_eq!(messages.len(), 2 * k + 2);
            assert_eq!(messages[0], system, "one system prompt for all");
            assert_eq!(messages[1]["role"], "user");
            for pair in messages[2..].chunks(2) {
                assert_eq!(pair[0]["role"], "assistant");
                assert_eq!(pair[1]["role"], "tool");
                let result = pair[1]["content"].as_str().unwrap();
                assert_eq!(result.split_whitespace().count(), 4, "{result:?}");
            }
        }
    }
    bench.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_holds_its_concurrency_slot_for_all_its_turns() {
    let bench = InProcess::start(synthetic(timing(10))).await;
    run(
        &bench,
        &[
            "--num-prompts",
            "3",
            "--random-input-len",
            "4",
            "--random-output-len",
            "2",
            "--multi-turn-turns",
            "2",
            "--max-concurrency",
            "1",
        ],
    )
    .await;
    assert_eq!(bench.server.stats().peak_streams, 1);
    let ids: Vec<String> = bench
        .server
        .requests()
        .iter()
        .map(|r| r.header("x-request-id").unwrap().to_string())
        .collect();
    // Each conversation runs to its end before the next one starts.
    assert_eq!(ids.len(), 6);
    for pair in ids.chunks(2) {
        assert_eq!(pair[1], format!("{}-1", pair[0]));
    }
    bench.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_turn_ends_its_conversation() {
    let ok = synthetic(timing(1));
    // Turn 2 of every conversation is refused.
    let responder: Responder = Arc::new(move |request: &ReceivedRequest| {
        if request
            .header("x-request-id")
            .is_some_and(|id| id.ends_with("-1"))
        {
            ScriptedResponse {
                status: 500,
                events: vec![ScriptedEvent::new(Duration::ZERO, "boom", 0)],
            }
        } else {
            ok(request)
        }
    });
    let bench = InProcess::start(responder).await;
    let result = run(
        &bench,
        &[
            "--num-prompts",
            "2",
            "--random-input-len",
            "4",
            "--random-output-len",
            "2",
            "--multi-turn-turns",
            "3",
        ],
    )
    .await;
    let metrics = &result.summary.blocks[0].metrics;
    assert_eq!((metrics.completed, metrics.failed), (2, 4));
    assert_eq!(bench.server.requests().len(), 4, "turn 3 is never sent");
    assert_eq!(
        result.json["multi_turn"]["completed"],
        serde_json::json!([2, 0, 0])
    );
    bench.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_repetition_prompts_share_prefixes_and_hit_the_cache() {
    let bench = InProcess::start(synthetic_tandem(timing(1))).await;
    let result = run(
        &bench,
        &[
            "--dataset-name",
            "prefix_repetition",
            "--prefix-repetition-prefix-len",
            "6",
            "--prefix-repetition-suffix-len",
            "3",
            "--prefix-repetition-num-prefixes",
            "2",
            "--prefix-repetition-output-len",
            "2",
            "--num-prompts",
            "6",
            "--max-concurrency",
            "1",
        ],
    )
    .await;
    let block = &result.summary.blocks[0];
    assert_eq!(block.metrics.completed, 6);
    assert_eq!(block.metrics.total_input, 6 * 9);
    assert!(block.multi_turn.is_none());
    assert!(!result.stdout.contains("Multi-turn"));
    let mut prefixes: BTreeMap<String, usize> = BTreeMap::new();
    for request in bench.server.requests() {
        let prompt = request.body["prompt"].as_str().unwrap().to_string();
        let words: Vec<&str> = prompt.split(' ').collect();
        assert_eq!(words.len(), 9);
        *prefixes.entry(words[..6].join(" ")).or_default() += 1;
        assert_eq!(request.body["max_tokens"], 2);
    }
    assert_eq!(prefixes.values().copied().collect::<Vec<_>>(), vec![3, 3]);
    // Four of the six requests follow one with the same prefix: at least 6 cached tokens each.
    assert!(result.json["total_cached_tokens"].as_u64().unwrap() >= 24);
    assert!(result.json.get("multi_turn").is_none());
    bench.shutdown().await;
}
