//! The sampler against its definition: penalties, bias, top-k/top-p, seeds, logprobs, and
//! the bounds a request is checked against.

use super::*;

fn params(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
        seed: Some(seed),
        repetition_penalty: 1.0,
        ..SamplingParams::default()
    }
}

#[test]
fn greedy_picks_the_max_and_first_of_ties() {
    let mut s = Sampler::new(&SamplingParams::greedy());
    let out = s.sample(
        &mut [0.1, 3.0, 3.0, -1.0],
        &SamplingParams::greedy(),
        &[],
        0,
        &[],
    );
    assert_eq!(out.token, 1);
    assert!(out.logprob < 0.0 && out.logprob > -1.0);
    assert!(out.top_logprobs.is_empty());
}

#[test]
fn top_k_and_top_p_restrict_the_support() {
    let logits = [5.0, 4.0, 1.0, 0.5, 0.1, -3.0];
    for seed in 0..200 {
        let p = params(1.0, 2, 1.0, seed);
        let t = Sampler::new(&p)
            .sample(&mut logits.clone(), &p, &[], 0, &[])
            .token;
        assert!(t < 2, "top_k=2 gave {t}");
        let p = params(1.0, 0, 0.5, seed);
        let t = Sampler::new(&p)
            .sample(&mut logits.clone(), &p, &[], 0, &[])
            .token;
        assert_eq!(t, 0, "top_p=0.5 keeps only the first (p≈0.71)");
    }
}

#[test]
fn seeds_reproduce_and_resume() {
    let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
    let p = params(1.0, 0, 1.0, 42);
    let run = |mut s: Sampler, n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| s.sample(&mut logits.clone(), &p, &[], 0, &[]).token)
            .collect()
    };
    let a = run(Sampler::new(&p), 10);
    assert_eq!(a, run(Sampler::new(&p), 10));
    assert_eq!(a[3..], run(Sampler::resumed(&p, 3), 7)[..]);
    assert_ne!(a, run(Sampler::new(&params(1.0, 0, 1.0, 43)), 10));
}

#[test]
fn temperature_spreads_choices() {
    let logits = [1.0, 1.0, 1.0, 1.0];
    let p = params(1.0, 0, 1.0, 7);
    let mut s = Sampler::new(&p);
    let mut counts = [0; 4];
    for _ in 0..400 {
        counts[s.sample(&mut logits.clone(), &p, &[], 0, &[]).token as usize] += 1;
    }
    assert!(counts.iter().all(|&c| c > 60), "{counts:?}");
}

#[test]
fn repetition_penalty_discourages_seen_tokens() {
    let p = SamplingParams {
        repetition_penalty: 4.0,
        ..SamplingParams::greedy()
    };
    let t = Sampler::new(&p)
        .sample(&mut [2.0, 1.0, -1.0], &p, &[0, 0], 2, &[])
        .token;
    assert_eq!(t, 1, "2.0/4 < 1.0");
}

#[test]
fn validation_rejects_out_of_range() {
    for bad in [
        SamplingParams {
            temperature: -1.0,
            ..Default::default()
        },
        SamplingParams {
            temperature: f32::NAN,
            ..Default::default()
        },
        SamplingParams {
            top_p: 0.0,
            ..Default::default()
        },
        SamplingParams {
            top_p: 1.5,
            ..Default::default()
        },
        SamplingParams {
            repetition_penalty: 0.0,
            ..Default::default()
        },
        SamplingParams {
            presence_penalty: 2.5,
            ..Default::default()
        },
        SamplingParams {
            frequency_penalty: f32::NAN,
            ..Default::default()
        },
        SamplingParams {
            logit_bias: vec![(10, 1.0)],
            ..Default::default()
        },
        SamplingParams {
            logit_bias: vec![(1, 101.0)],
            ..Default::default()
        },
        SamplingParams {
            logit_bias: vec![(1, 1.0); MAX_LOGIT_BIAS + 1],
            ..Default::default()
        },
        SamplingParams {
            top_logprobs: MAX_TOP_LOGPROBS + 1,
            ..Default::default()
        },
    ] {
        assert!(
            matches!(bad.validate(10), Err(EngineError::InvalidSampling { .. })),
            "{bad:?}"
        );
    }
    assert!(SamplingParams::default().validate(10).is_ok());
    let stop = StopParams {
        max_tokens: 0,
        ..Default::default()
    };
    assert!(stop.validate(10).is_err());
    let stop = StopParams {
        max_tokens: 4,
        min_tokens: 5,
        ..Default::default()
    };
    assert!(stop.validate(10).is_err());
    let stop = StopParams {
        stop_token_ids: vec![10],
        ..Default::default()
    };
    assert!(stop.validate(10).is_err());
    let stop = StopParams {
        stop_strings: vec!["x".repeat(300)],
        ..Default::default()
    };
    assert!(stop.validate(10).is_err());
}

