//! Entry points for the fuzz targets of what a model folder controls (`fuzz/`, libFuzzer
//! through cargo-fuzz) and for the tests that replay their corpora on every build: each takes
//! arbitrary bytes and must return, whatever they are, without a panic, an abort or an
//! allocation the bytes did not pay for. Errors are the expected outcome of most inputs and
//! are dropped.

use std::path::Path;
use std::sync::OnceLock;

use candle_core::safetensors::SliceSafetensors;
use tandem_kv::{BLOCK_SIZE, KvDtype, KvLayout};

use crate::backend::cpu::kernels::{QuantKind, RopeTable};
use crate::config::{ModelConfig, WeightFormat};
use crate::model::hf_weights;

/// An HF `config.json`, then everything the engine derives from a config before it reads a
/// weight: the projections' widths, the parameter count, each layer's window, the RoPE tables
/// (sized by `head_dim`) and the KV layout (sized by layers, KV heads and `head_dim`).
pub fn config_json(data: &[u8]) {
    let Ok(json) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(cfg) = ModelConfig::from_hf_json(json) else {
        return;
    };
    let _ = (cfg.q_width(), cfg.kv_width(), cfg.num_parameters());
    let _ = (cfg.attention_scale(), cfg.has_window(), cfg.kv_window());
    let _ = cfg.first_needed_block(cfg.max_position_embeddings);
    // Bounded by the config's layer count, which `validate` bounded.
    for l in 0..cfg.num_hidden_layers {
        let _ = cfg.layer_window(l);
    }
    let rope = RopeTable::new(&cfg);
    let _ = RopeTable::local(&cfg);
    let _ = rope.cos_sin(&[0, cfg.max_position_embeddings - 1]);
    let layout = KvLayout {
        num_layers: cfg.num_hidden_layers,
        num_kv_heads: cfg.num_key_value_heads,
        head_dim: cfg.head_dim,
        block_size: BLOCK_SIZE,
        dtype: KvDtype::F32,
        model_fingerprint: "fuzz".into(),
    };
    let _ = (layout.block_bytes(), layout.token_bytes(), layout.hash());
}

/// The families [`safetensors_header`] loads a file as: one small config each, whose tensors
/// (names and shapes) the committed seeds hold.
pub const SAFETENSORS_FAMILIES: [&str; 6] =
    ["llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text"];

/// The small config of family `i` of [`SAFETENSORS_FAMILIES`] (vocabulary 16, width 8, one
/// layer of two heads of 4 over one KV head, an untied LM head).
pub fn safetensors_config(i: usize) -> &'static ModelConfig {
    static CONFIGS: OnceLock<Vec<ModelConfig>> = OnceLock::new();
    let configs = CONFIGS.get_or_init(|| {
        SAFETENSORS_FAMILIES
            .iter()
            .filter_map(|family| {
                let json = format!(
                    r#"{{"model_type":"{family}","vocab_size":16,"hidden_size":8,
                    "intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":2,
                    "num_key_value_heads":1,"head_dim":4,"max_position_embeddings":64,
                    "tie_word_embeddings":false}}"#
                );
                ModelConfig::from_hf_json(&json).ok()
            })
            .collect()
    });
    &configs[i % configs.len()]
}

/// The weight formats [`safetensors_header`] loads into.
const FORMATS: [WeightFormat; 4] = [
    WeightFormat::Native,
    WeightFormat::F32,
    WeightFormat::Bf16,
    WeightFormat::Quant(QuantKind::Q8_0),
];

/// A `*.safetensors` file of an HF folder (the 8-byte header length, the JSON header of each
/// tensor's dtype, shape and byte range, the data) through the engine's HF loader, as one of
/// the families' small configs into one of the weight formats: the first byte picks both
/// (its low three bits the family, modulo 6; the next two the format), the rest is the file.
pub fn safetensors_header(data: &[u8]) {
    let Some((&pick, file)) = data.split_first() else {
        return;
    };
    let cfg = safetensors_config(usize::from(pick & 7));
    let format = FORMATS[usize::from(pick >> 3 & 3)];
    let Ok(st) = SliceSafetensors::new(file) else {
        return;
    };
    let _ = hf_weights(cfg, format, &st, Path::new("fuzz.safetensors"));
}

#[cfg(test)]
mod tests;
