//! Engine behaviour on the tiny built-in model: KV export/import between two engines,
//! stopping rules, sampling, guides and typed errors for bad input (the scheduler's tests are
//! in scheduling.rs).

use tandem_engine::engine::ReceivedKv;

mod common;
use common::{engine, greedy, prompt, run_alone, tiny_model as model};
use tandem_engine::{
    Engine, EngineConfig, EngineError, FinishReason, SampledToken, SamplingParams, StepOutput,
    StopParams,
};
use tandem_kv::KvLocation;
use tandem_text::TextTokenizer;

#[test]
fn exported_kv_continues_identically_in_another_engine() {
    let model = model();
    for len in [1, 15, 16, 17, 100, 300] {
        let p = prompt(len, len);
        let got = common::handoff(|| engine(&model, 64), &p, 20);
        assert_eq!(got, run_alone(&model, &p, 20), "prompt of {len}");
    }
}

#[test]
fn a_prompt_split_between_engines_gives_the_solo_tokens() {
    let model = model();
    for (len, at) in [(17, 16), (100, 16), (100, 96), (300, 128)] {
        let p = prompt(len, len);
        let (s, st) = greedy(20);
        let got: Vec<u32> = common::split_handoff(|| engine(&model, 64), &p, at, s, st)
            .iter()
            .map(|o| o.token)
            .collect();
        assert_eq!(
            got,
            run_alone(&model, &p, 20),
            "prompt of {len} split at {at}"
        );
    }
    // Sampled choices too: each choice's seed stream is the solo run's.
    let p = prompt(7, 200);
    let sampling = SamplingParams {
        temperature: 0.8,
        seed: Some(11),
        n: 2,
        ..Default::default()
    };
    let stop = StopParams {
        max_tokens: 12,
        ignore_eos: true,
        ..Default::default()
    };
    let mut alone = engine(&model, 64);
    let id = alone
        .add_request(p.clone(), sampling.clone(), stop.clone())
        .unwrap();
    let mut want = alone.run_to_completion(id).unwrap();
    want.sort_by_key(|o| o.choice);
    let got = common::split_handoff(|| engine(&model, 64), &p, 64, sampling, stop);
    let tokens = |outs: &[StepOutput]| outs.iter().map(|o| (o.choice, o.token)).collect::<Vec<_>>();
    assert_eq!(tokens(&got), tokens(&want));
}

#[test]
fn splits_that_cannot_resume_are_refused() {
    let model = model();
    let mut e = engine(&model, 64);
    let (s, st) = greedy(4);
    let p = prompt(1, 40);
    let blocks = e.reserve(p.len()).unwrap();
    let logprobs = SamplingParams {
        prompt_logprobs: Some(0),
        ..SamplingParams::greedy()
    };
    for (at, sampling, why) in [
        (0, s.clone(), "nothing computed"),
        (20, s.clone(), "not a whole block"),
        (48, s.clone(), "past the prompt"),
        (16, logprobs, "prompt logprobs need every row"),
    ] {
        let err = e
            .add_partly_prefilled(
                p.clone(),
                at,
                ReceivedKv::host(blocks.clone()),
                sampling,
                st.clone(),
                None,
            )
            .unwrap_err();
        assert!(matches!(err, EngineError::InvalidKv(_)), "{why}: {err}");
    }
    // Blocks that do not cover the prompt.
    assert!(
        e.add_partly_prefilled(
            p.clone(),
            16,
            ReceivedKv::host(blocks[..1].to_vec()),
            s,
            st,
            None
        )
        .is_err()
    );
    e.release(&blocks).unwrap();
    assert_eq!(e.used_blocks(), 0);
}

