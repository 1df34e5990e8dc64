//! The `grpc_handlers` fuzz target on every build (see `tandem_text::fuzzing::replay`): its
//! committed corpus and regressions, then a bounded, seeded mutation loop. `TANDEM_BLESS=1`
//! writes the generated seeds, one well-formed message of each RPC.

use tandem_text::fuzzing::replay::{blessing, run, write_seed};
use tandem_transfer::crc32;
use tandem_transfer::fuzzing::{LEASE_BLOCKS, LEASE_TOKENS, layout};

use super::*;

#[test]
fn grpc_handlers_survives_its_corpus() {
    if blessing() {
        for (name, seed) in seeds() {
            write_seed("grpc_handlers", name, &seed);
        }
    }
    run("grpc_handlers", grpc_handlers);
}

/// The `PushKv` seed reaches the commit, so that mutations of it explore every check.
#[test]
fn the_push_seed_commits() {
    let (_, seed) = seeds().into_iter().find(|(n, _)| *n == "push_kv").unwrap();
    let piece = layout().block_layer_bytes();
    let bytes = (layout().num_layers * LEASE_BLOCKS.len() * piece) as u64;
    assert_eq!(push_kv(&seed[1..]).unwrap().unwrap(), bytes);
}

fn with_pick(pick: u8, message: impl Message) -> Vec<u8> {
    let mut out = vec![pick];
    out.extend(message.encode_to_vec());
    out
}

fn sampling() -> pb::SamplingParams {
    pb::SamplingParams {
        temperature: 0.7,
        top_k: 5,
        top_p: 0.9,
        seed: Some(3),
        repetition_penalty: 1.1,
        presence_penalty: 0.5,
        frequency_penalty: -0.5,
        logit_bias: vec![pb::LogitBias {
            id: 7,
            bias: -100.0,
        }],
        top_logprobs: 2,
        guide: Some(pb::Guide {
            kind: Some(pb::guide::Kind::Regex("a+".into())),
        }),
        n: 2,
        prompt_logprobs: None,
    }
}

fn stop() -> pb::StopParams {
    pb::StopParams {
        max_tokens: 16,
        stop_token_ids: vec![2],
        stop_strings: vec!["\n\n".into()],
        ignore_eos: false,
        min_tokens: 2,
    }
}

/// The generated seeds: one message of each RPC, named.
fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let prompt: Vec<u32> = (0..40).map(|i| 3 + (i * 37) % 256).collect();
    let hash = layout().hash();
    let piece = layout().block_layer_bytes();
    let prefill = pb::PrefillRequest {
        request_id: "r".into(),
        prompt: prompt.clone(),
        sampling: Some(sampling()),
        stop: Some(stop()),
        destination: Some(pb::KvDestination {
            first_block: 1,
            ..Default::default()
        }),
    };
    let generate = pb::GenerateRequest {
        request_id: "r".into(),
        prompt,
        sampling: Some(sampling()),
        stop: Some(stop()),
        mode: pb::Mode::Disaggregated as i32,
        lease_ttl_ms: 5000,
        tpot_target_ms: 50,
        split_prompt_at: 32,
        ..Default::default()
    };
    let mut push = vec![2];
    let mut message = |msg: Msg| {
        pb::KvMessage { msg: Some(msg) }
            .encode_length_delimited(&mut push)
            .unwrap();
    };
    message(Msg::Header(pb::KvHeader {
        lease: Vec::new(),
        kv_layout_hash: hash.clone(),
        request_id: "r".into(),
    }));
    for layer in 0..layout().num_layers {
        let pieces: Vec<Vec<u8>> = (0..LEASE_BLOCKS.len())
            .map(|b| (0..piece).map(|i| (i + 13 * b + layer) as u8).collect())
            .collect();
        message(Msg::Blocks(pb::KvBlocks {
            layer: layer as u32,
            logical_blocks: (0..LEASE_BLOCKS.len() as u32).collect(),
            checksums: pieces.iter().map(|p| crc32(p)).collect(),
            payload: pieces.concat().into(),
        }));
    }
    let commit = pb::KvCommit {
        lease: Vec::new(),
        kv_layout_hash: hash.clone(),
        request_id: "r".into(),
        first_token: 72,
        first_logprob: -0.5,
        first_top_logprobs: vec![pb::TopLogprob {
            id: 73,
            logprob: -1.0,
        }],
        other_choices: vec![pb::FirstChoice {
            token: 74,
            logprob: -0.25,
            top_logprobs: Vec::new(),
        }],
        num_tokens: LEASE_TOKENS,
        transport: pb::Transport::Grpc as i32,
        ..Default::default()
    };
    message(Msg::Commit(commit.clone()));
    let info = pb::InfoRequest {
        include_tokenizer: false,
        challenge: vec![9; 32],
    };
    let load = pb::LoadRequest {
        block_events_after: Some(0),
        ..Default::default()
    };
    let pull = pb::PullKvRequest {
        lease: Vec::new(),
        kv_layout_hash: hash,
        request_id: "r".into(),
        from_block: 0,
        to_block: 2,
    };
    vec![
        ("prefill", with_pick(0, prefill)),
        ("generate", with_pick(1, generate.clone())),
        ("generate_windowed", with_pick(0x81, generate)),
        ("push_kv", push),
        ("commit_kv", with_pick(3, commit)),
        (
            "renew_lease",
            with_pick(4, pb::RenewLeaseRequest::default()),
        ),
        ("pull_kv", with_pick(5, pull)),
        ("get_info", with_pick(6, info)),
        ("get_load", with_pick(7, load)),
    ]
}
