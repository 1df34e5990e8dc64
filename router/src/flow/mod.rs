//! One request's life across the workers: pick workers, open `DecodeService.Generate`, get
//! the lease, run `PrefillService.Prefill` toward it, retry or fall back while nothing has
//! reached the client, then pump tokens to the HTTP layer.
//!
//! Ownership and cancellation: a spawned task per request owns both gRPC calls. It talks to
//! the HTTP layer through a oneshot (the response head, or an error with a real status code)
//! and a bounded mpsc (the events after it). The mpsc receiver lives in the handler until the
//! head is sent and in the response body after that, so when the client goes away the
//! receiver is dropped, `tx.closed()` fires, and the task returns — dropping the Generate
//! stream and the Prefill future, which makes tonic reset both RPCs and the workers free the
//! request's blocks at once.
//!
//! Retries happen only before the head: after a decode worker died (once, on another decode
//! worker) and after a prefill failure (once, on another prefill worker, then aggregated if
//! `--fallback aggregated`). A failure after the head ends the stream with an error event.
//!
//! A request of `n` choices is one generation on the workers: its token and finish events
//! name their choice, and the flow ends after the n-th finish (which says it is the last).
//!
//! This file starts the request task and runs it through the steps, each in its own file:
//! `attempt` (workers, retries, fallback; `place` when placing by the latency targets) up to
//! the head, won by `aggregated::run_aggregated`
//! or `disaggregated::run_disaggregated`; then `pump`. `request` and `events` are what goes
//! in and comes out, `decode` is the decode worker's stream as every step reads it, and
//! `outcome` what a request leaves in the metrics.

mod aggregated;
mod attempt;
mod decode;
mod disaggregated;
mod events;
mod outcome;
mod place;
mod pump;
mod request;

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;

pub use events::{FinishOut, FlowEvent, Head, PromptEntry, RunMode, TokenOut, transport_name};
pub use request::{FlowContext, FlowRequest};

use crate::admission::InFlight;
use crate::error::ApiError;
use outcome::{Outcome, Timing, record_outcome};

/// Events buffered between the request task and a slow client.
const EVENT_BUFFER: usize = 64;

/// A started generation: the head, and the events to stream after it.
#[derive(Debug)]
pub struct FlowStream {
    pub head: Head,
    pub events: mpsc::Receiver<FlowEvent>,
}

/// A generation whose request task runs, before its head: the head comes with the first
/// token (or an error that has sent nothing to the client yet).
#[derive(Debug)]
pub struct FlowPending {
    head: oneshot::Receiver<Result<Head, ApiError>>,
    events: mpsc::Receiver<FlowEvent>,
}

impl FlowPending {
    /// Waits for the head. An error here has not sent anything to the client, so it becomes
    /// a real HTTP status.
    pub async fn head(self) -> Result<FlowStream, ApiError> {
        match self.head.await {
            Ok(Ok(head)) => Ok(FlowStream {
                head,
                events: self.events,
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => {
                tracing::error!("request task ended without an answer");
                Err(ApiError::Internal)
            }
        }
    }

    /// The head's receiver and the events, for a caller that must not wait for the head
    /// alone (a stream that sends keep-alives meanwhile).
    pub fn into_parts(
        self,
    ) -> (
        oneshot::Receiver<Result<Head, ApiError>>,
        mpsc::Receiver<FlowEvent>,
    ) {
        (self.head, self.events)
    }
}

/// Starts the request task. Dropping the returned value (the client went away) cancels it.
pub fn start(ctx: Arc<FlowContext>, req: FlowRequest, in_flight: InFlight) -> FlowPending {
    let (head_tx, head_rx) = oneshot::channel();
    let (tx, rx) = mpsc::channel(EVENT_BUFFER);
    let task = drive(ctx, req, head_tx, tx, in_flight).instrument(tracing::Span::current());
    tokio::spawn(task);
    FlowPending {
        head: head_rx,
        events: rx,
    }
}

/// The request task: the head (or the error before it), then the pump, then the metrics.
async fn drive(
    ctx: Arc<FlowContext>,
    req: FlowRequest,
    head_tx: oneshot::Sender<Result<Head, ApiError>>,
    tx: mpsc::Sender<FlowEvent>,
    in_flight: InFlight,
) {
    let _in_flight = in_flight;
    let mut timing = Timing::new(req.arrival);
    let established = tokio::select! {
        biased;
        _ = tx.closed() => {
            tracing::info!("client went away before the first token; request cancelled");
            return record_outcome(&Outcome::Cancelled(None), req.arrival);
        }
        r = with_deadline(req.deadline, attempt::establish(&ctx, &req, &mut timing)) => r,
    };
    let live = match established {
        Ok(live) => live,
        Err(e) => {
            record_outcome(&Outcome::Failed(None, e.kind()), req.arrival);
            let _ = head_tx.send(Err(e));
            return;
        }
    };
    let mode = live.head.mode;
    if head_tx.send(Ok(live.head.clone())).is_err() {
        tracing::info!("client went away before the response head; request cancelled");
        live.decode.note_ended();
        return record_outcome(&Outcome::Cancelled(Some(mode)), req.arrival);
    }
    let decode = Arc::clone(&live.decode);
    let outcome = pump::pump(live, &req, &tx, &mut timing).await;
    decode.note_ended();
    if matches!(outcome, Outcome::Ok(..)) {
        timing.settle(&req, &ctx);
    }
    match &outcome {
        Outcome::Ok(_, f) => tracing::info!(
            mode = mode.as_str(),
            prompt_tokens = f.prompt_tokens,
            completion_tokens = f.total_completion_tokens,
            kv_bytes = f.kv_bytes,
            "request finished"
        ),
        Outcome::Cancelled(_) => tracing::info!("client went away; request cancelled"),
        Outcome::Failed(..) => {}
    }
    record_outcome(&outcome, req.arrival);
}

async fn with_deadline<T>(
    deadline: Option<Instant>,
    fut: impl Future<Output = Result<T, ApiError>>,
) -> Result<T, ApiError> {
    match deadline {
        None => fut.await,
        Some(d) => tokio::time::timeout_at(d.into(), fut)
            .await
            .unwrap_or(Err(ApiError::Timeout)),
    }
}
