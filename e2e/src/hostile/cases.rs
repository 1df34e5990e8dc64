//! The crafted hostile model files, each one defect away from a valid base (`writers`), and
//! the words of the refusal each must get. Every file is small (the largest, 4.5 MB, is a
//! SentencePiece vocabulary of long pieces): what it declares is what is hostile.

use std::path::{Path, PathBuf};

use tandem_text::gguf::GgufValue;

use super::writers::{CHATML, Gguf, GgufTensor, HfFolder, raw_entry};

/// One hostile model: a file or folder to pass as `--model`, the flags that go with it, and
/// a piece of the refusal's text.
#[derive(Debug, Clone)]
pub struct Case {
    pub name: &'static str,
    /// What is hostile about it, in a few words.
    pub what: &'static str,
    pub model: PathBuf,
    pub args: Vec<String>,
    pub expect: &'static str,
}

/// The GGUF base with one defect, written to `dir/<name>.gguf`.
fn gguf(dir: &Path, name: &str, edit: impl FnOnce(&mut Gguf)) -> std::io::Result<PathBuf> {
    let mut g = Gguf::tiny_llama();
    edit(&mut g);
    let path = dir.join(format!("{name}.gguf"));
    g.write(&path)?;
    Ok(path)
}

/// The base with `template` as its chat template.
fn template(dir: &Path, name: &str, template: &str) -> std::io::Result<PathBuf> {
    gguf(dir, name, |g| {
        *g = g.clone().set(
            "tokenizer.chat_template",
            GgufValue::String(template.into()),
        );
    })
}

/// The HF base with one defect, written to the folder `dir/<name>`.
fn hf(dir: &Path, name: &str, edit: impl FnOnce(&mut HfFolder)) -> std::io::Result<PathBuf> {
    let mut h = HfFolder::tiny_llama();
    edit(&mut h);
    let path = dir.join(name);
    h.write(&path)?;
    Ok(path)
}

/// An extra f32 tensor whose directory entry has these dimensions (and a few real bytes).
fn extra_tensor(dims: &[u64]) -> GgufTensor {
    GgufTensor {
        name: "evil.weight".into(),
        dims: dims.to_vec(),
        type_id: 0,
        data: vec![0; 64],
        offset: None,
    }
}

