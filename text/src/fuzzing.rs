//! Entry points for the fuzz targets (`fuzz/`, libFuzzer through cargo-fuzz) and for the
//! tests that replay their corpora on every build: each takes arbitrary bytes, runs one
//! parser that a model file or a client controls, and must return, whatever the bytes,
//! without a panic, an abort or an unbounded allocation. Errors are the expected outcome of
//! most inputs and are dropped.

use crate::{
    ChatMessage, ChatTemplate, GuideFactory, GuideSpec, ParsedReply, RenderOptions, ReplyOptions,
    TextTokenizer, TokenizerInfo, ToolMode, ToolSyntax, gguf,
};

/// A GGUF file's metadata, then what a worker builds from it: the tokenizer and the chat
/// template (compiled, which renders it once).
pub fn gguf_metadata(data: &[u8]) {
    let Ok(meta) = gguf::parse_metadata(data) else {
        return;
    };
    if let Ok(tokenizer) = TextTokenizer::from_gguf_metadata(&meta)
        && sampled(data)
    {
        let _ = tokenizer.encode("Hello, world!", true);
    }
    if let Some(source) = meta.get_str("tokenizer.chat_template") {
        let _ = ChatTemplate::new(source, Some("<s>"), Some("</s>"));
    }
}

/// A chat template from a model file and a conversation from a client: the bytes up to the
/// first NUL are the template, the rest a user message (and, split at the next NUL, the
/// request's `chat_template_kwargs` as JSON).
pub fn chat_template(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.splitn(3, '\0');
    let source = parts.next().unwrap_or_default();
    let message = parts.next().unwrap_or_default();
    let kwargs = parts
        .next()
        .and_then(|k| serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(k).ok())
        .unwrap_or_default();
    let Ok(template) = ChatTemplate::new(source, Some("<s>"), Some("</s>")) else {
        return;
    };
    let messages = [
        ChatMessage::new("system", "You are a helpful assistant."),
        ChatMessage::new("user", message),
    ];
    let options = RenderOptions {
        tools: None,
        kwargs,
    };
    let _ = template.render_with(&messages, true, &options);
}

/// A `tokenizer.json` (from an HF folder or a worker's info), then one encode and decode.
pub fn tokenizer_json(data: &[u8]) {
    let Ok(json) = std::str::from_utf8(data) else {
        return;
    };
    let info = TokenizerInfo {
        bos_token: None,
        eos_token_ids: Vec::new(),
        eos_token: None,
        chat_template: None,
    };
    if let Ok(tokenizer) = TextTokenizer::from_json(json, info)
        && sampled(data)
        && let Ok(ids) = tokenizer.encode("Hello, world! 123", true)
    {
        let _ = tokenizer.decode(&ids, false);
    }
}

/// Whether this input's freshly built tokenizer also encodes (one input in 8, by a hash of
/// its bytes, so a found input replays alike). A tokenizer's first encode allocates its
/// caches (hundreds of KB); millions of them grow the fuzzer's RSS past its 1 GiB limit in
/// minutes through the allocator alone (valgrind finds nothing lost), while a server builds
/// one tokenizer per model load.
fn sampled(data: &[u8]) -> bool {
    fnv(data).is_multiple_of(8)
}

/// FNV-1a: a stable hash of an input (which inputs encode; the name of a found input).
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// A structured-output grammar from a request, compiled against a byte-level vocabulary and
/// stepped a few tokens: the first byte picks the kind, the rest is its text.
pub fn guide(data: &[u8]) {
    let Some((&kind, rest)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(rest).into_owned();
    let spec = match kind % 5 {
        0 => GuideSpec::JsonSchema(text),
        1 => GuideSpec::Regex(text),
        2 => GuideSpec::Lark(text),
        3 => GuideSpec::Choice(text.split('\n').map(str::to_string).collect()),
        _ => GuideSpec::JsonObject,
    };
    if spec.check_size().is_err() {
        return;
    }
    // One vocabulary's trie for every input (building it is what a server does once).
    static FACTORY: std::sync::OnceLock<GuideFactory> = std::sync::OnceLock::new();
    let factory = FACTORY.get_or_init(|| GuideFactory::new(&TextTokenizer::byte_level()));
    if let Ok(mut guide) = factory.compile(&spec) {
        for &token in rest.iter().take(16) {
            let _ = guide.allowed();
            if guide.advance(3 + u32::from(token)).is_err() || guide.is_finished() {
                break;
            }
        }
    }
}

/// A model's reply (hostile only in that a model writes anything) through the reply parser,
/// in every mode, whole and a byte at a time.
pub fn reply(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let modes = [
        ToolMode::Off,
        ToolMode::Auto {
            syntax: ToolSyntax::Hermes,
            parallel: true,
        },
        ToolMode::Auto {
            syntax: ToolSyntax::Llama3Json,
            parallel: false,
        },
        ToolMode::Auto {
            syntax: ToolSyntax::Mistral,
            parallel: true,
        },
        ToolMode::Required,
        ToolMode::Named("f".into()),
    ];
    let pieces: Vec<String> = text.chars().map(String::from).collect();
    for tools in modes {
        let options = ReplyOptions {
            reasoning: true,
            starts_thinking: data.first().is_some_and(|b| b & 1 == 1),
            tools,
        };
        let whole = ParsedReply::parse(&options, [text.as_ref()]);
        let streamed = ParsedReply::parse(&options, pieces.iter().map(String::as_str));
        assert_eq!(whole.content, streamed.content, "streamed and whole differ");
        assert_eq!(whole.calls, streamed.calls, "streamed and whole differ");
    }
}

#[cfg(any(test, feature = "fuzz-replay"))]
pub mod replay;
#[cfg(test)]
mod tests;
