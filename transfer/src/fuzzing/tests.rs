//! The `kv_frame` fuzz target on every build (see `tandem_text::fuzzing::replay`): its
//! committed corpus and regressions, then a bounded, seeded mutation loop. `TANDEM_BLESS=1`
//! writes the generated seeds, one whole exchange per reader; the test below checks that
//! each reaches its successful end, so that mutations of it explore every check on the way.

use tandem_text::fuzzing::replay::{blessing, run, write_seed};

use super::*;
use crate::checksum::crc32;
use crate::lease::LeaseToken;
use crate::nccl_wire::LayerHeader;

#[test]
fn kv_frame_survives_its_corpus() {
    if blessing() {
        for (name, seed) in seeds() {
            write_seed("kv_frame", name, &seed);
        }
    }
    run("kv_frame", kv_frame);
}

#[test]
fn each_seed_reaches_its_readers_end() {
    let seeds = seeds();
    let stream = |name: &str| {
        let (_, seed) = seeds.iter().find(|(n, _)| *n == name).unwrap();
        seed[1..].to_vec()
    };
    let piece_bytes = 2 * LEASE_BLOCKS.len() as u64 * PIECE as u64;
    let committed = tcp_listener(&stream("tcp_transfer"), true).unwrap();
    assert_eq!(committed.unwrap(), piece_bytes);
    let stranger = tcp_listener(&stream("tcp_stranger"), false).unwrap();
    assert!(
        matches!(stranger, Err(TransferError::Unauthenticated(_))),
        "{stranger:?}"
    );
    assert_eq!(
        nccl_receiver(&stream("nccl_layers")).unwrap().unwrap(),
        piece_bytes
    );
    let pulled = pulled(&stream("pull_answer")).unwrap().unwrap();
    assert_eq!(pulled.len(), 2 * 2 * PIECE);
    // The committed seeds are the generated ones (unless they are being written now).
    for (name, seed) in seeds.into_iter().filter(|_| !blessing()) {
        let path = tandem_text::fuzzing::replay::fuzz_dir()
            .join("corpus/kv_frame")
            .join(name);
        assert_eq!(
            std::fs::read(&path).ok(),
            Some(seed),
            "{name}: run with TANDEM_BLESS=1"
        );
    }
}

/// A piece of recognisable bytes.
fn piece(layer: usize, block: usize) -> Vec<u8> {
    (0..PIECE)
        .map(|i| (i + 31 * block + 7 * layer) as u8)
        .collect()
}

/// A TCP blocks frame of `blocks` of `layer`.
fn blocks_frame(layer: usize, blocks: &[usize]) -> Vec<u8> {
    let mut h = HeaderWriter::default();
    h.u32(layer as u32).u32(blocks.len() as u32);
    let mut payload = Vec::new();
    for &b in blocks {
        let p = piece(layer, b);
        h.u32(b as u32).u32(crc32(&p));
        payload.extend_from_slice(&p);
    }
    let mut out = frame::encode_prefix(Kind::Blocks, h.0.len(), payload.len() as u64).to_vec();
    out.extend_from_slice(&h.0);
    out.extend_from_slice(&payload);
    out
}

/// A TCP commit frame: choice 0 with one alternative, and one other choice.
fn commit_frame(bytes: u64) -> Vec<u8> {
    let mut h = HeaderWriter::default();
    h.u32(72).f32(-0.25).u32(LEASE_TOKENS).u64(bytes);
    h.u32(1).u32(73).f32(-1.5);
    h.u32(1).u32(74).f32(-0.75).u32(0);
    frame::encode(Kind::Commit, &h.0)
}

/// The generated seeds: each reader's whole exchange, named.
fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let layers = layout().num_layers;
    let all: Vec<usize> = (0..LEASE_BLOCKS.len()).collect();
    let received = (layers * all.len() * PIECE) as u64;
    let mut transfer = vec![1];
    for layer in 0..layers {
        transfer.extend(blocks_frame(layer, &all));
    }
    transfer.extend(commit_frame(received));

    // A stranger's hello: a well-formed one, for a lease it does not hold, with no proof.
    let mut stranger = vec![0];
    let mut h = HeaderWriter::default();
    h.u32(PROTOCOL_VERSION)
        .bytes(&[0; 16])
        .str(&layout().hash())
        .str("fuzz")
        .bytes(&[0; 32]);
    stranger.extend(frame::encode(Kind::Hello, &h.0));
    stranger.extend(blocks_frame(0, &all));

    let sender = |answer: Vec<u8>| {
        let mut out = vec![2];
        let mut h = HeaderWriter::default();
        h.u32(PROTOCOL_VERSION).bytes(&NONCE);
        out.extend(frame::encode(Kind::Challenge, &h.0));
        out.extend(answer);
        out
    };
    let mut ack = HeaderWriter::default();
    ack.u64(received);
    let mut refusal = HeaderWriter::default();
    refusal.str("no open lease holds this capability");

    let mut nccl = vec![3];
    for layer in 0..layers {
        let header = LayerHeader {
            lease: LeaseToken::from_wire(&[0; 16]).unwrap(),
            layer: layer as u32,
            count: all.len() as u32,
            piece: PIECE as u64,
        };
        nccl.extend(header.encode());
        for &b in &all {
            nccl.extend((b as u32).to_le_bytes());
        }
        for &b in &all {
            nccl.extend(piece(layer, b));
        }
    }

    // Blocks 1 and 2 of the prompt (the range byte: first 1, two blocks).
    let mut pull = vec![4, 0b0101];
    for layer in 0..layers {
        let blocks = [1usize, 2];
        let pieces: Vec<Vec<u8>> = blocks.iter().map(|&b| piece(layer, b)).collect();
        KvBlocks {
            layer: layer as u32,
            logical_blocks: blocks.iter().map(|&b| b as u32).collect(),
            checksums: pieces.iter().map(|p| crc32(p)).collect(),
            payload: pieces.concat().into(),
        }
        .encode_length_delimited(&mut pull)
        .unwrap();
    }

    vec![
        ("tcp_transfer", transfer),
        ("tcp_stranger", stranger),
        ("tcp_ack", sender(frame::encode(Kind::Ack, &ack.0))),
        (
            "tcp_refused",
            sender(frame::encode(Kind::Error, &refusal.0)),
        ),
        ("nccl_layers", nccl),
        ("pull_answer", pull),
    ]
}
