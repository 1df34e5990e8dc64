//! Config parsing, presets and refusals.

use super::*;
use crate::backend::cpu::kernels::QuantKind;

#[test]
fn presets_are_valid_and_sized() {
    for name in ModelConfig::PRESETS {
        let cfg = ModelConfig::preset(name).unwrap();
        cfg.validate().unwrap();
    }
    // Published sizes: Qwen2.5-0.5B 494 M parameters, Qwen3-0.6B 596 M (tied embeddings).
    let q25 = ModelConfig::preset("qwen2.5-0.5b")
        .unwrap()
        .num_parameters();
    assert!((490_000_000..498_000_000).contains(&q25), "{q25}");
    let q3 = ModelConfig::preset("qwen3-0.6b").unwrap().num_parameters();
    assert!((592_000_000..600_000_000).contains(&q3), "{q3}");
    // Mistral-7B-v0.3 7.25 B, Phi-3-mini 3.82 B.
    let m7 = ModelConfig::preset("mistral-7b").unwrap().num_parameters();
    assert!((7_240_000_000..7_260_000_000).contains(&m7), "{m7}");
    let phi = ModelConfig::preset("phi3-mini").unwrap().num_parameters();
    assert!((3_815_000_000..3_830_000_000).contains(&phi), "{phi}");
    let smol = ModelConfig::preset("smollm2-135m").unwrap();
    let params = smol.num_parameters();
    assert!((134_000_000..136_000_000).contains(&params), "{params}");
    let l8 = ModelConfig::preset("llama-3.1-8b").unwrap();
    assert!((8_000_000_000..8_100_000_000).contains(&l8.num_parameters()));
    assert!(ModelConfig::preset("gpt-5").is_err());
}