#[test]
fn stop_tokens_strings_and_eos() {
    let model = model();
    let reference = run_alone(&model, &prompt(1, 10), 30);
    let tok = TextTokenizer::byte_level();
    // A stop token: generation ends at its first occurrence, which is not emitted as text.
    let target = reference[5];
    let cut = reference.iter().position(|&t| t == target).unwrap();
    let mut e = engine(&model, 64);
    let stop = StopParams {
        max_tokens: 30,
        stop_token_ids: vec![target],
        ..Default::default()
    };
    let id = e
        .add_request(prompt(1, 10), SamplingParams::greedy(), stop)
        .unwrap();
    let outs = e.run_to_completion(id).unwrap();
    assert_eq!(outs.len(), cut + 1);
    assert_eq!(outs.last().unwrap().finish, Some(FinishReason::Stop));
    // A stop string made of generated text: output ends right before it.
    let full_text = tok.decode(&reference, true).unwrap();
    let stop_str: String = full_text.chars().skip(8).take(3).collect();
    if !stop_str.is_empty() {
        let mut e = engine(&model, 64);
        let stop = StopParams {
            max_tokens: 30,
            stop_strings: vec![stop_str.clone()],
            ignore_eos: true,
            ..Default::default()
        };
        let id = e
            .add_request(prompt(1, 10), SamplingParams::greedy(), stop)
            .unwrap();
        let outs = e.run_to_completion(id).unwrap();
        let text: String = outs.iter().map(|o| o.text.as_str()).collect();
        let expected = &full_text[..full_text.find(&stop_str).unwrap()];
        assert_eq!(text, expected);
        assert_eq!(outs.last().unwrap().finish, Some(FinishReason::Stop));
        assert_eq!(e.used_blocks(), 0);
    }
    // EOS ends generation unless ignore_eos; with the tiny model EOS is id 2.
    let mut e = engine(&model, 64);
    let stop = StopParams {
        max_tokens: 5,
        stop_token_ids: vec![],
        ignore_eos: false,
        ..Default::default()
    };
    let id = e
        .add_request(prompt(3, 4), SamplingParams::greedy(), stop)
        .unwrap();
    let outs = e.run_to_completion(id).unwrap();
    assert!(outs.len() <= 5);
    let text: String = outs.iter().map(|o| o.text.as_str()).collect();
    let full: String = tok
        .decode(&outs.iter().map(|o| o.token).collect::<Vec<_>>(), true)
        .unwrap();
    assert_eq!(text, full, "streamed text equals the whole decode");
}

#[test]
fn sampled_requests_reproduce_with_a_seed() {
    let model = model();
    let sampling = SamplingParams {
        // The tiny model's logits are sharp: a high temperature makes sampling visible.
        temperature: 8.0,
        top_k: 40,
        top_p: 0.95,
        seed: Some(1234),
        repetition_penalty: 1.1,
        ..SamplingParams::default()
    };
    let stop = StopParams {
        max_tokens: 25,
        ignore_eos: true,
        ..Default::default()
    };
    let run = || {
        let mut e = engine(&model, 64);
        let id = e
            .add_request(prompt(2, 30), sampling.clone(), stop.clone())
            .unwrap();
        e.run_to_completion(id)
            .unwrap()
            .iter()
            .map(|o| o.token)
            .collect::<Vec<_>>()
    };
    let a = run();
    assert_eq!(a, run());
    assert_ne!(
        a,
        run_alone(&model, &prompt(2, 30), 25),
        "sampling differs from greedy"
    );
}