/// Writes the valid bases (`base.gguf`, `base-hf/`) and every hostile model into `dir`.
pub fn write_all(dir: &Path) -> std::io::Result<(Vec<PathBuf>, Vec<Case>)> {
    std::fs::create_dir_all(dir)?;
    let bases = vec![gguf(dir, "base", |_| {})?, hf(dir, "base-hf", |_| {})?];
    let mut cases = Vec::new();
    let mut case = |name, what, model, expect| {
        cases.push(Case {
            name,
            what,
            model,
            args: Vec::new(),
            expect,
        })
    };
    // GGUF: counts and lengths the file cannot hold.
    case(
        "gguf-tensor-count",
        "tensor count 2^40",
        gguf(dir, "tensor-count", |g| g.tensor_count = Some(1 << 40))?,
        "tensor count 1099511627776 runs past the end of the file",
    );
    case(
        "gguf-metadata-count",
        "metadata count 2^40",
        gguf(dir, "metadata-count", |g| g.kv_count = Some(1 << 40))?,
        "metadata key count 1099511627776 runs past the end of the file",
    );
    case(
        "gguf-string-length",
        "a string of length 2^62",
        gguf(dir, "string-length", |g| {
            let mut v = 8u32.to_le_bytes().to_vec();
            v.extend_from_slice(&(1u64 << 62).to_le_bytes());
            g.raw_entries.push(raw_entry("general.name", &v));
        })?,
        "`general.name`: a string of length 4611686018427387904 runs past the end",
    );
    case(
        "gguf-array-length",
        "an array of 2^40 elements",
        gguf(dir, "array-length", |g| {
            let mut v = 9u32.to_le_bytes().to_vec();
            v.extend_from_slice(&0u32.to_le_bytes());
            v.extend_from_slice(&(1u64 << 40).to_le_bytes());
            g.raw_entries.push(raw_entry("general.tags", &v));
        })?,
        "`general.tags`: an array of length 1099511627776 runs past the end",
    );
    case(
        "gguf-nested-arrays",
        "arrays nested 6 deep",
        gguf(dir, "nested-arrays", |g| {
            let mut v = GgufValue::U8(1);
            for _ in 0..6 {
                v = GgufValue::Array(vec![v]);
            }
            *g = g.clone().set("general.nested", v);
        })?,
        "`general.nested`: arrays nested more than 4 deep",
    );
    case(
        "gguf-truncated",
        "the header cut short",
        {
            let (bytes, metadata_end) = Gguf::tiny_llama().bytes();
            let path = dir.join("truncated.gguf");
            std::fs::write(&path, &bytes[..metadata_end * 2 / 3])?;
            path
        },
        "truncated",
    );
    case(
        "gguf-vocab-50m",
        "a token list of 50M declared",
        gguf(dir, "vocab-50m", |g| {
            let mut v = 9u32.to_le_bytes().to_vec();
            v.extend_from_slice(&8u32.to_le_bytes());
            v.extend_from_slice(&50_000_000u64.to_le_bytes());
            g.entries.retain(|(k, _)| k != "tokenizer.ggml.tokens");
            g.raw_entries.push(raw_entry("tokenizer.ggml.tokens", &v));
        })?,
        "`tokenizer.ggml.tokens`: an array of length 50000000 runs past the end",
    );
    case(
        "gguf-vocab-size-50m",
        "llama.vocab_size of 50M",
        gguf(dir, "vocab-size-50m", |g| {
            *g = g
                .clone()
                .set("llama.vocab_size", GgufValue::U32(50_000_000));
        })?,
        "vocab_size 50000000",
    );
    case(
        "gguf-merges-huge",
        "a merge list of 2^36 declared",
        gguf(dir, "merges-huge", |g| {
            let mut v = 9u32.to_le_bytes().to_vec();
            v.extend_from_slice(&8u32.to_le_bytes());
            v.extend_from_slice(&(1u64 << 36).to_le_bytes());
            g.entries.retain(|(k, _)| k != "tokenizer.ggml.merges");
            g.raw_entries.push(raw_entry("tokenizer.ggml.merges", &v));
        })?,
        "`tokenizer.ggml.merges`: an array of length 68719476736 runs past the end",
    );
    // GGUF: a tensor directory that lies about the data.
    case(
        "gguf-dims-overflow",
        "dims whose product overflows u64",
        gguf(dir, "dims-overflow", |g| {
            g.tensors.push(extra_tensor(&[1 << 32, 1 << 32, 1 << 32]))
        })?,
        "dimensions [4294967296, 4294967296, 4294967296] multiply past 64 bits",
    );
    case(
        "gguf-data-past-eof",
        "a 4 GiB tensor in a 70 kB file",
        gguf(dir, "data-past-eof", |g| {
            g.tensors.push(extra_tensor(&[1 << 20, 1 << 10]))
        })?,
        "tensor `evil.weight`: 4294967296 bytes at offset",
        // ... "run past the end of the file"
    );
    case(
        "gguf-unknown-type",
        "an unknown tensor type",
        gguf(dir, "unknown-type", |g| {
            g.tensor("token_embd.weight").type_id = 99
        })?,
        "tensor `token_embd.weight` has GGML type 99",
    );
    case(
        "gguf-overlapping-tensors",
        "two tensors on the same bytes",
        gguf(dir, "overlapping", |g| {
            g.tensor("blk.0.ffn_up.weight").offset = Some(0)
        })?,
        "overlap in the file",
    );
    case(
        "gguf-alignment-zero",
        "general.alignment 0 (a division by zero in candle)",
        gguf(dir, "alignment-zero", |g| {
            *g = g.clone().set("general.alignment", GgufValue::U32(0));
        })?,
        "`general.alignment`",
    );
    case(
        "gguf-spm-long-pieces",
        "SentencePiece pieces of 1..3000 bytes (quadratic merges)",
        gguf(dir, "spm-long-pieces", |g| {
            let tokens: Vec<GgufValue> = (1..=3000)
                .map(|n| GgufValue::String("a".repeat(n)))
                .collect();
            let scores = vec![GgufValue::F32(0.0); tokens.len()];
            *g = g
                .clone()
                .set("tokenizer.ggml.model", GgufValue::String("llama".into()))
                .set("tokenizer.ggml.tokens", GgufValue::Array(tokens))
                .set("tokenizer.ggml.scores", GgufValue::Array(scores));
            g.entries.retain(|(k, _)| k != "tokenizer.ggml.token_type");
        })?,
        "SentencePiece merges to derive",
    );
    // Chat templates that loop, recurse, or print without bound.
    case(
        "template-loops",
        "a template that loops 1e9 times",
        template(
            dir,
            "template-loops",
            "{% for i in range(100000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}",
        )?,
        "ran past its budget of 20000000 instructions",
    );
    case(
        "template-recurses",
        "a macro that calls itself",
        template(
            dir,
            "template-recurses",
            "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        )?,
        "recursion limit exceeded",
    );
    case(
        "template-prints-huge",
        "10 GB printed in 100 kB pieces",
        template(
            dir,
            "template-prints-huge",
            "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",
        )?,
        "the template wrote more than",
    );
    case(
        "template-join-huge",
        "10 GB built by one join",
        template(
            dir,
            "template-join-huge",
            "{{ range(100000) | join('x' * 100000) }}",
        )?,
        "its trial render took more than its 64 MiB of memory",
    );
    case(
        "template-doubles",
        "a string doubled 40 times in a variable",
        template(
            dir,
            "template-doubles",
            "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
        )?,
        "its trial render took more than its 64 MiB of memory",
    );
    case(
        "template-source-2mib",
        "a 2 MiB template",
        template(
            dir,
            "template-source-2mib",
            &format!("{CHATML}{{# {} #}}", "x".repeat(2 << 20)),
        )?,
        "is above the ceiling of 1048576 (--model-limits template-bytes=N raises it)",
    );
    // Safetensors headers and offsets that lie.
    case(
        "st-header-2^60",
        "a safetensors header length of 2^60",
        hf(dir, "st-header-huge", |h| h.header_len = Some(1 << 60))?,
        "a safetensors header of 1152921504606846976 bytes runs past the end of the file",
    );
    case(
        "st-header-past-eof",
        "a header length past the end of the file",
        hf(dir, "st-header-past-eof", |h| {
            h.header_len = Some(h.safetensors().len() as u64)
        })?,
        "runs past the end of the file",
    );
    case(
        "st-offsets-out-of-range",
        "a tensor's bytes at 2^40",
        hf(dir, "st-offsets-out-of-range", |h| {
            let last = h.tensors.last_mut().expect("tensors");
            last.offsets = (last.offsets.0, 1 << 40);
        })?,
        "invalid shape, data type, or offset for tensor",
    );
    case(
        "st-offsets-overlap",
        "a tensor's bytes inside the one before",
        hf(dir, "st-offsets-overlap", |h| {
            // Starts apart, so the safetensors crate's order of them (by offset) is fixed.
            let end = h.tensors[0].offsets.1;
            h.tensors[1].offsets = (end - 64, end + 64);
        })?,
        "invalid offset for tensor `model.norm.weight`",
    );
    case(
        "st-shape-overflow",
        "a shape whose product overflows",
        hf(dir, "st-shape-overflow", |h| {
            h.tensors[1].shape = vec![1 << 32, 1 << 32, 1 << 32];
        })?,
        "overflow computing buffer size from shape",
    );
    // config.json sizes.
    let config =
        |key: &'static str, value: serde_json::Value| move |h: &mut HfFolder| h.config[key] = value;
    case(
        "config-hidden-2^40",
        "hidden_size 2^40",
        hf(
            dir,
            "config-hidden",
            config("hidden_size", (1u64 << 40).into()),
        )?,
        "hidden_size 1099511627776",
    );
    case(
        "config-layers-2^40",
        "num_hidden_layers 2^40",
        hf(
            dir,
            "config-layers",
            config("num_hidden_layers", (1u64 << 40).into()),
        )?,
        "num_hidden_layers 1099511627776",
    );
    case(
        "config-vocab-2^60",
        "vocab_size 2^60",
        hf(
            dir,
            "config-vocab",
            config("vocab_size", (1u64 << 60).into()),
        )?,
        "vocab_size 1152921504606846976",
    );
    case(
        "config-zero-heads",
        "zero attention heads (a division by zero)",
        hf(
            dir,
            "config-zero-heads",
            config("num_attention_heads", 0.into()),
        )?,
        "0 attention heads",
    );
    case(
        "config-past-weights",
        "4096 layers of width 131072 over 70 kB of weights",
        hf(dir, "config-past-weights", |h| {
            h.config["hidden_size"] = 131072.into();
            h.config["num_attention_heads"] = 128.into();
            h.config["num_key_value_heads"] = 8.into();
            h.config["num_hidden_layers"] = 4096.into();
        })?,
        "more than the",
    );
    // tokenizer.json.
    case(
        "tokenizer-id-50m",
        "a token id of 50M in a 259-token vocabulary",
        hf(dir, "tokenizer-id-50m", |h| {
            let mut json: serde_json::Value =
                serde_json::from_str(&h.tokenizer_json).expect("the base's JSON");
            json["model"]["vocab"]["far"] = 50_000_000.into();
            h.tokenizer_json = json.to_string();
        })?,
        "token ids (the largest + 1): 50000001 is above the ceiling of 4194304",
    );
    case(
        "tokenizer-deep-nesting",
        "a tokenizer.json nested 100000 deep",
        hf(dir, "tokenizer-deep-nesting", |h| {
            h.tokenizer_json = format!(
                r#"{{"model":{{"type":"WordLevel","vocab":{{}},"unk_token":{}"a"{}}}}}"#,
                "[".repeat(100_000),
                "]".repeat(100_000)
            );
        })?,
        "recursion limit exceeded",
    );
    // A ceiling that a file within its own length still breaks, lowered by the flag.
    cases.push(Case {
        name: "gguf-merges-over-ceiling",
        what: "300 merges under --model-limits merges=100",
        model: gguf(dir, "merges-300", |g| {
            let merges = (0..300)
                .map(|i| GgufValue::String(format!("a{i} b")))
                .collect();
            *g = g
                .clone()
                .set("tokenizer.ggml.merges", GgufValue::Array(merges));
        })?,
        args: vec!["--model-limits".into(), "merges=100".into()],
        expect: "`tokenizer.ggml.merges`: items: 300 is above the ceiling of 100 (--model-limits merges=N raises it)",
    });
    Ok((bases, cases))
}
