//! The agent shape of multi-turn mode (`--multi-turn-agent`): conversations that run like a
//! tool-using agent's. Every conversation opens with the same system prompt (instructions
//! of `--agent-system-len` random tokens, then the JSON schemas of `--agent-tools` tools, as
//! agent frameworks describe tools to a model), the sampled prompt is the user's task, and
//! each later turn appends the model's answer and a tool result (`role: "tool"`, of
//! `--multi-turn-user-len` random tokens) after the agent has "run the tool" for
//! `--agent-think-time-ms`. The shared system prompt and the history that grows by a tool
//! result a turn are what prefix caching and kv-aware routing are for.

use std::time::Duration;

use rand::SeedableRng;
use rand::rngs::StdRng;
use serde_json::json;

use crate::datasets::{DatasetError, allowed_ids, random_token_ids};
use crate::tokenizer::BenchTokenizer;

/// `--multi-turn-agent` and its options.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentShape {
    /// Random tokens of the shared instructions.
    pub system_len: usize,
    /// Tool schemas described after them.
    pub tools: usize,
    /// The pause between an answer and the turn that returns its tool's result.
    pub think_time: Duration,
}

/// The system prompt every conversation shares: the same for a seed, whatever the number of
/// conversations.
pub fn system_prompt(
    shape: &AgentShape,
    tokenizer: &BenchTokenizer,
    seed: u64,
) -> Result<String, DatasetError> {
    let allowed = allowed_ids(tokenizer)?;
    // Apart from every conversation's own stream (those mix the seed with their indices).
    let mut rng = StdRng::seed_from_u64(seed ^ 0xA6E7_5157_E3D0_0001);
    let (ids, _) = random_token_ids(tokenizer, &allowed, shape.system_len, &mut rng)?;
    let instructions = tokenizer.decode(&ids)?;
    let tools: Vec<String> = (0..shape.tools)
        .map(|i| tool_schema(i).to_string())
        .collect();
    Ok(if tools.is_empty() {
        instructions
    } else {
        format!(
            "{instructions}\n\nYou may call these tools:\n{}",
            tools.join("\n")
        )
    })
}

/// The schema of synthetic tool `i`: a name, a description and a few typed parameters, about
/// the size of a real agent's tool.
fn tool_schema(i: usize) -> serde_json::Value {
    json!({
        "type": "function",
        "function": {
            "name": format!("tool_{i}"),
            "description": format!("Tool number {i}: looks up a record and returns its fields."),
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "what to look up"},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 50},
                    "fields": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["query"],
            },
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::word_level_tokenizer;

    #[test]
    fn the_system_prompt_is_fixed_by_the_seed_and_describes_the_tools() {
        let tok = word_level_tokenizer(300).unwrap();
        let shape = AgentShape {
            system_len: 20,
            tools: 3,
            think_time: Duration::ZERO,
        };
        let a = system_prompt(&shape, &tok, 1).unwrap();
        assert_eq!(a, system_prompt(&shape, &tok, 1).unwrap());
        assert_ne!(a, system_prompt(&shape, &tok, 2).unwrap());
        assert!(
            a.contains("\"name\":\"tool_2\"") && !a.contains("tool_3"),
            "{a}"
        );
        let bare = AgentShape { tools: 0, ..shape };
        let instructions = system_prompt(&bare, &tok, 1).unwrap();
        assert_eq!(tok.count(&instructions, false).unwrap(), 20);
        assert!(a.starts_with(&instructions));
    }
}