#[test]
fn bad_inputs_are_typed_errors() {
    let model = model();
    let mut e = engine(&model, 64);
    let ok = SamplingParams::greedy();
    let stop = StopParams::default();
    assert!(matches!(
        e.add_request(vec![], ok.clone(), stop.clone()),
        Err(EngineError::EmptyPrompt)
    ));
    assert!(matches!(
        e.add_request(vec![3, 500], ok.clone(), stop.clone()),
        Err(EngineError::UnknownToken {
            id: 500,
            vocab: 259
        })
    ));
    let ctx = model.config().max_position_embeddings;
    let long = StopParams {
        max_tokens: 10,
        ..Default::default()
    };
    match e.add_request(vec![3; ctx - 5], ok.clone(), long) {
        Err(EngineError::ContextExceeded {
            prompt,
            max_tokens,
            context,
        }) => {
            assert_eq!((prompt, max_tokens, context), (ctx - 5, 10, ctx));
        }
        other => panic!("expected ContextExceeded, got {other:?}"),
    }
    // Fits the context but not this engine's small pool.
    assert!(matches!(
        e.add_request(vec![3; 64 * 16 + 1], ok.clone(), stop.clone()),
        Err(EngineError::SequenceTooLong { .. })
    ));
    for bad in [
        SamplingParams {
            temperature: -0.5,
            ..Default::default()
        },
        SamplingParams {
            top_p: 2.0,
            ..Default::default()
        },
        SamplingParams {
            repetition_penalty: f32::INFINITY,
            ..Default::default()
        },
    ] {
        let err = e.add_request(vec![3, 4], bad, stop.clone()).unwrap_err();
        assert!(err.is_invalid_request(), "{err}");
    }
    let zero = StopParams {
        max_tokens: 0,
        ..Default::default()
    };
    assert!(matches!(
        e.add_request(vec![3], ok.clone(), zero),
        Err(EngineError::InvalidSampling {
            param: "max_tokens",
            ..
        })
    ));
    // Import paths: foreign blocks and wrong sizes are refused.
    assert!(e.import_block_layer(0, 3, &[0u8; 8]).is_err());
    let blocks = e.reserve(20).unwrap();
    assert!(e.import_block_layer(0, blocks[0], &[0u8; 8]).is_err());
    assert!(
        e.import_block_layer(
            99,
            blocks[0],
            &vec![0u8; model.kv_layout().block_layer_bytes()]
        )
        .is_err()
    );
    assert!(
        e.add_prefilled(
            vec![3; 20],
            vec![SampledToken::new(9999, 0.0)],
            ReceivedKv::host(blocks.clone()),
            ok.clone(),
            stop.clone(),
            None
        )
        .is_err()
    );
    assert!(
        e.add_prefilled(
            vec![3; 40],
            vec![SampledToken::new(5, 0.0)],
            ReceivedKv::host(blocks.clone()),
            ok.clone(),
            stop.clone(),
            None
        )
        .is_err(),
        "blocks do not cover the prompt"
    );
    assert!(
        e.add_prefilled(
            vec![3; 20],
            vec![SampledToken::new(5, 0.0); 2],
            ReceivedKv::host(blocks.clone()),
            ok.clone(),
            stop.clone(),
            None
        )
        .is_err(),
        "two first tokens for one choice"
    );
    let err = e
        .add_prefilled(
            vec![3; 20],
            vec![SampledToken::new(5, 0.0)],
            ReceivedKv {
                blocks: blocks.clone(),
                location: KvLocation::Device,
                cached: 0,
            },
            ok,
            stop,
            None,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("device memory"), "{err}");
    e.release(&blocks).unwrap();
    assert!(e.release(&blocks).is_err());
    assert_eq!(e.used_blocks(), 0);
    assert!(!e.has_work());
}

#[test]
fn abort_frees_blocks_anywhere() {
    let model = model();
    let mut e = engine(&model, 64);
    let (s, st) = greedy(100);
    let a = e.add_request(prompt(0, 50), s.clone(), st.clone()).unwrap();
    let b = e.add_request(prompt(1, 20), s, st).unwrap();
    e.step().unwrap();
    e.step().unwrap();
    assert!(e.used_blocks() > 0);
    assert!(e.abort(a));
    assert!(e.abort(b));
    assert!(!e.abort(b));
    assert_eq!(e.used_blocks(), 0);
    assert!(!e.has_work());
}

/// Asking for a GPU where none can be used is a typed error at construction, never a silent
/// fall back to the CPU: without the `cuda` feature it says so; with it, on a machine without
/// a device, the CUDA context says so. (On a GPU machine this test has nothing to check.)
#[test]
fn a_gpu_engine_without_a_gpu_is_a_clear_error() {
    let model = model();
    let config = EngineConfig {
        kv_budget_bytes: 64 * model.kv_layout().block_bytes(),
        max_batch_tokens: 256,
        max_running: 64,
        device: "cuda".parse().unwrap(),
        prefix_caching: true,
    };
    match Engine::new(model.clone(), TextTokenizer::byte_level(), config) {
        Err(EngineError::Unsupported(why)) => assert!(
            why.contains("without CUDA support") || why.contains("no CUDA device"),
            "{why}"
        ),
        Err(other) => panic!("unexpected error: {other}"),
        Ok(_) => {
            if !tandem_engine::CUDA_SUPPORT {
                panic!("a CPU-only build built a GPU engine");
            }
        }
    }
}

