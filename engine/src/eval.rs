//! Perplexity of a model on a text: how the storage formats of `--weights` are compared for
//! accuracy (the same tokens through each, see `examples/perplexity.rs`).

use tandem_kv::{KvCache, blocks_for};

use crate::error::{EngineError, Result};
use crate::model::{Model, SeqInput};

/// `exp(mean negative log-likelihood)` of `tokens[1..]`, each predicted from the tokens before
/// it, in one sequence. Runs one token per forward pass (the pass returns the last row's
/// logits), so every prediction sees exactly its prefix.
pub fn perplexity(model: &Model, tokens: &[u32]) -> Result<f64> {
    if tokens.len() < 2 {
        return Err(EngineError::Config(
            "perplexity needs at least two tokens".into(),
        ));
    }
    let layout = model.kv_layout();
    let blocks = blocks_for(tokens.len());
    let mut cache = KvCache::with_budget(layout.clone(), blocks * layout.block_bytes())?;
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut nll = 0f64;
    for (pos, pair) in tokens.windows(2).enumerate() {
        let input = SeqInput {
            tokens: &pair[..1],
            start_pos: pos,
            block_table: &table,
            logits: true,
            all_logits: false,
        };
        let logits = model
            .forward(&mut cache, &[input], &mut |_, _| {})?
            .pop()
            .ok_or_else(|| EngineError::Config("forward returned no logits".into()))?;
        nll -= log_softmax_at(&logits, pair[1] as usize);
    }
    Ok((nll / (tokens.len() - 1) as f64).exp())
}

/// `log softmax(logits)[target]`, in f64.
fn log_softmax_at(logits: &[f32], target: usize) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    logits[target] as f64 - max - sum.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_of_uniform_logits_is_minus_log_n() {
        let l = vec![3.0f32; 8];
        assert!((log_softmax_at(&l, 5) + 8f64.ln()).abs() < 1e-12);
    }

    #[test]
    fn a_seeded_model_has_a_finite_perplexity_and_one_token_is_refused() {
        let cfg = crate::ModelConfig::preset("tiny").unwrap();
        let model = crate::model::dummy_model(cfg, crate::WeightFormat::F32, 1, "tiny").unwrap();
        let tokens: Vec<u32> = (0..40).map(|i| 3 + (i * 7) % 250).collect();
        let ppl = perplexity(&model, &tokens).unwrap();
        assert!(ppl.is_finite() && ppl > 1.0, "{ppl}");
        assert!(perplexity(&model, &tokens[..1]).is_err());
    }
}
