//! Entry point of the `grpc_handlers` fuzz target (`fuzz/`, libFuzzer through cargo-fuzz) and
//! of the test that replays its corpus on every build: the bytes of a request message as the
//! workers' gRPC services take them past authentication, prost-decoded as the message of one
//! RPC and run through what its handler does before the engine or a peer is involved. It must
//! return, whatever the bytes, without a panic, an abort, a wait or an allocation the bytes
//! did not pay for. Errors are the expected outcome of most inputs and are dropped.
//!
//! The first byte picks the RPC (its value modulo 8) and the model (its top bit: the test
//! model, or its sliding-window variant); the rest is the message:
//! - 0, `PrefillService.Prefill`: the wire's sampling and stop converted, the prefill's
//!   one-token stop, the engine's `validate_request`, where its KV goes in the lease;
//! - 1, `DecodeService.Generate`: conversion, `validate_request`, the TPOT target, the mode,
//!   the prompt split, the lease TTL and the blocks a reservation needs;
//! - 2, `PushKv`: a stream of length-delimited `KvMessage`s into an open lease;
//! - 3, `CommitKv`; 4, `RenewLease`; 5, `PullKv` (its answer read to the end);
//! - 6, `GetInfo`: its challenge signed; 7, `GetLoad`: the prefix cache's block events
//!   from the cursor and block it names.
//!
//! A KV message's `lease` left empty names the open lease of the pool the KV RPCs run on
//! (`tandem_transfer::fuzzing`): a fuzzer cannot guess a 128-bit capability, and the handlers'
//! checks past it are what it should reach. Not run: the `nccl` commit's wait for the last
//! layer (up to 10 s, by design), `GetLoad`'s thread count (a process-wide setting),
//! `GetInfo`'s tokenizer (the input does not shape it), grammars' compilation (the engine's,
//! which `tandem_text`'s `guide` target fuzzes), and `OpenNccl` (a GPU build's).

use std::sync::OnceLock;
use std::time::Duration;

use prost::Message;
use tandem_engine::engine::validate_request;
use tandem_engine::{ModelConfig, SamplingParams, StopParams};
use tandem_kv::SharedPool;
use tandem_kv::prefix::{NAMES_PER_REPORT, names_to_bytes};
use tandem_proto::v1 as pb;
use tandem_proto::v1::kv_message::Msg;
use tandem_transfer::fuzzing::{block_on, with_lease};
use tandem_transfer::{TransferError, kv_rpcs, receive_push_kv};
use tonic::Request;

use crate::convert::{engine_status, sampling_from_proto, stop_from_proto};
use crate::requests::{lease_ttl, prefill_first_block, prefill_stop, split_declined, tpot_target};

/// Blocks of the pool requests are validated against.
const POOL_BLOCKS: usize = 64;

/// The test model's config (`tiny`), or (`windowed`) its sliding-window variant.
fn config(windowed: bool) -> Option<&'static ModelConfig> {
    static CONFIGS: OnceLock<Option<[ModelConfig; 2]>> = OnceLock::new();
    let configs = CONFIGS.get_or_init(|| {
        Some([
            ModelConfig::preset("tiny").ok()?,
            ModelConfig::preset("tiny-window").ok()?,
        ])
    });
    configs.as_ref().map(|c| &c[usize::from(windowed)])
}

/// A request message as a worker's gRPC service takes it, run through its handler's checks
/// (see the module's documentation for what the first byte picks).
pub fn grpc_handlers(data: &[u8]) {
    let Some((&pick, message)) = data.split_first() else {
        return;
    };
    let Some(cfg) = config(pick & 0x80 != 0) else {
        return;
    };
    match pick % 8 {
        0 => prefill(cfg, message),
        1 => generate(cfg, message),
        2 => drop(push_kv(message)),
        3 => commit_kv(message),
        4 => renew_lease(message),
        5 => pull_kv(message),
        6 => get_info(message),
        _ => get_load(message),
    }
}

/// The engine's checks of a request, with the status a refusal gets.
fn validate(
    cfg: &ModelConfig,
    prompt: &[u32],
    sampling: &SamplingParams,
    stop: &StopParams,
) -> bool {
    match validate_request(cfg, POOL_BLOCKS, prompt, sampling, stop) {
        Ok(()) => true,
        Err(e) => {
            let _ = engine_status(&e);
            false
        }
    }
}

fn prefill(cfg: &ModelConfig, message: &[u8]) {
    let Ok(req) = pb::PrefillRequest::decode(message) else {
        return;
    };
    let sampling = sampling_from_proto(req.sampling.as_ref());
    let stop = prefill_stop(req.stop.as_ref());
    if !validate(cfg, &req.prompt, &sampling, &stop) {
        return;
    }
    if let Some(dest) = req.destination {
        let _ = prefill_first_block(cfg, req.prompt.len(), dest.first_block);
    }
}

