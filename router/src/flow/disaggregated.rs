//! The disaggregated run, in three phases: open the lease (the decode worker reserves KV
//! blocks for the prompt and says where they are), prefill while renewing it (the prefill
//! worker computes the prompt and writes its KV there, while the lease is kept alive and the
//! decode worker's first token awaited), and build the head (from the prefill's answer).
//! A split prompt (SLO placement) runs the same way, but the prefill worker computes and
//! sends only its first part, and the decode worker computes the rest before its first token.
//!
//! Every early return drops the `Generate` stream, which makes the decode worker cancel the
//! reservation and free its blocks at once.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use tandem_auth::AuthChannel;
use tandem_proto::v1::decode_service_client::DecodeServiceClient;
use tandem_proto::v1::generate_event::Event;
use tandem_proto::v1::{
    GenerateEvent, KvDestination, Lease, Mode, PrefillRequest, PrefillResponse, RenewLeaseRequest,
    SamplingParams, StopParams, Transport, WorkerInfo,
};
use tonic::Streaming;

use super::aggregated::run_here;
use super::decode::{
    AttemptError, DecodeItem, Live, decode_failure, decode_protocol_error, generate_request,
    grpc_request, item_of, lease_ended_without_kv,
};
use super::events::{Head, RunMode, prompt_entries, transport_name};
use super::outcome::Timing;
use super::request::{FlowContext, FlowRequest};
use crate::error::ApiError;
use crate::metrics as m;
use crate::routing::PromptNames;
use crate::workers::Worker;

/// Failure of a disaggregated attempt: which side failed decides what is tried next.
pub(super) enum DisaggError {
    Decode(AttemptError),
    Prefill(ApiError),
    /// The prefill ran but its KV did not reach the decode worker.
    Transfer(ApiError),
}

/// What opening the lease gave: a reservation to prefill toward, or a request the decode
/// worker took on itself. (Boxed: both are large, and one is made per request.)
enum Opened {
    Leased(Box<Reservation>),
    /// Its prefix cache held all but a short suffix: it prefilled that itself, and the first
    /// token is in.
    RanHere(Box<Live>),
}

/// KV blocks reserved on the decode worker, and where the prefill worker is to write them.
struct Reservation {
    /// The decode worker's `Generate`: its tokens come once the KV has landed.
    stream: Streaming<GenerateEvent>,
    /// The decode worker's client, for renewals.
    client: DecodeServiceClient<AuthChannel>,
    /// The lease's capability, as granted.
    token: Vec<u8>,
    /// The lease period the decode worker granted.
    granted_ttl_ms: u32,
    destination: KvDestination,
    /// The blocks the prefill worker is to move (the destination's).
    kv_blocks: u32,
    /// Prompt tokens whose KV the decode worker's prefix cache holds: they are not moved.
    decode_cached_tokens: u32,
    /// The split the decode worker took: the prefill worker computes the prompt's first this
    /// many tokens (0: all of them).
    split: u32,
}

/// A reservation whose prefill has answered and whose first token is in.
struct Prefilled {
    answer: PrefillResponse,
    stream: Streaming<GenerateEvent>,
    early: VecDeque<DecodeItem>,
    kv_blocks: u32,
    decode_cached_tokens: u32,
}

/// Runs the request on `decode` with its prompt prefilled on `prefill` (its first `split_at`
/// tokens, when not 0), up to the head.
pub(super) async fn run_disaggregated(
    ctx: &FlowContext,
    req: &FlowRequest,
    decode: &Arc<Worker>,
    prefill: &Worker,
    names: &mut PromptNames<'_>,
    split_at: u32,
    timing: &mut Timing,
) -> Result<Live, DisaggError> {
    let reservation = match open_lease(ctx, req, decode, prefill, split_at, timing).await? {
        Opened::Leased(reservation) => *reservation,
        Opened::RanHere(live) => return Ok(*live),
    };
    let prefilled =
        prefill_while_renewing(req, decode, prefill, names, reservation, timing).await?;
    Ok(build_head(ctx, req, decode, prefilled))
}