#[test]
fn parses_hf_config() {
    let json = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","vocab_size":49152,"hidden_size":576,
        "intermediate_size":1536,"num_hidden_layers":30,"num_attention_heads":9,"num_key_value_heads":3,
        "rms_norm_eps":1e-05,"rope_theta":100000,"max_position_embeddings":8192,"tie_word_embeddings":true}"#;
    let cfg = ModelConfig::from_hf_json(json).unwrap();
    assert_eq!(cfg, ModelConfig::preset("smollm2-135m").unwrap());
    let scaled = r#"{"vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,
        "num_attention_heads":2,"rope_scaling":{"rope_type":"llama3","factor":32.0,"low_freq_factor":1.0,
        "high_freq_factor":4.0,"original_max_position_embeddings":8192}}"#;
    assert!(matches!(
        ModelConfig::from_hf_json(scaled).unwrap().rope_scaling,
        Some(RopeScaling::Llama3 { factor: 32.0, .. })
    ));
    let linear = scaled.replace(r#""rope_type":"llama3""#, r#""rope_type":"linear""#);
    assert_eq!(
        ModelConfig::from_hf_json(&linear).unwrap().rope_scaling,
        Some(RopeScaling::Linear { factor: 32.0 })
    );
    assert!(ModelConfig::from_hf_json(r#"{"model_type":"gpt2"}"#).is_err());
    let bad_heads = r#"{"vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,
        "num_attention_heads":3,"num_key_value_heads":2}"#;
    assert!(matches!(
        ModelConfig::from_hf_json(bad_heads),
        Err(EngineError::Config(_))
    ));
}

#[test]
fn families_from_hf_config() {
    let base = |extra: &str| {
        format!(
            r#"{{"vocab_size":151936,"hidden_size":896,"intermediate_size":4864,
            "num_hidden_layers":24,"num_attention_heads":14,"num_key_value_heads":2,
            "rms_norm_eps":1e-06,"rope_theta":1000000.0,"max_position_embeddings":32768,
            "tie_word_embeddings":true,"sliding_window":32768,"use_sliding_window":false,
            {extra}}}"#
        )
    };
    let qwen2 = ModelConfig::from_hf_json(&base(r#""model_type":"qwen2""#)).unwrap();
    assert_eq!(qwen2, ModelConfig::preset("qwen2.5-0.5b").unwrap());
    let qwen3 = ModelConfig::from_hf_json(&base(
        r#""model_type":"qwen3","head_dim":128,"attention_bias":false"#,
    ))
    .unwrap();
    assert!(qwen3.qk_norm && !qwen3.attention_bias && qwen3.head_dim == 128);
    assert_eq!(qwen3.arch, Architecture::Qwen3);

    // Mistral's window is kept (every layer windowed), the context is the model's.
    let mistral = |window: &str| {
        ModelConfig::from_hf_json(&format!(
            r#"{{"model_type":"mistral","vocab_size":32000,"hidden_size":64,
            "intermediate_size":128,"num_hidden_layers":1,"num_attention_heads":4,
            "num_key_value_heads":2,"max_position_embeddings":32768,"sliding_window":{window}}}"#
        ))
        .unwrap()
    };
    let windowed = mistral("4096");
    assert_eq!(windowed.max_position_embeddings, 32768);
    assert_eq!(
        (windowed.layer_window(0), windowed.has_window()),
        (Some(4096), true)
    );
    assert_eq!(mistral("null").layer_window(0), None);
    let phi3 = ModelConfig::from_hf_json(
        &base(r#""model_type":"phi3","sliding_window":2047"#)
            .replace(r#""sliding_window":32768,"#, ""),
    )
    .unwrap();
    assert_eq!(
        (phi3.arch, phi3.max_position_embeddings, phi3.sliding_window),
        (Architecture::Phi3, 32768, Some(2047))
    );

    // What no family here runs is refused by name.
    for (extra, named) in [
        (
            r#""model_type":"qwen2","use_sliding_window":true"#,
            "use_sliding_window",
        ),
        (r#""model_type":"llama","mlp_bias":true"#, "mlp_bias"),
        (r#""model_type":"gemma""#, "gemma"),
        (r#""model_type":"gemma3""#, "multimodal"),
        (r#""model_type":"llama","hidden_act":"gelu""#, "gelu"),
        (
            r#""model_type":"gemma2","hidden_activation":"relu""#,
            "relu",
        ),
        (
            r#""model_type":"llama","final_logit_softcapping":30.0"#,
            "soft-capping",
        ),
        (
            r#""model_type":"gemma3_text","layer_types":["sliding_attention","full_attention","full_attention"]"#,
            "layer_types",
        ),
        (
            r#""model_type":"qwen2","rope_scaling":{"type":"yarn","factor":4.0}"#,
            "yarn",
        ),
        (
            r#""model_type":"phi3","rope_scaling":{"type":"longrope","short_factor":[1.0],"long_factor":[1.0]}"#,
            "longrope",
        ),
        (
            r#""model_type":"phi3","partial_rotary_factor":0.75"#,
            "partial_rotary_factor",
        ),
    ] {
        let json = base(extra).replace(r#""use_sliding_window":false,"#, "");
        let err = ModelConfig::from_hf_json(&json).unwrap_err().to_string();
        assert!(err.contains(named), "{extra}: {err}");
    }
}

#[test]
fn families_from_gguf_metadata() {
    use tandem_text::gguf::{GgufMetadata, GgufValue};
    let meta = |arch: &str, extra: &[(&str, GgufValue)]| {
        let mut m = GgufMetadata::default();
        let mut put = |k: &str, v: GgufValue| m.entries.insert(k.to_string(), v);
        put("general.architecture", GgufValue::String(arch.into()));
        for (k, v) in [
            ("block_count", 28u64),
            ("context_length", 40960),
            ("embedding_length", 1024),
            ("feed_forward_length", 3072),
            ("attention.head_count", 16),
            ("attention.head_count_kv", 8),
            ("attention.key_length", 128),
            ("vocab_size", 151936),
        ] {
            put(&format!("{arch}.{k}"), GgufValue::U64(v));
        }
        put(&format!("{arch}.rope.freq_base"), GgufValue::F32(1e6));
        put(
            &format!("{arch}.attention.layer_norm_rms_epsilon"),
            GgufValue::F32(1e-6),
        );
        for (k, v) in extra {
            put(k, v.clone());
        }
        m
    };
    let none = |_: &str| false;
    let qwen3 = ModelConfig::from_gguf(&meta("qwen3", &[]), &none).unwrap();
    // GGUF stores the epsilon as an f32.
    let want = ModelConfig {
        rms_norm_eps: f64::from(1e-6f32),
        ..ModelConfig::preset("qwen3-0.6b").unwrap()
    };
    assert_eq!(qwen3, want);
    let bias = |name: &str| name == "blk.0.attn_q.bias";
    let qwen2 = ModelConfig::from_gguf(&meta("qwen2", &[]), &bias).unwrap();
    assert!(qwen2.attention_bias && !qwen2.qk_norm && qwen2.arch == Architecture::Qwen2);
    let err = ModelConfig::from_gguf(&meta("gemma", &[]), &none).unwrap_err();
    assert!(err.to_string().contains("`gemma`"), "{err}");
    // Gemma 2 and 3: llama.cpp's keys, and its defaults where none is written.
    let gemma2 = ModelConfig::from_gguf(
        &meta(
            "gemma2",
            &[
                ("gemma2.attention.sliding_window", GgufValue::U64(4096)),
                ("gemma2.attn_logit_softcapping", GgufValue::F32(50.0)),
                ("gemma2.final_logit_softcapping", GgufValue::F32(30.0)),
            ],
        ),
        &none,
    )
    .unwrap();
    assert_eq!(
        (
            gemma2.layer_window(0),
            gemma2.layer_window(1),
            gemma2.attn_logit_softcapping,
            gemma2.final_logit_softcapping,
            gemma2.query_pre_attn_scalar,
            gemma2.activation,
        ),
        (
            Some(4096),
            None,
            Some(50.0),
            Some(30.0),
            Some(128.0),
            Activation::GeluTanh
        )
    );
    let linear = [
        ("gemma3.attention.sliding_window", GgufValue::U64(512)),
        (
            "gemma3.rope.scaling.type",
            GgufValue::String("linear".into()),
        ),
        ("gemma3.rope.scaling.factor", GgufValue::F32(8.0)),
    ];
    let gemma3 = ModelConfig::from_gguf(&meta("gemma3", &linear), &none).unwrap();
    assert!(gemma3.qk_norm && gemma3.rope_local_theta == Some(10_000.0));
    assert_eq!(
        gemma3.rope_scaling,
        Some(RopeScaling::Linear { factor: 8.0 })
    );
    let windows: Vec<bool> = (0..12).map(|l| gemma3.layer_window(l).is_some()).collect();
    assert_eq!(windows.iter().filter(|w| !**w).count(), 2);
    assert!(!windows[5] && !windows[11]);
    let longrope = |name: &str| name == "rope_factors_long.weight";
    let err = ModelConfig::from_gguf(&meta("phi3", &[]), &longrope).unwrap_err();
    assert!(err.to_string().contains("longrope"), "{err}");
    let partial = [("phi3.rope.dimension_count", GgufValue::U64(96))];
    let err = ModelConfig::from_gguf(&meta("phi3", &partial), &none).unwrap_err();
    assert!(err.to_string().contains("96 of 128"), "{err}");
    let yarn = [("qwen2.rope.scaling.type", GgufValue::String("yarn".into()))];
    let err = ModelConfig::from_gguf(&meta("qwen2", &yarn), &bias).unwrap_err();
    assert!(err.to_string().contains("yarn"), "{err}");
}

#[test]
fn dtype_names() {
    assert_eq!("BF16".parse::<WeightFormat>().unwrap(), WeightFormat::Bf16);
    assert_eq!(
        "Q4_K".parse::<WeightFormat>().unwrap(),
        WeightFormat::Quant(QuantKind::Q4K)
    );
    for f in [
        "native", "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k",
    ] {
        assert_eq!(f.parse::<WeightFormat>().unwrap().name(), f);
    }
    assert!("int4".parse::<WeightFormat>().is_err());
}

#[test]
fn gemma_from_hf_config() {
    // Gemma 2 2B's config.json (the keys that matter).
    let gemma2 = r#"{"architectures":["Gemma2ForCausalLM"],"model_type":"gemma2",
        "attention_bias":false,"attn_logit_softcapping":50.0,"final_logit_softcapping":30.0,
        "head_dim":256,"hidden_act":"gelu_pytorch_tanh","hidden_activation":"gelu_pytorch_tanh",
        "hidden_size":2304,"intermediate_size":9216,"max_position_embeddings":8192,
        "num_attention_heads":8,"num_hidden_layers":26,"num_key_value_heads":4,
        "query_pre_attn_scalar":256,"rms_norm_eps":1e-06,"rope_theta":10000.0,
        "sliding_window":4096,"vocab_size":256000}"#;
    assert_eq!(
        ModelConfig::from_hf_json(gemma2).unwrap(),
        ModelConfig::preset("gemma2-2b").unwrap()
    );
    // Gemma 3 1B's, in its older (sliding_window_pattern) and newer (layer_types) spellings.
    let gemma3 = r#"{"architectures":["Gemma3ForCausalLM"],"model_type":"gemma3_text",
        "attention_bias":false,"attn_logit_softcapping":null,"final_logit_softcapping":null,
        "head_dim":256,"hidden_activation":"gelu_pytorch_tanh","hidden_size":1152,
        "intermediate_size":6912,"max_position_embeddings":32768,"num_attention_heads":4,
        "num_hidden_layers":26,"num_key_value_heads":1,"query_pre_attn_scalar":256,
        "rms_norm_eps":1e-06,"rope_local_base_freq":10000,"rope_scaling":null,
        "rope_theta":1000000,"sliding_window":512,"sliding_window_pattern":6,
        "vocab_size":262144}"#;
    let preset = ModelConfig::preset("gemma3-1b").unwrap();
    assert_eq!(ModelConfig::from_hf_json(gemma3).unwrap(), preset);
    let types: Vec<&str> = (0..26)
        .map(|l| {
            if (l + 1) % 6 == 0 {
                "full_attention"
            } else {
                "sliding_attention"
            }
        })
        .collect();
    let newer = gemma3.replace(
        r#""sliding_window_pattern":6"#,
        &format!(
            r#""layer_types":{}"#,
            serde_json::to_string(&types).unwrap()
        ),
    );
    assert_eq!(ModelConfig::from_hf_json(&newer).unwrap(), preset);
    // Layer 5, 11, ... attend globally; the rest through the 512-key window.
    assert_eq!(
        (preset.layer_window(4), preset.layer_window(5)),
        (Some(512), None)
    );
    // Published sizes: Gemma 2 2B 2.61 B parameters, Gemma 3 1B 1.00 B.
    let g2 = ModelConfig::preset("gemma2-2b").unwrap().num_parameters();
    assert!((2_610_000_000..2_620_000_000).contains(&g2), "{g2}");
    let g3 = preset.num_parameters();
    assert!((999_000_000..1_001_000_000).contains(&g3), "{g3}");
    assert_eq!(preset.attention_scale(), 1.0 / 16.0);
}

/// Sizes past `SIZE_BOUNDS` and non-positive constants are refused by name, before anything
/// is sized from them (a head_dim of 2^62 once sized a RoPE table of 2^61 floats, a layer
/// count of 2^40 looped that many times, and a vocabulary of 2^60 overflowed the count of
/// parameters).
#[test]
fn extreme_sizes_and_constants_are_refused() {
    let base = r#""vocab_size":32000,"hidden_size":64,"intermediate_size":128,
        "num_hidden_layers":2,"num_attention_heads":4"#;
    for (extra, named) in [
        (r#","head_dim":4611686018427387904"#, "head_dim"),
        (r#","num_key_value_heads":8192"#, "num_key_value_heads"),
        (
            r#","max_position_embeddings":1099511627776"#,
            "max_position_embeddings",
        ),
        (r#","rope_theta":0"#, "positive"),
        (r#","rms_norm_eps":-1"#, "positive"),
        (
            r#","rope_scaling":{"rope_type":"llama3","factor":-8}"#,
            "rope_scaling",
        ),
    ] {
        let json = format!("{{{base}{extra}}}");
        match ModelConfig::from_hf_json(&json) {
            Err(EngineError::Config(m)) => assert!(m.contains(named), "{extra}: {m}"),
            other => panic!("{extra}: {other:?}"),
        }
    }
    let huge = base.replace("32000", "1152921504606846976");
    assert!(ModelConfig::from_hf_json(&format!("{{{huge}}}")).is_err());
    let layers = base.replace(
        r#""num_hidden_layers":2"#,
        r#""num_hidden_layers":1099511627776"#,
    );
    assert!(ModelConfig::from_hf_json(&format!("{{{layers}}}")).is_err());
}