/// log-softmax in f64, the reference for reported logprobs.
fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    logits.iter().map(|&l| l as f64 - max - sum.ln()).collect()
}

#[test]
fn top_logprobs_are_the_most_likely_in_order_and_normalised() {
    let logits: Vec<f32> = (0..300).map(|i| ((i * 37 % 101) as f32) * 0.05).collect();
    let reference = log_softmax(&logits);
    for (temperature, seed) in [(0.0, 0), (0.7, 1), (1.5, 2)] {
        let p = SamplingParams {
            top_logprobs: 5,
            ..params(temperature, 0, 1.0, seed)
        };
        let out = Sampler::new(&p).sample(&mut logits.clone(), &p, &[], 0, &[]);
        let ids: Vec<u32> = out.top_logprobs.iter().map(|&(id, _)| id).collect();
        let mut by_logit: Vec<u32> = (0..300).collect();
        by_logit.sort_by(|&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        assert_eq!(ids, by_logit[..5], "temperature {temperature}");
        for &(id, lp) in &out.top_logprobs {
            assert!((lp as f64 - reference[id as usize]).abs() < 1e-5);
        }
        // The sampled token's logprob is on the same scale, whatever the temperature.
        assert!((out.logprob as f64 - reference[out.token as usize]).abs() < 1e-5);
        if temperature == 0.0 {
            assert_eq!(out.token, ids[0], "greedy picks the top-1");
            assert_eq!(out.logprob, out.top_logprobs[0].1);
        }
    }
}

#[test]
fn top_n_breaks_ties_by_the_lower_id() {
    assert_eq!(top_n(&[1.0, 3.0, 3.0, 2.0, 3.0], 2), vec![1, 2]);
    assert_eq!(top_n(&[1.0, 3.0, 3.0, 2.0, 3.0], 4), vec![1, 2, 4, 3]);
    assert_eq!(top_n(&[1.0, 2.0], 5), vec![1, 0]);
    assert!(top_n(&[1.0], 0).is_empty());
}

#[test]
fn logit_bias_moves_the_choice_and_the_reported_logprob() {
    let p = SamplingParams {
        logit_bias: vec![(2, 10.0), (0, -100.0)],
        top_logprobs: 3,
        ..SamplingParams::greedy()
    };
    let mut logits = [5.0, 4.0, 1.0, 0.0];
    let out = Sampler::new(&p).sample(&mut logits, &p, &[], 0, &[]);
    assert_eq!(out.token, 2);
    let reference = log_softmax(&[-95.0, 4.0, 11.0, 0.0]);
    assert!((out.logprob as f64 - reference[2]).abs() < 1e-5);
    assert_eq!(
        out.top_logprobs.iter().map(|t| t.0).collect::<Vec<_>>(),
        [2, 1, 3]
    );
}

#[test]
fn presence_and_frequency_penalties_count_generated_tokens_only() {
    // history: prompt [0, 0, 0], then generated [1, 1].
    let history = [0, 0, 0, 1, 1];
    let logits = [3.0, 3.0, 2.5];
    let presence = SamplingParams {
        presence_penalty: 0.6,
        ..SamplingParams::greedy()
    };
    let mut l = logits;
    let out = Sampler::new(&presence).sample(&mut l, &presence, &history, 3, &[]);
    assert_eq!(
        l,
        [3.0, 2.4, 2.5],
        "once for token 1, never for prompt-only token 0"
    );
    assert_eq!(out.token, 0);
    let frequency = SamplingParams {
        frequency_penalty: 0.3,
        ..SamplingParams::greedy()
    };
    let mut l = logits;
    Sampler::new(&frequency).sample(&mut l, &frequency, &history, 3, &[]);
    assert_eq!(l, [3.0, 2.4, 2.5], "0.3 per appearance, twice");
    let negative = SamplingParams {
        presence_penalty: -1.0,
        ..SamplingParams::greedy()
    };
    let out = Sampler::new(&negative).sample(&mut logits.clone(), &negative, &history, 3, &[]);
    assert_eq!(out.token, 1, "a negative penalty encourages repeats");
}

#[test]
fn suppressed_ids_cannot_be_picked_even_when_biased() {
    let p = SamplingParams {
        logit_bias: vec![(0, 100.0)],
        top_logprobs: 2,
        ..params(1.0, 0, 1.0, 3)
    };
    for seed in 0..50 {
        let p = SamplingParams {
            seed: Some(seed),
            ..p.clone()
        };
        let out = Sampler::new(&p).sample(&mut [9.0, 1.0, 0.5], &p, &[], 0, &[0]);
        assert_ne!(out.token, 0);
        assert!(out.top_logprobs.iter().all(|&(id, _)| id != 0));
    }
}

/// The engine takes a request exactly up to `tandem_limits`, the bounds the router
/// refuses by: nothing the router admits fails at a worker, nothing past them runs.
#[test]
fn requests_are_taken_exactly_up_to_the_shared_limits() {
    use tandem_limits as wire;
    let n = |n: usize| SamplingParams {
        n,
        ..SamplingParams::default()
    };
    assert!(n(wire::MAX_CHOICES).validate(100).is_ok());
    assert!(n(wire::MAX_CHOICES + 1).validate(100).is_err());
    assert!(n(0).validate(100).is_err());
    let at = |t: f32, r: f32| SamplingParams {
        temperature: t,
        repetition_penalty: r,
        ..SamplingParams::default()
    };
    assert!(
        at(wire::MAX_TEMPERATURE, wire::MAX_REPETITION_PENALTY)
            .validate(100)
            .is_ok()
    );
    assert!(at(wire::MAX_TEMPERATURE * 1.01, 1.0).validate(100).is_err());
    assert!(
        at(1.0, wire::MAX_REPETITION_PENALTY * 1.01)
            .validate(100)
            .is_err()
    );
    let extras = |penalty: f32, bias: usize, value: f32, top: usize| SamplingParams {
        presence_penalty: penalty,
        frequency_penalty: -penalty,
        logit_bias: vec![(1, value); bias],
        top_logprobs: top,
        ..SamplingParams::default()
    };
    let (p, b, v, t) = (
        wire::MAX_OPENAI_PENALTY,
        wire::MAX_LOGIT_BIAS,
        wire::MAX_LOGIT_BIAS_VALUE,
        wire::MAX_TOP_LOGPROBS,
    );
    assert!(extras(p, b, v, t).validate(100).is_ok());
    assert!(extras(p * 1.01, 0, 0.0, 0).validate(100).is_err());
    assert!(extras(0.0, b + 1, 0.0, 0).validate(100).is_err());
    assert!(extras(0.0, 1, -v * 1.01, 0).validate(100).is_err());
    assert!(extras(0.0, 0, 0.0, t + 1).validate(100).is_err());
    let stop = |ids: usize, strings: usize, bytes: usize| StopParams {
        stop_token_ids: vec![1; ids],
        stop_strings: vec!["é".repeat(bytes / 2); strings],
        ..StopParams::default()
    };
    let (ids, strings, bytes) = (
        wire::MAX_STOP_TOKEN_IDS,
        wire::MAX_STOP_STRINGS,
        wire::MAX_STOP_STRING_BYTES,
    );
    assert!(stop(ids, strings, bytes).validate(100).is_ok());
    assert!(stop(ids + 1, 1, 2).validate(100).is_err());
    assert!(stop(1, strings + 1, 2).validate(100).is_err());
    assert!(stop(1, 1, bytes + 2).validate(100).is_err());
}