/// Phase 1: opens `Generate` on the decode worker, whose first event is the lease (or word
/// that it runs the request itself), and turns the lease into the prefill's destination.
async fn open_lease(
    ctx: &FlowContext,
    req: &FlowRequest,
    decode: &Arc<Worker>,
    prefill: &Worker,
    split_at: u32,
    timing: &mut Timing,
) -> Result<Opened, DisaggError> {
    let decode_info = decode
        .info()
        .ok_or(DisaggError::Decode(AttemptError::DecodeDown(
            ApiError::WorkerUnavailable,
        )))?;
    let mut client = decode.decode_client();
    let mut generate = generate_request(ctx, req, Mode::Disaggregated);
    generate.split_prompt_at = split_at;
    let request = grpc_request(generate, &req.request_id);
    let mut stream = client
        .generate(request)
        .await
        .map_err(|s| DisaggError::Decode(decode_failure(decode, &s)))?
        .into_inner();
    let lease = match stream.message().await {
        Ok(Some(GenerateEvent {
            event: Some(Event::Lease(lease)),
        })) => lease,
        Ok(Some(GenerateEvent {
            event: Some(Event::Local(local)),
        })) => return run_locally(req, decode, stream, local.cached_tokens, timing).await,
        Ok(_) => {
            return Err(DisaggError::Decode(decode_protocol_error(
                decode,
                "the first event of a disaggregated Generate was not a lease",
            )));
        }
        Err(status) => return Err(DisaggError::Decode(decode_failure(decode, &status))),
    };
    let decode_cached_tokens = lease.cached_tokens.min(req.prompt.len() as u32);
    let split = lease.split_prompt_at;
    if split != 0 && (split != split_at || split <= decode_cached_tokens) {
        return Err(DisaggError::Decode(decode_protocol_error(
            decode,
            "the lease took a split that was not asked for",
        )));
    }
    if split == 0 && split_at != 0 {
        tracing::debug!(decode = %decode.url, split_at, "the decode worker declined the split: the prefill worker computes the whole prompt");
        timing.forget_prediction();
    }
    let token = lease.token.clone();
    // The period the decode worker granted (it caps what we ask); older workers say nothing.
    let granted_ttl_ms = match lease.ttl_ms {
        0 => ctx.lease_ttl_ms,
        ms => ms,
    };
    let destination = destination(
        ctx,
        decode,
        &decode_info,
        prefill,
        lease,
        decode_cached_tokens,
        granted_ttl_ms,
    );
    Ok(Opened::Leased(Box::new(Reservation {
        stream,
        client,
        token,
        granted_ttl_ms,
        kv_blocks: u32::try_from(destination.block_ids.len()).unwrap_or(u32::MAX),
        destination,
        decode_cached_tokens,
        split,
    })))
}

/// The decode worker's cache holds all but a short suffix of the prompt: it prefills that
/// itself, and the request runs there.
async fn run_locally(
    req: &FlowRequest,
    decode: &Arc<Worker>,
    stream: Streaming<GenerateEvent>,
    cached_tokens: u32,
    timing: &mut Timing,
) -> Result<Opened, DisaggError> {
    let cached = cached_tokens.min(req.prompt.len() as u32);
    tracing::debug!(decode = %decode.url, cached_tokens = cached, "the decode worker runs the uncached suffix itself");
    metrics::counter!(m::LOCAL_PREFILLS_TOTAL).increment(1);
    run_here(req, decode, stream, None, cached, timing)
        .await
        .map(|live| Opened::RanHere(Box::new(live)))
        .map_err(DisaggError::Decode)
}

/// Where the prefill worker is to write the prompt's KV: the lease's blocks on `decode`.
fn destination(
    ctx: &FlowContext,
    decode: &Worker,
    decode_info: &WorkerInfo,
    prefill: &Worker,
    lease: Lease,
    decode_cached_tokens: u32,
    granted_ttl_ms: u32,
) -> KvDestination {
    // The decode worker's cache holds the prompt's first blocks: they are not sent, and the
    // lease's blocks start after them.
    let block_size = decode_info
        .kv_layout
        .as_ref()
        .map_or(tandem_kv::BLOCK_SIZE as u32, |l| l.block_size.max(1));
    let first_block = decode_cached_tokens / block_size;
    tracing::debug!(
        decode = %decode.url,
        prefill = %prefill.url,
        blocks = lease.block_ids.len(),
        first_block,
        "lease granted"
    );
    // The prefill worker gets the decode worker (its endpoint and the instance we verified),
    // never addresses: it verifies the worker itself and uses what that worker advertises.
    KvDestination {
        transport: ctx.pool.transport() as i32,
        decode_endpoint: decode.url.clone(),
        decode_instance: decode_info.instance_id.clone(),
        lease: lease.token,
        block_ids: lease.block_ids,
        kv_layout_hash: decode_info.kv_layout_hash.clone(),
        first_block,
        lease_ttl_ms: granted_ttl_ms,
    }
}