/// Every sampling adjustment and the reported logprobs come out bit for bit the same whether
/// one engine runs the request or a prefill engine samples its first token and another
/// continues: the adjustments depend only on the request's own tokens.
#[test]
fn adjustments_and_logprobs_match_across_the_handoff() {
    let model = model();
    let p = prompt(3, 40);
    let plain = run_alone(&model, &p, 6);
    let stop = |max_tokens, min_tokens, stop_token_ids: Vec<u32>| StopParams {
        max_tokens,
        min_tokens,
        stop_token_ids,
        ignore_eos: true,
        ..Default::default()
    };
    let cases = [
        (
            SamplingParams {
                top_logprobs: 5,
                presence_penalty: 0.7,
                frequency_penalty: 0.4,
                logit_bias: vec![(plain[1], -3.0), (17, 1.5)],
                ..SamplingParams::greedy()
            },
            stop(12, 3, vec![plain[0]]),
        ),
        (
            SamplingParams {
                temperature: 0.9,
                top_k: 30,
                top_p: 0.9,
                seed: Some(11),
                repetition_penalty: 1.2,
                frequency_penalty: -0.5,
                top_logprobs: 3,
                ..SamplingParams::default()
            },
            stop(12, 12, vec![plain[0], plain[2]]),
        ),
    ];
    for (sampling, st) in cases {
        let mut e = engine(&model, 64);
        let id = e
            .add_request(p.clone(), sampling.clone(), st.clone())
            .unwrap();
        let alone = e.run_to_completion(id).unwrap();
        let handed = common::handoff_with(|| engine(&model, 64), &p, sampling.clone(), st.clone());
        let key = |o: &StepOutput| {
            (
                o.token,
                o.logprob.to_bits(),
                o.top_logprobs.clone(),
                o.finish,
            )
        };
        assert_eq!(
            alone.iter().map(key).collect::<Vec<_>>(),
            handed.iter().map(key).collect::<Vec<_>>(),
            "{sampling:?}"
        );
        // min_tokens kept the stop ids out of the first tokens, and they are never reported
        // as alternatives there.
        for o in alone.iter().take(st.min_tokens) {
            assert!(!st.stop_token_ids.contains(&o.token), "{sampling:?}");
            assert!(
                o.top_logprobs
                    .iter()
                    .all(|(id, _)| !st.stop_token_ids.contains(id))
            );
        }
        for o in &alone {
            assert_eq!(o.top_logprobs.len(), sampling.top_logprobs);
            assert!(o.top_logprobs.windows(2).all(|w| w[0].1 >= w[1].1));
            if sampling.is_greedy() {
                assert_eq!(
                    o.top_logprobs[0],
                    (o.token, o.logprob),
                    "greedy is the top-1"
                );
            }
        }
    }
}

