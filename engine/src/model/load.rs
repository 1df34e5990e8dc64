//! Where weights come from: a GGUF file (`gguf`), an HF folder of safetensors (`hf`),
//! seeded dummy weights of any shape, or the default SmolLM2 fetched into the cache.

use std::path::PathBuf;

use rayon::prelude::*;
use tandem_text::{Ceiling, ModelLimits, TextTokenizer};

use super::Model;
use super::bounds::check_hf_folder;
use super::gguf::{load_gguf, load_gguf_model};
use super::hf::load_hf_model;
use super::identity::fingerprint;
use super::tensors::{FileDtype, Loaded, into_matrix};
use super::trial::trial_render;
use super::weights::{LayerExtras, LayerWeights, Weights};
use crate::config::{ModelConfig, WeightFormat};
use crate::error::{EngineError, Result};
use crate::fetch;
use tandem_kv::KvDtype;

/// What to load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// SmolLM2-135M-Instruct (GGUF), fetched into the cache folder on first use.
    DefaultSmolLm2,
    /// Seeded random weights of a preset shape.
    Dummy { preset: String, seed: u64 },
    /// An HF folder or a GGUF file.
    Path(PathBuf),
}

impl std::str::FromStr for ModelSource {
    type Err = EngineError;

    /// `smollm2`, `tiny`, `dummy:PRESET[:SEED]`, or a path.
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "smollm2" | "default" | "smollm2-135m-instruct" => Ok(ModelSource::DefaultSmolLm2),
            "tiny" => Ok(ModelSource::Dummy {
                preset: "tiny".into(),
                seed: 0,
            }),
            _ => {
                if let Some(rest) = s.strip_prefix("dummy:") {
                    let (preset, seed) = match rest.split_once(':') {
                        Some((p, seed)) => (
                            p,
                            seed.parse().map_err(|_| {
                                EngineError::Config(format!("bad dummy seed `{seed}`"))
                            })?,
                        ),
                        None => (rest, 0),
                    };
                    ModelConfig::preset(preset)?;
                    return Ok(ModelSource::Dummy {
                        preset: preset.into(),
                        seed,
                    });
                }
                let path = PathBuf::from(s);
                if !path.exists() {
                    return Err(EngineError::Config(format!(
                        "model `{s}` is neither a known name (smollm2, tiny, dummy:PRESET) nor an existing path"
                    )));
                }
                Ok(ModelSource::Path(path))
            }
        }
    }
}

/// How to load.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// How to store the weights (`--weights`).
    pub format: WeightFormat,
    /// Where the default model is cached.
    pub cache_dir: PathBuf,
    /// Element type of the KV cache (f32 unless asked).
    pub kv_dtype: KvDtype,
    /// A tokenizer to use instead of the model's own (required for realistic token counts
    /// with dummy weights of real shapes).
    pub tokenizer: Option<PathBuf>,
    /// The ceilings on what the model's files may declare (`--model-limits`).
    pub limits: ModelLimits,
}

/// Loads a model and its tokenizer.
pub fn load_model(source: &ModelSource, opts: &LoadOptions) -> Result<(Model, TextTokenizer)> {
    // The source's own tokenizer, unless one is given (then a GGUF's vocabulary is not even
    // rebuilt, so a file whose tokenizer model this build lacks still loads).
    let (model, own_tokenizer) = match source {
        ModelSource::DefaultSmolLm2 => {
            let path = fetch::ensure_smollm2(&opts.cache_dir)?;
            let name = "SmolLM2-135M-Instruct";
            let (model, tokenizer) = load_gguf(&path, opts.format, name, &opts.limits)?;
            (model, Some(tokenizer))
        }
        ModelSource::Dummy { preset, seed } => {
            let cfg = ModelConfig::preset(preset)?;
            let model = dummy_model(cfg, opts.format, *seed, preset)?;
            (model, Some(TextTokenizer::byte_level()))
        }
        ModelSource::Path(path) if path.is_dir() => {
            // Every file of the folder checked against its length and the ceilings before
            // anything is built from it.
            let tokenizer = TextTokenizer::from_hf_dir_with(path, &opts.limits)?;
            check_hf_folder(path, &opts.limits)?;
            (load_hf_model(path, opts.format)?, Some(tokenizer))
        }
        ModelSource::Path(path) => {
            let name = path
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or("model")
                .to_string();
            match &opts.tokenizer {
                Some(_) => (
                    load_gguf_model(path, opts.format, &name, &opts.limits)?,
                    None,
                ),
                None => {
                    let (model, tokenizer) = load_gguf(path, opts.format, &name, &opts.limits)?;
                    (model, Some(tokenizer))
                }
            }
        }
    };
    let model = model.with_kv_dtype(opts.kv_dtype);
    let tokenizer = match (&opts.tokenizer, own_tokenizer) {
        (Some(p), _) => TextTokenizer::from_path_with(p, &opts.limits)?,
        (None, Some(own)) => own,
        (None, None) => return Err(EngineError::Config("the model has no tokenizer".into())),
    };
    refuse_hostile_chat_template(&tokenizer, source, opts)?;
    let vocab = model.config().vocab_size;
    if tokenizer.vocab_size() > vocab {
        return Err(EngineError::Config(format!(
            "tokenizer has {} tokens but the model only {vocab}",
            tokenizer.vocab_size(),
        )));
    }
    // Every id the tokenizer can produce must index the embeddings: a count that fits says
    // nothing of ids spread past them.
    if let Some(id) = tokenizer.max_token_id()
        && id as usize >= vocab
    {
        return Err(EngineError::Config(format!(
            "the tokenizer's token id {id} is outside the model's vocabulary of {vocab}"
        )));
    }
    Ok((model, tokenizer))
}

