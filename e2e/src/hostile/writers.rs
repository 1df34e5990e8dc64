//! Byte-level writers of the two model formats, so that a hostile file can be exactly one
//! defect away from a valid one: a GGUF (metadata, raw key/value bytes, a tensor directory
//! whose fields can lie, the data) and an HF folder (`config.json`, a safetensors file whose
//! header can lie, `tokenizer.json`, `tokenizer_config.json`). The valid bases are a tiny
//! Llama (one layer, hidden 32) with the built-in byte-level vocabulary and a ChatML template.

use std::path::Path;

use tandem_text::TextTokenizer;
use tandem_text::gguf::{GgufValue, write_metadata};

/// Hidden width, MLP width, heads, KV heads and head width of the bases.
pub const HIDDEN: u64 = 32;
pub const FFN: u64 = 64;
pub const HEADS: u64 = 4;
pub const KV_HEADS: u64 = 2;
pub const HEAD_DIM: u64 = HIDDEN / HEADS;

/// The ChatML template both bases carry.
pub const CHATML: &str = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// The built-in byte-level vocabulary: three specials, then one token per byte.
pub fn vocabulary() -> Vec<String> {
    let tok = TextTokenizer::byte_level();
    (0..tok.vocab_size() as u32)
        .map(|id| tok.id_to_token(id).expect("ids are dense"))
        .collect()
}

/// One tensor of a GGUF file: its dimensions innermost first, GGML type, and data.
#[derive(Debug, Clone)]
pub struct GgufTensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub type_id: u32,
    pub data: Vec<u8>,
    /// Where the directory says its data is (relative to the data section); `None`: where the
    /// writer puts it.
    pub offset: Option<u64>,
}

/// A GGUF file, field by field.
#[derive(Debug, Clone)]
pub struct Gguf {
    pub entries: Vec<(String, GgufValue)>,
    /// Key/value pairs written as given, after `entries` (hostile encodings).
    pub raw_entries: Vec<Vec<u8>>,
    pub tensors: Vec<GgufTensor>,
    /// Counts the header states, when they should lie.
    pub tensor_count: Option<u64>,
    pub kv_count: Option<u64>,
}

impl Gguf {
    /// The valid base: a one-layer Llama of f32 tensors (tied embeddings) with a byte-level
    /// BPE vocabulary (no merges) and a ChatML template.
    pub fn tiny_llama() -> Self {
        let vocab = vocabulary();
        let n = vocab.len() as u64;
        let s = |v: &str| GgufValue::String(v.into());
        let u = GgufValue::U32;
        let types = (0..vocab.len())
            .map(|i| GgufValue::I32(if i < 3 { 3 } else { 1 }))
            .collect();
        let entries = vec![
            ("general.architecture", s("llama")),
            ("llama.block_count", u(1)),
            ("llama.embedding_length", u(HIDDEN as u32)),
            ("llama.feed_forward_length", u(FFN as u32)),
            ("llama.attention.head_count", u(HEADS as u32)),
            ("llama.attention.head_count_kv", u(KV_HEADS as u32)),
            ("llama.context_length", u(256)),
            (
                "llama.attention.layer_norm_rms_epsilon",
                GgufValue::F32(1e-5),
            ),
            ("llama.rope.freq_base", GgufValue::F32(10000.0)),
            ("tokenizer.ggml.model", s("gpt2")),
            (
                "tokenizer.ggml.tokens",
                GgufValue::Array(vocab.iter().map(|t| s(t)).collect()),
            ),
            ("tokenizer.ggml.token_type", GgufValue::Array(types)),
            ("tokenizer.ggml.merges", GgufValue::Array(Vec::new())),
            ("tokenizer.ggml.eos_token_id", u(2)),
            ("tokenizer.chat_template", s(CHATML)),
        ];
        let f32s = |name: &str, dims: &[u64]| {
            let count: u64 = dims.iter().product();
            let data = (0..count)
                .flat_map(|i| (((i * 7919) % 97) as f32 / 97.0 - 0.5).to_le_bytes())
                .collect();
            GgufTensor {
                name: name.into(),
                dims: dims.to_vec(),
                type_id: 0,
                data,
                offset: None,
            }
        };
        let norm = |name: &str| GgufTensor {
            data: [1f32; HIDDEN as usize]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            ..f32s(name, &[HIDDEN])
        };
        let (q, kv) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
        let tensors = vec![
            f32s("token_embd.weight", &[HIDDEN, n]),
            norm("output_norm.weight"),
            norm("blk.0.attn_norm.weight"),
            f32s("blk.0.attn_q.weight", &[HIDDEN, q]),
            f32s("blk.0.attn_k.weight", &[HIDDEN, kv]),
            f32s("blk.0.attn_v.weight", &[HIDDEN, kv]),
            f32s("blk.0.attn_output.weight", &[q, HIDDEN]),
            norm("blk.0.ffn_norm.weight"),
            f32s("blk.0.ffn_gate.weight", &[HIDDEN, FFN]),
            f32s("blk.0.ffn_up.weight", &[HIDDEN, FFN]),
            f32s("blk.0.ffn_down.weight", &[FFN, HIDDEN]),
        ];
        Self {
            entries: entries
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
            raw_entries: Vec::new(),
            tensors,
            tensor_count: None,
            kv_count: None,
        }
    }

