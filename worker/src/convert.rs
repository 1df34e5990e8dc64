//! Conversions between the wire types (`tandem_proto::v1`) and the engine's, and the mapping
//! of engine errors to precise gRPC status codes.

use tandem_engine::{EngineError, FinishReason, PromptLogprob, SamplingParams, StopParams};
use tandem_kv::KvLayout;
use tandem_proto::v1 as pb;
use tandem_text::{GuideSpec, TextTokenizer};

/// Sampling parameters from the wire; absent means greedy.
pub fn sampling_from_proto(p: Option<&pb::SamplingParams>) -> SamplingParams {
    match p {
        None => SamplingParams::greedy(),
        Some(p) => SamplingParams {
            temperature: p.temperature,
            top_k: p.top_k as usize,
            // proto3 zero means "unset" for top_p and the penalty.
            top_p: if p.top_p == 0.0 { 1.0 } else { p.top_p },
            seed: p.seed,
            repetition_penalty: if p.repetition_penalty == 0.0 {
                1.0
            } else {
                p.repetition_penalty
            },
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            // The engine's validation bounds the count and the values.
            logit_bias: p.logit_bias.iter().map(|b| (b.id, b.bias)).collect(),
            top_logprobs: p.top_logprobs as usize,
            guide: p.guide.as_ref().and_then(guide_from_proto),
            // proto3 zero means "unset": one choice.
            n: (p.n as usize).max(1),
            prompt_logprobs: p.prompt_logprobs.map(|k| k as usize),
        },
    }
}

/// A wire grammar as the engine's; a message with no kind set is no grammar.
pub fn guide_from_proto(g: &pb::Guide) -> Option<GuideSpec> {
    use pb::guide::Kind;
    Some(match g.kind.as_ref()? {
        Kind::JsonSchema(s) => GuideSpec::JsonSchema(s.clone()),
        Kind::JsonObject(_) => GuideSpec::JsonObject,
        Kind::Regex(s) => GuideSpec::Regex(s.clone()),
        Kind::Choice(c) => GuideSpec::Choice(c.choices.clone()),
        Kind::Lark(s) => GuideSpec::Lark(s.clone()),
    })
}

pub fn guide_to_proto(g: &GuideSpec) -> pb::Guide {
    use pb::guide::Kind;
    let kind = match g {
        GuideSpec::JsonSchema(s) => Kind::JsonSchema(s.clone()),
        GuideSpec::JsonObject => Kind::JsonObject(true),
        GuideSpec::Regex(s) => Kind::Regex(s.clone()),
        GuideSpec::Choice(c) => Kind::Choice(pb::Choices { choices: c.clone() }),
        GuideSpec::Lark(s) => Kind::Lark(s.clone()),
    };
    pb::Guide { kind: Some(kind) }
}

pub fn sampling_to_proto(s: &SamplingParams) -> pb::SamplingParams {
    pb::SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k as u32,
        top_p: s.top_p,
        seed: s.seed,
        repetition_penalty: s.repetition_penalty,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        logit_bias: s
            .logit_bias
            .iter()
            .map(|&(id, bias)| pb::LogitBias { id, bias })
            .collect(),
        top_logprobs: s.top_logprobs as u32,
        guide: s.guide.as_ref().map(guide_to_proto),
        n: s.n as u32,
        prompt_logprobs: s.prompt_logprobs.map(|k| k as u32),
    }
}

/// Prompt logprobs as the wire carries them.
pub fn prompt_logprobs_to_proto(entries: &[PromptLogprob]) -> Vec<pb::PromptLogprob> {
    entries
        .iter()
        .map(|e| pb::PromptLogprob {
            logprob: e.logprob,
            rank: e.rank,
            top_logprobs: e
                .top_logprobs
                .iter()
                .map(|&(id, logprob)| pb::TopLogprob { id, logprob })
                .collect(),
        })
        .collect()
}

/// Stop parameters from the wire; absent means the engine's defaults.
pub fn stop_from_proto(p: Option<&pb::StopParams>) -> StopParams {
    match p {
        None => StopParams::default(),
        Some(p) => StopParams {
            max_tokens: p.max_tokens as usize,
            stop_token_ids: p.stop_token_ids.clone(),
            stop_strings: p.stop_strings.clone(),
            ignore_eos: p.ignore_eos,
            min_tokens: p.min_tokens as usize,
        },
    }
}