#[test]
fn logit_bias_and_min_tokens_steer_generation() {
    let model = model();
    let p = prompt(5, 30);
    let plain = run_alone(&model, &p, 4);
    let forced = (3..200).find(|t| !plain.contains(t)).unwrap();
    let mut e = engine(&model, 64);
    let biased = SamplingParams {
        logit_bias: vec![(forced, 100.0)],
        ..SamplingParams::greedy()
    };
    let (_, st) = greedy(4);
    let id = e.add_request(p.clone(), biased, st).unwrap();
    let out = e.run_to_completion(id).unwrap();
    assert!(
        out.iter().all(|o| o.token == forced),
        "+100 forces the token"
    );

    // The first greedy token as a stop token ends at once; with min_tokens it cannot.
    let stop = |min_tokens| StopParams {
        max_tokens: 8,
        stop_token_ids: vec![plain[0]],
        ignore_eos: true,
        min_tokens,
        ..Default::default()
    };
    let id = e
        .add_request(p.clone(), SamplingParams::greedy(), stop(0))
        .unwrap();
    let out = e.run_to_completion(id).unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].finish, Some(FinishReason::Stop));
    let id = e
        .add_request(p.clone(), SamplingParams::greedy(), stop(3))
        .unwrap();
    let out = e.run_to_completion(id).unwrap();
    assert!(out.len() >= 3, "{} tokens", out.len());
    assert!(out[..3].iter().all(|o| o.token != plain[0]));
    // min_tokens > max_tokens is refused.
    let bad = StopParams {
        max_tokens: 2,
        min_tokens: 3,
        ..Default::default()
    };
    assert!(e.add_request(p, SamplingParams::greedy(), bad).is_err());
}

/// Structured output on the tiny model (random weights, byte-level vocabulary): whatever the
/// model prefers, the grammar makes the output valid, ends it when complete, and a prefill
/// engine plus a decode engine produce the same bytes as one engine.
#[test]
fn grammars_make_valid_output_in_both_modes() {
    use tandem_text::GuideSpec;
    let model = model();
    let schema = r#"{"type": "object", "properties": {
        "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"enum": ["alpha", "beta"]}}, "required": ["ok", "n", "tag"],
        "additionalProperties": false}"#;
    let specs = [
        GuideSpec::JsonSchema(schema.into()),
        GuideSpec::Choice(vec!["red".into(), "green".into(), "blue".into()]),
        GuideSpec::Regex("[a-f]{4}-[0-9]{2}".into()),
    ];
    for (i, spec) in specs.into_iter().enumerate() {
        for temperature in [0.0, 1.0] {
            let sampling = SamplingParams {
                temperature,
                seed: Some(7),
                guide: Some(spec.clone()),
                ..SamplingParams::default()
            };
            let stop = StopParams {
                max_tokens: 80,
                ..Default::default()
            };
            let p = prompt(i, 24);
            let mut e = engine(&model, 64);
            let id = e
                .add_request(p.clone(), sampling.clone(), stop.clone())
                .unwrap();
            let alone = e.run_to_completion(id).unwrap();
            let text: String = alone.iter().map(|o| o.text.as_str()).collect();
            assert_eq!(
                alone.last().unwrap().finish,
                Some(FinishReason::Stop),
                "{spec:?}: {text}"
            );
            match &spec {
                GuideSpec::JsonSchema(_) => {
                    let v: serde_json::Value = serde_json::from_str(&text).expect(&text);
                    assert!(v["ok"].is_boolean() && v["n"].as_u64().is_some_and(|n| n <= 99));
                    assert!(
                        ["alpha", "beta"].contains(&v["tag"].as_str().unwrap()),
                        "{text}"
                    );
                }
                GuideSpec::Choice(c) => assert!(c.contains(&text), "{text}"),
                _ => {
                    let b = text.as_bytes();
                    assert_eq!(b.len(), 7, "{text}");
                    assert!(b[..4].iter().all(|c| (b'a'..=b'f').contains(c)) && b[4] == b'-');
                }
            }
            let handed = common::handoff_with(|| engine(&model, 64), &p, sampling, stop);
            let tokens = |o: &[StepOutput]| o.iter().map(|o| o.token).collect::<Vec<_>>();
            assert_eq!(
                tokens(&alone),
                tokens(&handed),
                "{spec:?} at temperature {temperature}"
            );
        }
    }
    // A grammar that does not compile is a request error, before anything runs.
    let mut e = engine(&model, 64);
    let bad = SamplingParams {
        guide: Some(GuideSpec::Regex("(".into())),
        ..SamplingParams::greedy()
    };
    let err = e
        .add_request(prompt(0, 5), bad, StopParams::default())
        .unwrap_err();
    assert!(
        matches!(err, EngineError::InvalidSampling { param: "guide", .. }),
        "{err}"
    );
}
