//! The decode worker's `Generate` call as every step of the flow reads it: the request that
//! opens it, the tokens and finishes it streams after its first event, and how a failure of
//! the worker or of the exchange is classified (another decode worker may be tried, or not).
//! Also `Live`, a generation whose first token is in: what an attempt hands to the pump.

use std::collections::VecDeque;
use std::sync::Arc;

use tandem_proto::v1::generate_event::Event;
use tandem_proto::v1::{Finished, GenerateEvent, GenerateRequest, Mode, TokenEvent};
use tonic::Streaming;

use super::events::Head;
use super::request::{FlowContext, FlowRequest};
use crate::config::PlacementPolicy;
use crate::error::ApiError;
use crate::workers::{Worker, status_means_worker_down};

/// A decode stream item after the lease.
pub(super) enum DecodeItem {
    Token(TokenEvent),
    Finished(Finished),
}

/// Failure of one attempt before the head.
pub(super) enum AttemptError {
    /// The decode worker is down: another decode worker may be tried.
    DecodeDown(ApiError),
    /// The prompt's KV could not reach the decode worker (the link between the workers
    /// failed or stalled past the lease), which is otherwise fine: another decode worker
    /// may be tried, else this one runs the prompt itself.
    TransferFailed(ApiError),
    /// Give up with this error.
    Fatal(ApiError),
}

impl AttemptError {
    pub(super) fn into_api(self) -> ApiError {
        match self {
            AttemptError::DecodeDown(e)
            | AttemptError::TransferFailed(e)
            | AttemptError::Fatal(e) => e,
        }
    }
}

/// A generation whose first token is in: the head, the open stream, what came early.
pub(super) struct Live {
    pub(super) head: Head,
    pub(super) stream: Streaming<GenerateEvent>,
    pub(super) decode: Arc<Worker>,
    pub(super) early: VecDeque<DecodeItem>,
}

/// A worker call carrying the request id, so the workers' logs name the request too.
pub(super) fn grpc_request<T>(message: T, request_id: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Ok(v) = request_id.parse() {
        request.metadata_mut().insert("x-request-id", v);
    }
    request
}

/// The `Generate` of `req` in `mode`.
pub(super) fn generate_request(
    ctx: &FlowContext,
    req: &FlowRequest,
    mode: Mode,
) -> GenerateRequest {
    GenerateRequest {
        request_id: req.request_id.clone(),
        prompt: req.prompt.clone(),
        sampling: Some(req.sampling.clone()),
        stop: Some(req.stop.clone()),
        mode: mode as i32,
        lease_ttl_ms: match mode {
            Mode::Disaggregated => ctx.lease_ttl_ms,
            _ => 0,
        },
        // The threshold applies to what the decode worker's cache lacks, which only it knows.
        local_prefill_below: match mode {
            Mode::Disaggregated => ctx.agg_threshold,
            _ => 0,
        },
        // Under SLO placement the decode worker paces prompt chunks to its streams' targets.
        tpot_target_ms: match ctx.placement {
            PlacementPolicy::Slo => req.slo.tpot_ms.ceil().clamp(1.0, f64::from(u32::MAX)) as u32,
            PlacementPolicy::Static => 0,
        },
        split_prompt_at: 0,
    }
}

/// Logs a decode worker's failure, marks it down when it is, and classifies the error.
pub(super) fn decode_failure(decode: &Worker, status: &tonic::Status) -> AttemptError {
    tracing::warn!(decode = %decode.url, code = ?status.code(), message = status.message(), "decode worker call failed");
    let e = ApiError::from_worker_status(status);
    decode.report_failure(status);
    if status_means_worker_down(status) {
        AttemptError::DecodeDown(e)
    } else {
        AttemptError::Fatal(e)
    }
}

/// A broken exchange (wrong event order, stream ended early): the worker is misbehaving.
pub(super) fn decode_protocol_error(decode: &Worker, what: &str) -> AttemptError {
    tracing::error!(decode = %decode.url, "decode worker protocol error: {what}");
    decode.report_protocol_error(what);
    AttemptError::Fatal(ApiError::WorkerFailed)
}

/// The next token or finish; a Lease here is a protocol error.
pub(super) async fn next_item(
    stream: &mut Streaming<GenerateEvent>,
    decode: &Worker,
) -> Result<DecodeItem, AttemptError> {
    item_of(stream.message().await, decode)
}

/// What the decode worker ended a reservation with when its KV never fully arrived: the lease
/// expired waiting (`DEADLINE_EXCEEDED`) or the transfer broke (`DATA_LOSS`). The decode
/// worker is fine and has freed the blocks; the request can run there aggregated.
pub(super) fn lease_ended_without_kv(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::DeadlineExceeded | tonic::Code::DataLoss
    )
}

/// [`next_item`] for a message already read.
pub(super) fn item_of(
    message: Result<Option<GenerateEvent>, tonic::Status>,
    decode: &Worker,
) -> Result<DecodeItem, AttemptError> {
    match message {
        Ok(Some(GenerateEvent {
            event: Some(Event::Token(t)),
        })) => Ok(DecodeItem::Token(t)),
        Ok(Some(GenerateEvent {
            event: Some(Event::Finished(f)),
        })) => Ok(DecodeItem::Finished(f)),
        Ok(Some(GenerateEvent {
            event: Some(Event::Lease(_) | Event::Local(_)),
        })) => Err(decode_protocol_error(
            decode,
            "a lease or local prefill after the first event",
        )),
        Ok(Some(GenerateEvent { event: None })) => {
            Err(decode_protocol_error(decode, "an empty event"))
        }
        Ok(None) => Err(decode_protocol_error(
            decode,
            "the stream ended without a Finished event",
        )),
        Err(status) => Err(decode_failure(decode, &status)),
    }
}