/// Refuses a model whose chat template runs past the budgets every render gets on sample
/// conversations (it loops or prints without bound: a hostile file), naming the file it came
/// from. A template that merely does not compile is left to the router, which serves
/// completions without it.
fn refuse_hostile_chat_template(
    tokenizer: &TextTokenizer,
    source: &ModelSource,
    opts: &LoadOptions,
) -> Result<()> {
    let info = tokenizer.info();
    let Some(src) = info.chat_template.as_deref() else {
        return Ok(());
    };
    // The file the template came from: a folder's `tokenizer_config.json`, else the file.
    let file = match (&opts.tokenizer, source) {
        (Some(p), _) | (None, ModelSource::Path(p)) if p.is_dir() => {
            p.join("tokenizer_config.json")
        }
        (Some(p), _) | (None, ModelSource::Path(p)) => p.clone(),
        (None, _) => PathBuf::from("the default model"),
    };
    let refused = |e: tandem_text::TextError| {
        EngineError::load(&file, format!("its chat template is refused: {e}"))
    };
    opts.limits
        .check(Ceiling::TemplateBytes, src.len() as u64, "its source bytes")
        .map_err(refused)?;
    // In a child process under a memory ceiling (`trial`): a template that builds gigabytes
    // it never prints takes the child down, not the worker.
    let trial = trial_render(src, info.bos_token.as_deref(), info.eos_token.as_deref());
    match trial {
        Err(e @ tandem_text::TextError::ChatTemplateLimit(_)) => Err(refused(e)),
        _ => Ok(()),
    }
}

/// Seeded random weights: uniform with the standard deviation of a fan-in init, so dummy
/// models produce varied, peaked logits rather than near-ties.
pub fn dummy_model(cfg: ModelConfig, format: WeightFormat, seed: u64, name: &str) -> Result<Model> {
    cfg.validate()?;
    let h = cfg.hidden_size;
    let mut next_id = 0u64;
    let mut matrix = |what: &str, rows: usize, cols: usize, std: f32| {
        next_id += 1;
        let values = seeded_uniform(
            rows * cols,
            seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ next_id,
            std,
        );
        into_matrix(Loaded::from_values(
            what,
            rows,
            cols,
            values,
            FileDtype::F32,
            format,
        )?)
    };
    let fan_in = |n: usize| 1.0 / (n as f32).sqrt();
    let embed = matrix("embed", cfg.vocab_size, h, 1.0)?;
    let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
    for l in 0..cfg.num_hidden_layers {
        // The family's vectors: small random biases, norm weights around 1 (so a test sees
        // whether they are applied).
        let vector = |what: u64, n: usize, center: f32, std: f32| {
            let noise = seeded_uniform(n, seed ^ (what << 32) ^ l as u64, std);
            noise.into_iter().map(|v| center + v).collect::<Vec<f32>>()
        };
        let qkv_rows = cfg.q_width() + 2 * cfg.kv_width();
        let gemma = cfg.arch.is_gemma();
        let extras = LayerExtras {
            qkv_bias: cfg.attention_bias.then(|| vector(1, qkv_rows, 0.0, 0.1)),
            q_norm: cfg.qk_norm.then(|| vector(2, cfg.head_dim, 1.0, 0.2)),
            k_norm: cfg.qk_norm.then(|| vector(3, cfg.head_dim, 1.0, 0.2)),
            post_attn_norm: gemma.then(|| vector(4, h, 1.0, 0.2)),
            post_ffn_norm: gemma.then(|| vector(5, h, 1.0, 0.2)),
        };
        layers.push(LayerWeights {
            attn_norm: vec![1.0; h],
            qkv: matrix("qkv", cfg.q_width() + 2 * cfg.kv_width(), h, fan_in(h))?,
            o: matrix("o", h, cfg.q_width(), fan_in(cfg.q_width()))?,
            ffn_norm: vec![1.0; h],
            gate_up: matrix("gate_up", 2 * cfg.intermediate_size, h, fan_in(h))?,
            down: matrix(
                "down",
                h,
                cfg.intermediate_size,
                fan_in(cfg.intermediate_size),
            )?,
            extras,
        });
    }
    let lm_head = if cfg.tie_word_embeddings {
        None
    } else {
        Some(matrix("lm_head", cfg.vocab_size, h, fan_in(h))?)
    };
    let weights = Weights {
        embed,
        layers,
        final_norm: vec![1.0; h],
        lm_head,
    };
    weights.validate(&cfg)?;
    let fingerprint = fingerprint(&cfg, format, &format!("dummy:{name}:{seed}"));
    Ok(Model::new(
        cfg,
        weights,
        format,
        fingerprint,
        format!("dummy-{name}"),
    ))
}

