//! The real default model: SmolLM2-135M-Instruct from its GGUF (fetched into the cache on
//! first use; `.ci/run` fetches it before the tests).

use std::path::PathBuf;
use std::sync::Arc;

use tandem_engine::{
    Engine, EngineConfig, LoadOptions, ModelSource, SamplingParams, StopParams, load_model,
};
use tandem_text::{ChatMessage, ChatTemplate};

fn cache_dir() -> PathBuf {
    std::env::var_os("TANDEM_CACHE")
        .map_or_else(tandem_engine::fetch::default_cache_dir, PathBuf::from)
}

fn load() -> (Arc<tandem_engine::Model>, tandem_text::TextTokenizer) {
    let opts = LoadOptions {
        cache_dir: cache_dir(),
        ..Default::default()
    };
    let (model, tok) = load_model(&ModelSource::DefaultSmolLm2, &opts)
        .expect("SmolLM2 loads (run .ci/run or allow pip to fetch it)");
    (Arc::new(model), tok)
}

#[test]
fn answers_paris_and_splits_digits() {
    let (model, tok) = load();
    let cfg = model.config();
    assert_eq!(
        (
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads
        ),
        (30, 576, 9, 3)
    );
    assert_eq!(cfg.vocab_size, 49152);
    assert!(cfg.tie_word_embeddings);

    // Digits are one token each (the `smollm` pre-tokenizer).
    let ids = tok.encode("Call 0123456789 now", false).unwrap();
    let digit_tokens: Vec<String> = ids
        .iter()
        .map(|&id| tok.decode(&[id], false).unwrap())
        .filter(|t| t.chars().any(|c| c.is_ascii_digit()))
        .collect();
    assert_eq!(
        digit_tokens,
        ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]
    );
    assert_eq!(tok.decode(&ids, false).unwrap(), "Call 0123456789 now");

    let info = tok.info();
    let template = ChatTemplate::new(
        info.chat_template.as_deref().unwrap(),
        info.bos_token.as_deref(),
        info.eos_token.as_deref(),
    )
    .unwrap();
    let text = template
        .render(
            &[ChatMessage::new("user", "What is the capital of France?")],
            true,
        )
        .unwrap();
    assert!(
        text.contains("<|im_start|>user\nWhat is the capital of France?<|im_end|>"),
        "{text}"
    );
    let prompt = tok.encode(&text, false).unwrap();
    assert_eq!(prompt[0], 1, "<|im_start|> is one special token");

    let config = EngineConfig {
        kv_budget_bytes: 256 << 20,
        ..Default::default()
    };
    let mut engine = Engine::new(model, tok, config).unwrap();
    let stop = StopParams {
        max_tokens: 24,
        ..Default::default()
    };
    let id = engine
        .add_request(prompt, SamplingParams::greedy(), stop)
        .unwrap();
    let outs = engine.run_to_completion(id).unwrap();
    let answer: String = outs.iter().map(|o| o.text.as_str()).collect();
    assert!(answer.contains("Paris"), "answer: {answer:?}");
    assert_eq!(engine.used_blocks(), 0);
}
