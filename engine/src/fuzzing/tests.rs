//! The engine's fuzz targets on every build (see `tandem_text::fuzzing::replay`): each
//! replays its committed corpus and regressions, then a bounded, seeded mutation loop.
//! `TANDEM_BLESS=1` writes the generated seeds: a whole safetensors file of each family's
//! small config, and the `config.json` of each supported family.

use tandem_text::fuzzing::replay::{blessing, inputs, run, write_seed};

use super::*;
use crate::config::Architecture;

#[test]
fn safetensors_header_survives_its_corpus() {
    if blessing() {
        bless_safetensors();
    }
    run("safetensors_header", safetensors_header);
}

#[test]
fn config_json_survives_its_corpus() {
    if blessing() {
        bless_configs();
    }
    run("config_json", config_json);
}

/// The seeds reach the end of the loader: each loads whole in every format, so mutations
/// of them explore every check on the way.
#[test]
fn the_safetensors_seeds_load_whole() {
    let seeds: Vec<Vec<u8>> = std::fs::read_dir(replay_dir())
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .map(|p| std::fs::read(p).unwrap())
        .collect();
    assert_eq!(seeds.len(), SAFETENSORS_FAMILIES.len());
    for seed in &seeds {
        let (&pick, file) = seed.split_first().unwrap();
        let st = SliceSafetensors::new(file).unwrap();
        for format in FORMATS {
            let loaded = hf_weights(
                safetensors_config(usize::from(pick & 7)),
                format,
                &st,
                Path::new("seed"),
            );
            // Q8_0 blocks are 32 values wide, the small configs 8 or 16: refused by name.
            match format {
                WeightFormat::Quant(_) => assert!(loaded.is_err()),
                _ => assert!(loaded.is_ok(), "{format}: {:?}", loaded.err()),
            }
        }
    }
    assert!(inputs("safetensors_header").len() >= seeds.len());
}

/// A tensor of another shape than the config gives it is refused by name before its bytes
/// are converted and packed (which allocate many times its size), even when its element
/// count is right.
#[test]
fn a_tensor_of_the_wrong_shape_is_refused_before_it_is_converted() {
    let cfg = safetensors_config(0);
    let mut tensors = hf_tensors(cfg);
    tensors[0].1 = vec![1, cfg.vocab_size * cfg.hidden_size];
    let file = safetensors_file(&tensors, "F32");
    let st = SliceSafetensors::new(&file).unwrap();
    let err = hf_weights(cfg, WeightFormat::F32, &st, Path::new("m"))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("model.embed_tokens.weight: shape [1, 128], expected [16, 8]"),
        "{err}"
    );
}

fn replay_dir() -> std::path::PathBuf {
    tandem_text::fuzzing::replay::fuzz_dir().join("corpus/safetensors_header")
}

/// The HF names and shapes of `cfg`'s tensors, as `hf_weights` reads them.
fn hf_tensors(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let (h, q, kv, f) = (
        cfg.hidden_size,
        cfg.q_width(),
        cfg.kv_width(),
        cfg.intermediate_size,
    );
    let mut t = vec![
        (
            "model.embed_tokens.weight".to_string(),
            vec![cfg.vocab_size, h],
        ),
        ("model.norm.weight".to_string(), vec![h]),
        ("lm_head.weight".to_string(), vec![cfg.vocab_size, h]),
    ];
    for l in 0..cfg.num_hidden_layers {
        let mut add = |s: &str, shape: Vec<usize>| {
            t.push((format!("model.layers.{l}.{s}"), shape));
        };
        add("input_layernorm.weight", vec![h]);
        add("post_attention_layernorm.weight", vec![h]);
        if cfg.arch.is_gemma() {
            add("pre_feedforward_layernorm.weight", vec![h]);
            add("post_feedforward_layernorm.weight", vec![h]);
        }
        if cfg.arch == Architecture::Phi3 {
            add("self_attn.qkv_proj.weight", vec![q + 2 * kv, h]);
            add("mlp.gate_up_proj.weight", vec![2 * f, h]);
        } else {
            add("self_attn.q_proj.weight", vec![q, h]);
            add("self_attn.k_proj.weight", vec![kv, h]);
            add("self_attn.v_proj.weight", vec![kv, h]);
            add("mlp.gate_proj.weight", vec![f, h]);
            add("mlp.up_proj.weight", vec![f, h]);
        }
        add("self_attn.o_proj.weight", vec![h, q]);
        add("mlp.down_proj.weight", vec![h, f]);
        if cfg.attention_bias {
            add("self_attn.q_proj.bias", vec![q]);
            add("self_attn.k_proj.bias", vec![kv]);
            add("self_attn.v_proj.bias", vec![kv]);
        }
        if cfg.qk_norm {
            add("self_attn.q_norm.weight", vec![cfg.head_dim]);
            add("self_attn.k_norm.weight", vec![cfg.head_dim]);
        }
    }
    t
}

/// A safetensors file of `tensors` in `dtype` (F32, F16 or BF16), values in ±1.
fn safetensors_file(tensors: &[(String, Vec<usize>)], dtype: &str) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({ "format": "pt" }));
    let mut data = Vec::new();
    for (name, shape) in tensors {
        let start = data.len();
        for i in 0..shape.iter().product::<usize>() {
            let v = ((i * 7919 + name.len()) % 200) as f32 / 100.0 - 1.0;
            match dtype {
                "F32" => data.extend_from_slice(&v.to_le_bytes()),
                "F16" => data.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
                _ => data.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
            }
        }
        header.insert(
            name.clone(),
            serde_json::json!({ "dtype": dtype, "shape": shape, "data_offsets": [start, data.len()] }),
        );
    }
    let mut json = serde_json::Value::Object(header).to_string().into_bytes();
    // Padded to 8 bytes with spaces, as the safetensors writer does.
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut file = (json.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&json);
    file.extend_from_slice(&data);
    file
}