/// `n` values uniform in `±std·√3`, from a counter-based generator (splitmix64) so that
/// chunks can be filled in parallel and the result does not depend on the thread count.
fn seeded_uniform(n: usize, seed: u64, std: f32) -> Vec<f32> {
    let amp = std * 3f32.sqrt();
    let mut out = vec![0f32; n];
    out.par_chunks_mut(1 << 16)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut state = seed ^ (c as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
            for v in chunk {
                state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = state;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^= z >> 31;
                let unit = (z >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
                *v = (unit * 2.0 - 1.0) * amp;
            }
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tokenizer folder whose chat template prints without bound: the model is refused at
    /// load, and the error names the folder; a template that only fails to compile loads.
    #[test]
    fn a_hostile_chat_template_is_refused_at_load_naming_its_file() {
        let dir = std::env::temp_dir().join(format!("tandem-hostile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let json = TextTokenizer::byte_level().to_json().unwrap();
        std::fs::write(dir.join("tokenizer.json"), json).unwrap();
        let config = |template: &str| {
            let cfg = serde_json::json!({ "chat_template": template });
            std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
        };
        let opts = LoadOptions {
            tokenizer: Some(dir.clone()),
            ..LoadOptions::default()
        };
        let tiny = "tiny".parse::<ModelSource>().unwrap();
        config("{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}");
        let err = load_model(&tiny, &opts).unwrap_err().to_string();
        assert!(
            err.contains(&dir.display().to_string()) && err.contains("bytes"),
            "{err}"
        );
        config("{% for %}");
        assert!(load_model(&tiny, &opts).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn sources_parse() {
        assert_eq!(
            "smollm2".parse::<ModelSource>().unwrap(),
            ModelSource::DefaultSmolLm2
        );
        assert_eq!(
            "dummy:llama-3.2-1b:7".parse::<ModelSource>().unwrap(),
            ModelSource::Dummy {
                preset: "llama-3.2-1b".into(),
                seed: 7
            }
        );
        assert!("dummy:nope".parse::<ModelSource>().is_err());
        assert!("/does/not/exist".parse::<ModelSource>().is_err());
    }

    #[test]
    fn dummy_is_deterministic_and_seed_dependent() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let a = dummy_model(cfg.clone(), WeightFormat::F32, 1, "tiny").unwrap();
        let b = dummy_model(cfg.clone(), WeightFormat::F32, 1, "tiny").unwrap();
        let c = dummy_model(cfg, WeightFormat::F32, 2, "tiny").unwrap();
        assert_eq!(a.fingerprint(), b.fingerprint());
        assert_ne!(a.fingerprint(), c.fingerprint());
        assert_eq!(a.weights().embed.get(0, 17), b.weights().embed.get(0, 17));
        assert_ne!(a.weights().embed.get(0, 17), c.weights().embed.get(0, 17));
        let vals = seeded_uniform(100_000, 3, 1.0);
        let mean: f32 = vals.iter().sum::<f32>() / vals.len() as f32;
        let var: f32 =
            vals.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / vals.len() as f32;
        assert!(
            mean.abs() < 0.02 && (var - 1.0).abs() < 0.05,
            "mean {mean} var {var}"
        );
    }
}