    /// Replaces the value of `key` (or adds it).
    pub fn set(mut self, key: &str, value: GgufValue) -> Self {
        match self.entries.iter_mut().find(|(k, _)| k == key) {
            Some(entry) => entry.1 = value,
            None => self.entries.push((key.to_string(), value)),
        }
        self
    }

    /// The tensor named `name`.
    pub fn tensor(&mut self, name: &str) -> &mut GgufTensor {
        self.tensors
            .iter_mut()
            .find(|t| t.name == name)
            .expect("a tensor of the base")
    }

    /// The file's bytes, and where its metadata ends (for cutting it short).
    pub fn bytes(&self) -> (Vec<u8>, usize) {
        let entries: Vec<(&str, GgufValue)> = self
            .entries
            .iter()
            .map(|(k, v)| (k.as_str(), v.clone()))
            .collect();
        let mut out = Vec::new();
        write_metadata(&mut out, &entries, self.tensors.len() as u64).expect("in memory");
        for raw in &self.raw_entries {
            out.extend_from_slice(raw);
        }
        let kvs = self
            .kv_count
            .unwrap_or((entries.len() + self.raw_entries.len()) as u64);
        out[16..24].copy_from_slice(&kvs.to_le_bytes());
        if let Some(n) = self.tensor_count {
            out[8..16].copy_from_slice(&n.to_le_bytes());
        }
        let metadata_end = out.len();
        let mut offset = 0u64;
        let mut placed = Vec::new();
        for t in &self.tensors {
            out.extend_from_slice(&(t.name.len() as u64).to_le_bytes());
            out.extend_from_slice(t.name.as_bytes());
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            t.dims
                .iter()
                .for_each(|d| out.extend_from_slice(&d.to_le_bytes()));
            out.extend_from_slice(&t.type_id.to_le_bytes());
            out.extend_from_slice(&t.offset.unwrap_or(offset).to_le_bytes());
            placed.push(offset);
            offset = (offset + t.data.len() as u64).next_multiple_of(32);
        }
        out.resize(out.len().next_multiple_of(32), 0);
        let data_start = out.len();
        for (t, at) in self.tensors.iter().zip(placed) {
            out.resize(data_start + at as usize, 0);
            out.extend_from_slice(&t.data);
        }
        (out, metadata_end)
    }

    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        std::fs::write(path, self.bytes().0)
    }
}