pub fn stop_to_proto(s: &StopParams) -> pb::StopParams {
    pb::StopParams {
        max_tokens: s.max_tokens as u32,
        stop_token_ids: s.stop_token_ids.clone(),
        stop_strings: s.stop_strings.clone(),
        ignore_eos: s.ignore_eos,
        min_tokens: s.min_tokens as u32,
    }
}

pub fn finish_to_proto(f: FinishReason) -> pb::FinishReason {
    match f {
        FinishReason::Stop => pb::FinishReason::Stop,
        FinishReason::Length => pb::FinishReason::Length,
    }
}

/// The gRPC status for an engine error: the caller's fault, lack of room, or ours.
pub fn engine_status(e: &EngineError) -> tonic::Status {
    let msg = e.to_string();
    match e {
        e if e.is_invalid_request() => tonic::Status::invalid_argument(msg),
        EngineError::OutOfBlocks { .. } => tonic::Status::resource_exhausted(msg),
        EngineError::LayoutMismatch(_) => tonic::Status::failed_precondition(msg),
        EngineError::InvalidKv(_) => tonic::Status::data_loss(msg),
        _ => tonic::Status::internal(msg),
    }
}

pub fn kv_layout_to_proto(l: &KvLayout) -> pb::KvLayout {
    pb::KvLayout {
        num_layers: l.num_layers as u32,
        num_kv_heads: l.num_kv_heads as u32,
        head_dim: l.head_dim as u32,
        block_size: l.block_size as u32,
        dtype: l.dtype.name().to_string(),
        model_fingerprint: l.model_fingerprint.clone(),
    }
}

/// The tokenizer as the router rebuilds it.
pub fn tokenizer_spec(t: &TextTokenizer) -> Result<pb::TokenizerSpec, tonic::Status> {
    let info = t.info();
    Ok(pb::TokenizerSpec {
        tokenizer_json: t
            .to_json()
            .map_err(|e| tonic::Status::internal(e.to_string()))?,
        bos_token: info.bos_token.clone(),
        eos_token: info.eos_token.clone(),
        eos_token_ids: info.eos_token_ids.clone(),
        chat_template: info.chat_template.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_defaults() {
        let s = SamplingParams {
            temperature: 0.7,
            top_k: 5,
            top_p: 0.9,
            seed: Some(3),
            repetition_penalty: 1.2,
            presence_penalty: -0.5,
            frequency_penalty: 1.5,
            logit_bias: vec![(7, -100.0), (3, 2.5)],
            top_logprobs: 4,
            guide: None,
            n: 3,
            prompt_logprobs: Some(2),
        };
        assert_eq!(sampling_from_proto(Some(&sampling_to_proto(&s))), s);
        let unset = pb::SamplingParams::default();
        assert_eq!(
            sampling_from_proto(Some(&unset)).n,
            1,
            "proto3 zero is one choice"
        );
        for guide in [
            GuideSpec::JsonSchema("{}".into()),
            GuideSpec::JsonObject,
            GuideSpec::Regex("a+".into()),
            GuideSpec::Choice(vec!["x".into(), "y".into()]),
            GuideSpec::Lark("start: \"a\"".into()),
        ] {
            let s = SamplingParams {
                guide: Some(guide),
                ..s.clone()
            };
            assert_eq!(sampling_from_proto(Some(&sampling_to_proto(&s))), s);
        }
        let zeroed = pb::SamplingParams::default();
        let d = sampling_from_proto(Some(&zeroed));
        assert_eq!(
            (d.top_p, d.repetition_penalty, d.temperature),
            (1.0, 1.0, 0.0)
        );
        let st = StopParams {
            max_tokens: 9,
            stop_token_ids: vec![1],
            stop_strings: vec!["x".into()],
            ignore_eos: true,
            min_tokens: 3,
        };
        assert_eq!(stop_from_proto(Some(&stop_to_proto(&st))), st);
        assert_eq!(
            engine_status(&EngineError::EmptyPrompt).code(),
            tonic::Code::InvalidArgument
        );
        assert_eq!(
            engine_status(&EngineError::OutOfBlocks { needed: 2, free: 1 }).code(),
            tonic::Code::ResourceExhausted
        );
    }
}