fn bless_safetensors() {
    let dtypes = ["F32", "BF16", "F16"];
    for (i, family) in SAFETENSORS_FAMILIES.iter().enumerate() {
        let cfg = safetensors_config(i);
        let mut seed = vec![i as u8];
        seed.extend(safetensors_file(&hf_tensors(cfg), dtypes[i % dtypes.len()]));
        write_seed(
            "safetensors_header",
            &format!("{family}.safetensors"),
            &seed,
        );
    }
}

/// The `config.json` of each supported family, as published (SmolLM2-135M, Llama 3.2 1B's
/// RoPE scaling, Qwen2.5, Qwen3, Mistral, Phi-3, Gemma 2 and Gemma 3).
fn bless_configs() {
    let configs = [
        (
            "smollm2",
            r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","vocab_size":49152,"hidden_size":576,"intermediate_size":1536,"num_hidden_layers":30,"num_attention_heads":9,"num_key_value_heads":3,"rms_norm_eps":1e-05,"rope_theta":100000,"max_position_embeddings":8192,"tie_word_embeddings":true,"hidden_act":"silu"}"#,
        ),
        (
            "llama3",
            r#"{"model_type":"llama","vocab_size":128256,"hidden_size":2048,"intermediate_size":8192,"num_hidden_layers":16,"num_attention_heads":32,"num_key_value_heads":8,"head_dim":64,"rms_norm_eps":1e-05,"rope_theta":500000.0,"max_position_embeddings":131072,"tie_word_embeddings":true,"rope_scaling":{"factor":32.0,"high_freq_factor":4.0,"low_freq_factor":1.0,"original_max_position_embeddings":8192,"rope_type":"llama3"},"attention_bias":false,"mlp_bias":false}"#,
        ),
        (
            "qwen2",
            r#"{"model_type":"qwen2","vocab_size":151936,"hidden_size":896,"intermediate_size":4864,"num_hidden_layers":24,"num_attention_heads":14,"num_key_value_heads":2,"rms_norm_eps":1e-06,"rope_theta":1000000.0,"max_position_embeddings":32768,"tie_word_embeddings":true,"sliding_window":32768,"use_sliding_window":false,"hidden_act":"silu"}"#,
        ),
        (
            "qwen3",
            r#"{"model_type":"qwen3","vocab_size":151936,"hidden_size":1024,"intermediate_size":3072,"num_hidden_layers":28,"num_attention_heads":16,"num_key_value_heads":8,"head_dim":128,"rms_norm_eps":1e-06,"rope_theta":1000000,"max_position_embeddings":40960,"tie_word_embeddings":true,"attention_bias":false,"rope_scaling":null,"use_sliding_window":false}"#,
        ),
        (
            "mistral",
            r#"{"model_type":"mistral","vocab_size":32768,"hidden_size":4096,"intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"head_dim":128,"rms_norm_eps":1e-05,"rope_theta":1000000.0,"max_position_embeddings":32768,"sliding_window":4096,"tie_word_embeddings":false,"hidden_act":"silu"}"#,
        ),
        (
            "phi3",
            r#"{"model_type":"phi3","vocab_size":32064,"hidden_size":3072,"intermediate_size":8192,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":32,"rms_norm_eps":1e-05,"rope_theta":10000.0,"max_position_embeddings":4096,"sliding_window":2047,"tie_word_embeddings":false,"partial_rotary_factor":1.0,"rope_scaling":null}"#,
        ),
        (
            "gemma2",
            r#"{"model_type":"gemma2","vocab_size":256000,"hidden_size":2304,"intermediate_size":9216,"num_hidden_layers":26,"num_attention_heads":8,"num_key_value_heads":4,"head_dim":256,"rms_norm_eps":1e-06,"rope_theta":10000.0,"max_position_embeddings":8192,"hidden_activation":"gelu_pytorch_tanh","query_pre_attn_scalar":256,"attn_logit_softcapping":50.0,"final_logit_softcapping":30.0,"sliding_window":4096}"#,
        ),
        (
            "gemma3_text",
            r#"{"model_type":"gemma3_text","vocab_size":262144,"hidden_size":1152,"intermediate_size":6912,"num_hidden_layers":6,"num_attention_heads":4,"num_key_value_heads":1,"head_dim":256,"rms_norm_eps":1e-06,"rope_theta":1000000.0,"rope_local_base_freq":10000.0,"max_position_embeddings":32768,"hidden_activation":"gelu_pytorch_tanh","query_pre_attn_scalar":256,"sliding_window":512,"layer_types":["sliding_attention","sliding_attention","sliding_attention","sliding_attention","sliding_attention","full_attention"],"rope_scaling":{"rope_type":"linear","factor":8.0}}"#,
        ),
    ];
    for (name, json) in configs {
        assert!(
            ModelConfig::from_hf_json(json).is_ok(),
            "{name}: {:?}",
            ModelConfig::from_hf_json(json).err()
        );
        write_seed("config_json", &format!("{name}.json"), json.as_bytes());
    }
}