/// Phase 2: runs `Prefill` toward the reservation until both its answer (the KV accounting
/// in the head) and the decode worker's first token are in, renewing the lease meanwhile.
async fn prefill_while_renewing(
    req: &FlowRequest,
    decode: &Worker,
    prefill: &Worker,
    names: &mut PromptNames<'_>,
    reservation: Reservation,
    timing: &mut Timing,
) -> Result<Prefilled, DisaggError> {
    let Reservation {
        mut stream,
        client,
        token,
        granted_ttl_ms,
        destination,
        kv_blocks,
        decode_cached_tokens,
        split,
    } = reservation;
    // The prefill worker computes what its own cache lacks (of its part).
    let part = match split {
        0 => req.prompt.len(),
        at => (at as usize).min(req.prompt.len()),
    };
    let uncached = part.saturating_sub(prefill.cached_blocks(names) * tandem_kv::BLOCK_SIZE);
    // Until the prefill answers (or this returns, whatever the outcome).
    let _pending = prefill.note_prefill(uncached as u64);
    if split == 0 {
        prefill.note_prompt(names);
    } else {
        prefill.note_prompt(&mut PromptNames::new(&req.prompt[..part]));
        metrics::counter!(m::SPLIT_PROMPT_TOKENS_TOTAL, "side" => "prefill").increment(part as u64);
        metrics::counter!(m::SPLIT_PROMPT_TOKENS_TOTAL, "side" => "decode")
            .increment((req.prompt.len() - part) as u64);
    }
    let mut prefill_client = prefill.prefill_client();
    let prefill_call = prefill_client.prefill(prefill_request(req, destination, part));
    tokio::pin!(prefill_call);
    let mut prefill_answer = None;
    let mut early = VecDeque::new();
    // While the prompt waits in the prefill worker's queue no KV moves, so the decode worker
    // would expire the reservation: renew it a few times per granted lease period until the
    // prefill answers. (If this router dies, the Generate stream closes and frees it anyway.)
    let renew_every = Duration::from_millis(u64::from(granted_ttl_ms.max(300)) / 3);
    let mut renew =
        tokio::time::interval_at(tokio::time::Instant::now() + renew_every, renew_every);
    // Both are needed before the head goes out; the decode stream stays open meanwhile.
    while prefill_answer.is_none() || early.is_empty() {
        tokio::select! {
            answer = &mut prefill_call, if prefill_answer.is_none() => match answer {
                Ok(response) => prefill_answer = Some(response.into_inner()),
                // Returning drops the Generate stream, which cancels the reservation.
                Err(status) => return Err(prefill_failure(&status, decode, prefill)),
            },
            message = stream.message(), if early.is_empty() => {
                if let Err(status) = &message
                    && lease_ended_without_kv(status)
                {
                    tracing::warn!(prefill = %prefill.url, decode = %decode.url, message = status.message(), "the KV did not arrive within the lease");
                    return Err(DisaggError::Transfer(ApiError::WorkerUnavailable));
                }
                early.push_back(item_of(message, decode).map_err(DisaggError::Decode)?);
                timing.on_token(RunMode::Disaggregated);
            }
            _ = renew.tick(), if prefill_answer.is_none() => {
                // A prefill worker the health poll lost (its host's link went down, it
                // hung) will not answer in time: place the request again now rather than
                // wait on a call that may never return.
                if !prefill.is_healthy() {
                    tracing::warn!(prefill = %prefill.url, "prefill worker unhealthy while the prompt waited there; placing it again");
                    return Err(DisaggError::Prefill(ApiError::WorkerUnavailable));
                }
                renew_lease(&client, &token, &req.request_id);
            }
        }
    }
    Ok(Prefilled {
        answer: prefill_answer.unwrap_or_default(),
        stream,
        early,
        kv_blocks,
        decode_cached_tokens,
    })
}