/// A key/value pair's bytes: the key, then `value` (a type id and its encoding) as given.
pub fn raw_entry(key: &str, value: &[u8]) -> Vec<u8> {
    let mut out = (key.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(value);
    out
}

/// One tensor of a safetensors file, its header fields free to lie.
#[derive(Debug, Clone)]
pub struct StTensor {
    pub name: String,
    pub shape: Vec<u64>,
    pub offsets: (u64, u64),
}

/// The HF folder of the same tiny Llama: its config, its tensors (f32), `tokenizer.json` and
/// `tokenizer_config.json`.
#[derive(Debug, Clone)]
pub struct HfFolder {
    pub config: serde_json::Value,
    pub tensors: Vec<StTensor>,
    /// The header's stated length, when it should lie.
    pub header_len: Option<u64>,
    pub tokenizer_json: String,
    pub tokenizer_config: serde_json::Value,
}

impl HfFolder {
    pub fn tiny_llama() -> Self {
        let vocab = vocabulary().len() as u64;
        let config = serde_json::json!({
            "model_type": "llama", "vocab_size": vocab, "hidden_size": HIDDEN,
            "intermediate_size": FFN, "num_hidden_layers": 1, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "max_position_embeddings": 256,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": true,
        });
        let (q, kv) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
        let p = |s: &str| format!("model.layers.0.{s}.weight");
        let shapes: Vec<(String, Vec<u64>)> = vec![
            ("model.embed_tokens.weight".into(), vec![vocab, HIDDEN]),
            ("model.norm.weight".into(), vec![HIDDEN]),
            (p("input_layernorm"), vec![HIDDEN]),
            (p("post_attention_layernorm"), vec![HIDDEN]),
            (p("self_attn.q_proj"), vec![q, HIDDEN]),
            (p("self_attn.k_proj"), vec![kv, HIDDEN]),
            (p("self_attn.v_proj"), vec![kv, HIDDEN]),
            (p("self_attn.o_proj"), vec![HIDDEN, q]),
            (p("mlp.gate_proj"), vec![FFN, HIDDEN]),
            (p("mlp.up_proj"), vec![FFN, HIDDEN]),
            (p("mlp.down_proj"), vec![HIDDEN, FFN]),
        ];
        let mut at = 0;
        let tensors = shapes
            .into_iter()
            .map(|(name, shape)| {
                let bytes = 4 * shape.iter().product::<u64>();
                at += bytes;
                StTensor {
                    name,
                    shape,
                    offsets: (at - bytes, at),
                }
            })
            .collect();
        Self {
            config,
            tensors,
            header_len: None,
            tokenizer_json: TextTokenizer::byte_level()
                .to_json()
                .expect("the built-in tokenizer"),
            tokenizer_config: serde_json::json!({ "chat_template": CHATML }),
        }
    }

    /// The safetensors file: the header (padded to 8 bytes), then the data section, as long
    /// as the largest end offset the header states, capped at 1 MiB (a lie stays a lie).
    pub fn safetensors(&self) -> Vec<u8> {
        let mut header = serde_json::Map::new();
        for t in &self.tensors {
            header.insert(
                t.name.clone(),
                serde_json::json!({
                    "dtype": "F32", "shape": t.shape, "data_offsets": [t.offsets.0, t.offsets.1],
                }),
            );
        }
        let mut json = serde_json::Value::Object(header).to_string().into_bytes();
        json.resize(json.len().next_multiple_of(8), b' ');
        let len = self.header_len.unwrap_or(json.len() as u64);
        let mut out = len.to_le_bytes().to_vec();
        out.extend_from_slice(&json);
        let data = self
            .tensors
            .iter()
            .map(|t| t.offsets.1)
            .max()
            .unwrap_or(0)
            .min(1 << 20);
        out.extend((0..data).map(|i| [0x00, 0x00, 0x80, 0x3f][i as usize % 4]));
        out
    }

    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("config.json"), self.config.to_string())?;
        std::fs::write(dir.join("model.safetensors"), self.safetensors())?;
        std::fs::write(dir.join("tokenizer.json"), &self.tokenizer_json)?;
        std::fs::write(
            dir.join("tokenizer_config.json"),
            self.tokenizer_config.to_string(),
        )
    }
}