fn generate(cfg: &ModelConfig, message: &[u8]) {
    let Ok(req) = pb::GenerateRequest::decode(message) else {
        return;
    };
    let sampling = sampling_from_proto(req.sampling.as_ref());
    let stop = stop_from_proto(req.stop.as_ref());
    let _ = tpot_target(req.tpot_target_ms);
    if !validate(cfg, &req.prompt, &sampling, &stop) {
        return;
    }
    if pb::Mode::try_from(req.mode) != Ok(pb::Mode::Disaggregated) {
        return;
    }
    let split = req.split_prompt_at as usize;
    if split > 0 {
        let _ = split_declined(cfg, req.prompt.len(), split, &sampling);
    }
    // What a reservation with nothing cached needs: the prompt's blocks from the first that
    // a sliding window still reads (`validate_request` bounded the prompt by the pool).
    let first = cfg.first_needed_block(req.prompt.len());
    let _ = tandem_kv::blocks_for(req.prompt.len()) - first;
    let _ = lease_ttl(
        req.lease_ttl_ms,
        Duration::from_secs(30),
        Duration::from_secs(60),
    );
}

/// `lease` as the handlers see it: empty names the open lease.
fn lease_of(lease: &mut Vec<u8>, open: &tandem_transfer::Lease) {
    if lease.is_empty() {
        *lease = open.token().as_bytes().to_vec();
    }
}

/// The `PushKv` receiver over the decoded stream; the bytes it committed.
fn push_kv(mut message: &[u8]) -> Option<Result<u64, TransferError>> {
    with_lease(|table, open| {
        // The stream as tonic hands it over: messages until one fails to decode, which
        // fails the stream there.
        let mut items = Vec::new();
        while !message.is_empty() {
            match pb::KvMessage::decode_length_delimited(&mut message) {
                Ok(mut msg) => {
                    match &mut msg.msg {
                        Some(Msg::Header(h)) => lease_of(&mut h.lease, open),
                        Some(Msg::Commit(c)) => lease_of(&mut c.lease, open),
                        _ => {}
                    }
                    items.push(Ok(msg));
                }
                Err(e) => {
                    items.push(Err(tonic::Status::internal(e.to_string())));
                    break;
                }
            }
        }
        let mut stream = futures::stream::iter(items);
        block_on(receive_push_kv(table, &mut stream))
    })
    .flatten()
}

fn commit_kv(message: &[u8]) {
    let Ok(mut commit) = pb::KvCommit::decode(message) else {
        return;
    };
    with_lease(|table, open| {
        lease_of(&mut commit.lease, open);
        if commit.transport == pb::Transport::Nccl as i32 {
            // The handler first waits (up to 10 s) for the link's last layer; then this.
            let _ = table.commit(&commit);
        } else {
            let _ = block_on(kv_rpcs::commit_kv(table, Request::new(commit)));
        }
    });
}

fn renew_lease(message: &[u8]) {
    let Ok(mut req) = pb::RenewLeaseRequest::decode(message) else {
        return;
    };
    with_lease(|table, open| {
        lease_of(&mut req.lease, open);
        let _ = kv_rpcs::renew_lease(table, Request::new(req));
    });
}

fn pull_kv(message: &[u8]) {
    let Ok(mut req) = pb::PullKvRequest::decode(message) else {
        return;
    };
    with_lease(|table, open| {
        lease_of(&mut req.lease, open);
        block_on(async {
            // The answer is a spawned task's stream: read to its end, as a caller would.
            if let Ok(answer) = kv_rpcs::pull_kv(table, Request::new(req)) {
                let mut stream = answer.into_inner();
                while futures::StreamExt::next(&mut stream).await.is_some() {}
            }
        });
    });
}

fn get_info(message: &[u8]) {
    let Ok(req) = pb::InfoRequest::decode(message) else {
        return;
    };
    let mut info = pb::WorkerInfo {
        worker_id: "fuzz".into(),
        role: pb::Role::Decode as i32,
        ..pb::WorkerInfo::default()
    };
    tandem_transfer::fuzzing::auth().sign_worker_info(&mut info, &req.challenge);
}

/// A pool whose prefix cache named and freed a few blocks (so it has events to report).
fn named_pool() -> &'static SharedPool {
    static POOL: OnceLock<SharedPool> = OnceLock::new();
    POOL.get_or_init(|| {
        let pool = SharedPool::new(POOL_BLOCKS);
        {
            let mut p = pool.lock();
            if let Ok(blocks) = p.allocate(6) {
                for (name, &b) in (1u128..).zip(&blocks) {
                    let _ = p.name(b, name << 64 | name);
                }
                let _ = p.release(&blocks);
            }
            // Some evicted: names removed as well as stored.
            let _ = p.allocate(POOL_BLOCKS - 2).map(|b| p.release(&b));
        }
        pool
    })
}

fn get_load(message: &[u8]) {
    let Ok(req) = pb::LoadRequest::decode(message) else {
        return;
    };
    if let Some(cursor) = req.block_events_after {
        let page = named_pool().events_since(cursor, req.snapshot_from_block, NAMES_PER_REPORT);
        let _ = (names_to_bytes(&page.stored), names_to_bytes(&page.removed));
    }
}

#[cfg(test)]
mod tests;