/// Phase 3: the head, from the prefill's answer (KV bytes, transport, cached tokens) and the
/// lease; records the KV transfer's metrics.
fn build_head(
    ctx: &FlowContext,
    req: &FlowRequest,
    decode: &Arc<Worker>,
    prefilled: Prefilled,
) -> Live {
    let Prefilled {
        mut answer,
        stream,
        early,
        kv_blocks,
        decode_cached_tokens,
    } = prefilled;
    let prompt_logprobs = prompt_entries(req, std::mem::take(&mut answer.prompt_logprobs));
    let transport = Transport::try_from(answer.transport)
        .ok()
        .filter(|t| *t != Transport::Unspecified)
        .unwrap_or(ctx.pool.transport());
    let label = transport_name(Some(transport));
    metrics::counter!(m::KV_TRANSFER_BYTES_TOTAL, "transport" => label).increment(answer.kv_bytes);
    metrics::histogram!(m::KV_TRANSFER_SECONDS, "transport" => label)
        .record(answer.transfer_seconds);
    metrics::counter!(m::KV_PULLED_BYTES_TOTAL).increment(answer.pulled_bytes);
    let cached_tokens = answer.cached_tokens.min(req.prompt.len() as u32);
    Live {
        head: Head {
            mode: RunMode::Disaggregated,
            kv_bytes: answer.kv_bytes,
            transport: Some(transport),
            fallback: None,
            prompt_logprobs,
            cached_tokens,
            kv_blocks,
            decode_cached_tokens,
            prefill_pulled_tokens: answer.pulled_tokens.min(cached_tokens),
        },
        stream,
        decode: Arc::clone(decode),
        early,
    }
}

/// The `Prefill` of `req`'s first `part` prompt tokens toward `destination`. Of a split
/// prompt's first part, only the KV is used: its token is sampled greedily and dropped.
fn prefill_request(
    req: &FlowRequest,
    destination: KvDestination,
    part: usize,
) -> tonic::Request<PrefillRequest> {
    let whole = part >= req.prompt.len();
    let (sampling, stop) = if whole {
        (req.sampling.clone(), req.stop.clone())
    } else {
        let sampling = SamplingParams {
            n: 1,
            ..SamplingParams::default()
        };
        let stop = StopParams {
            max_tokens: 1,
            ..StopParams::default()
        };
        (sampling, stop)
    };
    grpc_request(
        PrefillRequest {
            request_id: req.request_id.clone(),
            prompt: req.prompt[..part.min(req.prompt.len())].to_vec(),
            sampling: Some(sampling),
            destination: Some(destination),
            stop: Some(stop),
        },
        &req.request_id,
    )
}

/// Classifies a failed `Prefill` by the side at fault.
fn prefill_failure(status: &tonic::Status, decode: &Worker, prefill: &Worker) -> DisaggError {
    if status.code() == tonic::Code::Aborted {
        // The prefill worker is fine: the KV could not reach this decode worker (it refused,
        // died, could not be verified, or the link between them failed). The caller runs the
        // request aggregated there, or on another decode worker if this one is down; the
        // decode worker's own poll finds out which.
        tracing::warn!(prefill = %prefill.url, decode = %decode.url, message = status.message(), "KV transfer to the decode worker failed");
        decode.probe_now();
        return DisaggError::Transfer(ApiError::WorkerUnavailable);
    }
    tracing::warn!(prefill = %prefill.url, code = ?status.code(), message = status.message(), "prefill failed");
    prefill.report_failure(status);
    DisaggError::Prefill(ApiError::from_worker_status(status))
}

/// Renews the lease without waiting for the answer: a slow renewal must not hold up the
/// prefill's answer or the first token, and a failed one is the decode worker's to act on.
fn renew_lease(client: &DecodeServiceClient<AuthChannel>, token: &[u8], request_id: &str) {
    let mut renewer = client.clone();
    let request = grpc_request(
        RenewLeaseRequest {
            lease: token.to_vec(),
        },
        request_id,
    );
    tokio::spawn(async move {
        if let Err(status) = renewer.renew_lease(request).await {
            tracing::debug!(code = ?status.code(), "lease renewal failed");
        }
    });
}
