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

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tandem_proto::v1::generate_event::Event;
use tandem_proto::v1::{
    FinishReason, Finished, GenerateEvent, GenerateRequest, KvDestination, Mode, PrefillRequest,
    RenewLeaseRequest, SamplingParams, StopParams, TokenEvent, Transport,
};
use tokio::sync::{mpsc, oneshot};
use tonic::Streaming;
use tracing::Instrument;

use crate::admission::InFlight;
use crate::api::error::ApiError;
use crate::config::{FallbackPolicy, RoutingPolicy};
use crate::metrics as m;
use crate::routing::{self, FallbackReason, ModeDecision, PickRule, PromptNames};
use crate::workers::{Worker, WorkerPool, WorkerRole, status_means_worker_down};

/// Events buffered between the request task and a slow client.
const EVENT_BUFFER: usize = 64;

/// What the flow needs from the router's configuration.
#[derive(Debug)]
pub struct FlowContext {
    pub pool: Arc<WorkerPool>,
    pub agg_threshold: u32,
    pub fallback: FallbackPolicy,
    pub lease_ttl_ms: u32,
    pub routing: RoutingPolicy,
    pub kv_overlap_weight: f64,
    /// Round robin's next turn, per role.
    pub decode_turn: AtomicUsize,
    pub prefill_turn: AtomicUsize,
}

impl FlowContext {
    /// The rule of one pick for `req` (advancing the role's round-robin turn).
    fn rule(&self, req: &FlowRequest, turn: &AtomicUsize) -> PickRule {
        PickRule {
            policy: self.routing,
            weight: self.kv_overlap_weight,
            prompt_blocks: u32::try_from(tandem_kv::blocks_for(req.prompt.len()))
                .unwrap_or(u32::MAX),
            prompt_tokens: req.prompt.len() as u64,
            turn: match self.routing {
                RoutingPolicy::RoundRobin => turn.fetch_add(1, Ordering::Relaxed),
                _ => 0,
            },
        }
    }
}

/// A validated, tokenized request.
#[derive(Debug, Clone)]
pub struct FlowRequest {
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub stop: StopParams,
    /// Tokens that end generation unless `stop.ignore_eos`.
    pub eos_token_ids: Vec<u32>,
    /// Hold every token until the next event so that the last one always carries the
    /// finish. Needed where a stream must end on a token event (TGI) and the last token
    /// cannot be foreseen (stop strings); it delays each token by one inter-token gap.
    pub hold_every_token: bool,
    pub arrival: Instant,
    pub deadline: Option<Instant>,
}

/// How the request ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunMode {
    Disaggregated,
    Aggregated,
}

impl RunMode {
    pub fn as_str(self) -> &'static str {
        match self {
            RunMode::Disaggregated => "disaggregated",
            RunMode::Aggregated => "aggregated",
        }
    }
}

/// What is known when the response head goes out: after the first token (and, when
/// disaggregated, the prefill's answer).
#[derive(Debug, Clone)]
pub struct Head {
    pub mode: RunMode,
    /// KV bytes the prefill worker reports sending (0 aggregated).
    pub kv_bytes: u64,
    /// The KV transport used (None aggregated).
    pub transport: Option<Transport>,
    pub fallback: Option<FallbackReason>,
    /// When the request asked for prompt logprobs: one entry per prompt token from the
    /// second on (from the prefill worker's answer, or the first token aggregated).
    pub prompt_logprobs: Vec<PromptEntry>,
    /// Disaggregated: prompt tokens the prefill worker found in its prefix cache.
    pub cached_tokens: u32,
    /// KV blocks moved from the prefill worker to the decode worker (0 aggregated).
    pub kv_blocks: u32,
    /// Prompt tokens whose KV the decode worker's prefix cache already held, so they were
    /// not moved (disaggregated) or not computed (run on the decode worker).
    pub decode_cached_tokens: u32,
    /// Of `cached_tokens`, those the prefill worker read back from the decode worker's cached
    /// prefix for this request instead of computing them (0 aggregated).
    pub prefill_pulled_tokens: u32,
}

/// One prompt token's logprob given the tokens before it (see `tandem-engine`'s
/// `PromptLogprob`: the raw model output).
#[derive(Debug, Clone, PartialEq)]
pub struct PromptEntry {
    pub logprob: f32,
    /// 1-based rank in the vocabulary.
    pub rank: u32,
    pub top_logprobs: Vec<(u32, f32)>,
}

/// A worker's prompt logprobs, kept only as far as the request allows: one per prompt token
/// after the first, as many alternatives as asked (a worker's extras are dropped).
fn prompt_entries(
    req: &FlowRequest,
    wire: Vec<tandem_proto::v1::PromptLogprob>,
) -> Vec<PromptEntry> {
    let Some(k) = req.sampling.prompt_logprobs else {
        return Vec::new();
    };
    wire.into_iter()
        .take(req.prompt.len().saturating_sub(1))
        .map(|e| PromptEntry {
            logprob: e.logprob,
            rank: e.rank,
            top_logprobs: e
                .top_logprobs
                .into_iter()
                .take(k as usize)
                .map(|t| (t.id, t.logprob))
                .collect(),
        })
        .collect()
}

/// The name of a transport in headers and usage (`shm`, `tcp`, `grpc`, `cuda-ipc`, `nccl`,
/// or `none`).
pub fn transport_name(t: Option<Transport>) -> &'static str {
    match t {
        Some(Transport::Shm) => "shm",
        Some(Transport::Tcp) => "tcp",
        Some(Transport::Grpc) => "grpc",
        Some(Transport::CudaIpc) => "cuda-ipc",
        Some(Transport::Nccl) => "nccl",
        Some(Transport::Unspecified) | None => "none",
    }
}

/// One generated token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenOut {
    /// Which of the request's choices it belongs to.
    pub choice: u32,
    pub id: u32,
    pub text: String,
    pub logprob: f32,
    pub index: u32,
    pub special: bool,
    /// The most likely tokens at this position, most likely first (as many as the request's
    /// `top_logprobs`, never more: a worker's extra ones are dropped).
    pub top_logprobs: Vec<(u32, f32)>,
}

/// The end of a generation.
#[derive(Debug, Clone, PartialEq)]
pub struct FinishOut {
    /// The choice that ended.
    pub choice: u32,
    /// Whether it was the request's last choice to end (the stream ends after it).
    pub last: bool,
    /// `Stop` covers EOS, stop tokens and stop strings; `Length` is max_tokens.
    pub reason: FinishReason,
    pub prompt_tokens: u32,
    /// This choice's tokens.
    pub completion_tokens: u32,
    /// The tokens of every choice that has ended so far (all of them on the last finish).
    pub total_completion_tokens: u32,
    pub kv_bytes: u64,
    pub transport: Option<Transport>,
    /// Prompt tokens whose KV came from a prefix cache (not computed).
    pub cached_tokens: u32,
    /// See [`Head::kv_blocks`].
    pub kv_blocks: u32,
    /// See [`Head::decode_cached_tokens`].
    pub decode_cached_tokens: u32,
    /// See [`Head::prefill_pulled_tokens`].
    pub prefill_pulled_tokens: u32,
}

/// What the HTTP layer receives after the head.
#[derive(Debug)]
pub enum FlowEvent {
    /// A token; the finish rides along when this token is known to be the last.
    Token(TokenOut, Option<FinishOut>),
    /// The finish, when it could not ride on the last token.
    Finished(FinishOut),
    /// The generation broke after the head was sent: end the stream with this error.
    Failed(ApiError),
}

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

/// A decode stream item after the lease.
enum DecodeItem {
    Token(TokenEvent),
    Finished(Finished),
}

/// Failure of one attempt before the head.
enum AttemptError {
    /// The decode worker is down: another decode worker may be tried.
    DecodeDown(ApiError),
    /// Give up with this error.
    Fatal(ApiError),
}

impl AttemptError {
    fn into_api(self) -> ApiError {
        match self {
            AttemptError::DecodeDown(e) | AttemptError::Fatal(e) => e,
        }
    }
}

/// Failure of a disaggregated attempt.
enum DisaggError {
    Decode(AttemptError),
    Prefill(ApiError),
}

/// A generation whose first token is in: the head, the open stream, what came early.
struct Live {
    head: Head,
    stream: Streaming<GenerateEvent>,
    decode: Arc<Worker>,
    early: VecDeque<DecodeItem>,
}

/// Token timing for TTFT and ITL.
struct Timing {
    arrival: Instant,
    last_token: Option<Instant>,
}

impl Timing {
    fn on_token(&mut self, mode: RunMode) {
        let now = Instant::now();
        match self.last_token {
            None => metrics::histogram!(m::TTFT_SECONDS, "mode" => mode.as_str())
                .record((now - self.arrival).as_secs_f64()),
            Some(prev) => metrics::histogram!(m::ITL_SECONDS, "mode" => mode.as_str())
                .record((now - prev).as_secs_f64()),
        }
        self.last_token = Some(now);
    }
}

/// How a request ended, for the metrics.
enum Outcome {
    Ok(RunMode, FinishOut),
    Cancelled(Option<RunMode>),
    Failed(Option<RunMode>, &'static str),
}

fn record_outcome(outcome: &Outcome, arrival: Instant) {
    let (mode, label) = match outcome {
        Outcome::Ok(mode, finish) => {
            metrics::counter!(m::TOKENS_TOTAL, "kind" => "prompt")
                .increment(u64::from(finish.prompt_tokens));
            metrics::counter!(m::TOKENS_TOTAL, "kind" => "completion")
                .increment(u64::from(finish.total_completion_tokens));
            (Some(*mode), "ok")
        }
        Outcome::Cancelled(mode) => (*mode, "cancelled"),
        Outcome::Failed(mode, kind) => (*mode, *kind),
    };
    let mode = mode.map_or("none", RunMode::as_str);
    metrics::counter!(m::REQUESTS_TOTAL, "mode" => mode, "outcome" => label).increment(1);
    metrics::histogram!(m::E2E_SECONDS, "mode" => mode, "outcome" => label)
        .record(arrival.elapsed().as_secs_f64());
}

async fn drive(
    ctx: Arc<FlowContext>,
    req: FlowRequest,
    head_tx: oneshot::Sender<Result<Head, ApiError>>,
    tx: mpsc::Sender<FlowEvent>,
    in_flight: InFlight,
) {
    let _in_flight = in_flight;
    let mut timing = Timing {
        arrival: req.arrival,
        last_token: None,
    };
    let established = tokio::select! {
        biased;
        _ = tx.closed() => {
            tracing::info!("client went away before the first token; request cancelled");
            return record_outcome(&Outcome::Cancelled(None), req.arrival);
        }
        r = with_deadline(req.deadline, establish(&ctx, &req, &mut timing)) => r,
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
        return record_outcome(&Outcome::Cancelled(Some(mode)), req.arrival);
    }
    let outcome = pump(live, &req, &tx, &mut timing).await;
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

/// Picks workers and gets the first token, retrying as the module doc says.
async fn establish(
    ctx: &FlowContext,
    req: &FlowRequest,
    timing: &mut Timing,
) -> Result<Live, ApiError> {
    let mut tried_decode: Vec<usize> = Vec::new();
    // Workers that left the pool between the candidate list and the lookup: skipped, not
    // counted as a retry.
    let mut skipped: Vec<usize> = Vec::new();
    let mut names = PromptNames::new(&req.prompt);
    loop {
        let exclude = [tried_decode.as_slice(), skipped.as_slice()].concat();
        let candidates = ctx.pool.decode_candidates(&exclude, &mut names);
        let rule = ctx.rule(req, &ctx.decode_turn);
        let Some(id) = routing::pick_decode(&candidates, &rule) else {
            return Err(match tried_decode.is_empty() {
                true => ApiError::NoDecodeWorker,
                false => ApiError::WorkerUnavailable,
            });
        };
        let Some(decode) = ctx.pool.worker(WorkerRole::Decode, id) else {
            skipped.push(id);
            continue;
        };
        match establish_on(ctx, req, &decode, &mut names, timing).await {
            Ok(live) => return Ok(live),
            Err(AttemptError::DecodeDown(e)) if tried_decode.is_empty() => {
                tracing::warn!(decode = %decode.url, "decode worker down before the first token; trying another");
                tried_decode.push(id);
                let _ = e;
            }
            Err(e) => return Err(e.into_api()),
        }
    }
}

/// Runs the request on `decode`, disaggregated when possible.
async fn establish_on(
    ctx: &FlowContext,
    req: &FlowRequest,
    decode: &Arc<Worker>,
    names: &mut PromptNames<'_>,
    timing: &mut Timing,
) -> Result<Live, AttemptError> {
    // What the request adds to the worker's blocks: its prompt less the prefix cached there.
    let new_blocks = prompt_blocks(decode, req.prompt.len())
        .saturating_sub(u32::try_from(decode.cached_blocks(names)).unwrap_or(u32::MAX));
    decode.note_dispatch(new_blocks, 0);
    decode.note_prompt(names);
    let first_prefill = routing::pick_prefill(
        &ctx.pool.prefill_candidates_for(decode, names),
        &[],
        &ctx.rule(req, &ctx.prefill_turn),
    );
    let mut decision = routing::decide_mode(
        req.prompt.len(),
        ctx.agg_threshold,
        ctx.pool.prefill_configured(),
        first_prefill,
        ctx.fallback,
    );
    let mut tried_prefill: Vec<usize> = Vec::new();
    let mut last_prefill_error: Option<ApiError> = None;
    loop {
        match decision {
            ModeDecision::Refuse => {
                return Err(AttemptError::Fatal(
                    last_prefill_error.unwrap_or(ApiError::NoPrefillWorker),
                ));
            }
            ModeDecision::Aggregated { fallback } => {
                if let Some(reason) = fallback {
                    // Per request at debug: the counter and the response say it; the worker's
                    // own state changes are logged at warn by the pool.
                    tracing::debug!(
                        reason = reason.as_str(),
                        "running aggregated instead of disaggregated"
                    );
                    metrics::counter!(m::FALLBACKS_TOTAL, "reason" => reason.as_str()).increment(1);
                }
                return run_aggregated(ctx, req, decode, fallback, timing).await;
            }
            ModeDecision::Disaggregated { prefill } => {
                let attempt = match ctx.pool.worker(WorkerRole::Prefill, prefill) {
                    Some(prefill_worker) => {
                        run_disaggregated(ctx, req, decode, &prefill_worker, names, timing).await
                    }
                    // It left the pool since the candidate list: fail over like a failure.
                    None => Err(DisaggError::Prefill(ApiError::WorkerUnavailable)),
                };
                match attempt {
                    Ok(live) => return Ok(live),
                    Err(DisaggError::Decode(e)) => return Err(e),
                    Err(DisaggError::Prefill(ApiError::WorkerRejected)) => {
                        // The request itself is invalid: no other worker will take it.
                        return Err(AttemptError::Fatal(ApiError::WorkerRejected));
                    }
                    Err(DisaggError::Prefill(e)) => {
                        tried_prefill.push(prefill);
                        last_prefill_error = Some(e);
                        let other = routing::pick_prefill(
                            &ctx.pool.prefill_candidates_for(decode, names),
                            &tried_prefill,
                            &ctx.rule(req, &ctx.prefill_turn),
                        );
                        decision = routing::decide_after_prefill_failure(
                            tried_prefill.len() < 2,
                            other,
                            ctx.fallback,
                        );
                        if let ModeDecision::Disaggregated { prefill: next } = decision {
                            let url = |id| {
                                ctx.pool
                                    .worker(WorkerRole::Prefill, id)
                                    .map_or_else(String::new, |w| w.url.clone())
                            };
                            tracing::warn!(failed = %url(prefill), next = %url(next), "prefill failed; retrying on another prefill worker");
                            metrics::counter!(m::PREFILL_RETRIES_TOTAL).increment(1);
                        }
                    }
                }
            }
        }
    }
}

fn grpc_request<T>(message: T, request_id: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Ok(v) = request_id.parse() {
        request.metadata_mut().insert("x-request-id", v);
    }
    request
}

/// Logs a decode worker's failure, marks it down when it is, and classifies the error.
fn decode_failure(decode: &Worker, status: &tonic::Status) -> AttemptError {
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
fn decode_protocol_error(decode: &Worker, what: &str) -> AttemptError {
    tracing::error!(decode = %decode.url, "decode worker protocol error: {what}");
    decode.report_protocol_error(what);
    AttemptError::Fatal(ApiError::WorkerFailed)
}

/// The next token or finish; a Lease here is a protocol error.
async fn next_item(
    stream: &mut Streaming<GenerateEvent>,
    decode: &Worker,
) -> Result<DecodeItem, AttemptError> {
    match stream.message().await {
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

fn generate_request(ctx: &FlowContext, req: &FlowRequest, mode: Mode) -> GenerateRequest {
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
    }
}

fn prompt_blocks(decode: &Worker, prompt_len: usize) -> u32 {
    let block_size = decode
        .info()
        .and_then(|i| i.kv_layout.as_ref().map(|l| l.block_size))
        .unwrap_or(16);
    routing::blocks_for_tokens(prompt_len, block_size)
}

async fn run_aggregated(
    ctx: &FlowContext,
    req: &FlowRequest,
    decode: &Arc<Worker>,
    fallback: Option<FallbackReason>,
    timing: &mut Timing,
) -> Result<Live, AttemptError> {
    let mut client = decode.decode_client();
    let request = grpc_request(
        generate_request(ctx, req, Mode::Aggregated),
        &req.request_id,
    );
    let stream = client
        .generate(request)
        .await
        .map_err(|s| decode_failure(decode, &s))?
        .into_inner();
    run_here(req, decode, stream, fallback, 0, timing).await
}

/// The rest of a request the decode worker runs itself: its first token and the head.
async fn run_here(
    req: &FlowRequest,
    decode: &Arc<Worker>,
    mut stream: Streaming<GenerateEvent>,
    fallback: Option<FallbackReason>,
    decode_cached_tokens: u32,
    timing: &mut Timing,
) -> Result<Live, AttemptError> {
    let mut first = next_item(&mut stream, decode).await?;
    timing.on_token(RunMode::Aggregated);
    let prompt_logprobs = match &mut first {
        DecodeItem::Token(t) => prompt_entries(req, std::mem::take(&mut t.prompt_logprobs)),
        DecodeItem::Finished(_) => Vec::new(),
    };
    Ok(Live {
        head: Head {
            mode: RunMode::Aggregated,
            kv_bytes: 0,
            transport: None,
            fallback,
            prompt_logprobs,
            cached_tokens: 0,
            kv_blocks: 0,
            decode_cached_tokens,
            prefill_pulled_tokens: 0,
        },
        stream,
        decode: Arc::clone(decode),
        early: VecDeque::from([first]),
    })
}

async fn run_disaggregated(
    ctx: &FlowContext,
    req: &FlowRequest,
    decode: &Arc<Worker>,
    prefill: &Arc<Worker>,
    names: &mut PromptNames<'_>,
    timing: &mut Timing,
) -> Result<Live, DisaggError> {
    let decode_info = decode
        .info()
        .ok_or(DisaggError::Decode(AttemptError::DecodeDown(
            ApiError::WorkerUnavailable,
        )))?;
    let mut client = decode.decode_client();
    let request = grpc_request(
        generate_request(ctx, req, Mode::Disaggregated),
        &req.request_id,
    );
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
        })) => {
            // Its cache holds all but a short suffix: it prefills that itself.
            let cached = local.cached_tokens.min(req.prompt.len() as u32);
            tracing::debug!(decode = %decode.url, cached_tokens = cached, "the decode worker runs the uncached suffix itself");
            metrics::counter!(m::LOCAL_PREFILLS_TOTAL).increment(1);
            return run_here(req, decode, stream, None, cached, timing)
                .await
                .map_err(DisaggError::Decode);
        }
        Ok(_) => {
            return Err(DisaggError::Decode(decode_protocol_error(
                decode,
                "the first event of a disaggregated Generate was not a lease",
            )));
        }
        Err(status) => return Err(DisaggError::Decode(decode_failure(decode, &status))),
    };
    // The decode worker's cache holds the prompt's first blocks: they are not sent, and the
    // lease's blocks start after them.
    let block_size = decode_info
        .kv_layout
        .as_ref()
        .map_or(tandem_kv::BLOCK_SIZE as u32, |l| l.block_size.max(1));
    let decode_cached_tokens = lease.cached_tokens.min(req.prompt.len() as u32);
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
    let lease_token = lease.token;
    // The period the decode worker granted (it caps what we ask); older workers say nothing.
    let granted_ttl_ms = match lease.ttl_ms {
        0 => ctx.lease_ttl_ms,
        ms => ms,
    };
    let destination = KvDestination {
        transport: ctx.pool.transport() as i32,
        decode_endpoint: decode.url.clone(),
        decode_instance: decode_info.instance_id.clone(),
        lease: lease_token.clone(),
        block_ids: lease.block_ids,
        kv_layout_hash: decode_info.kv_layout_hash.clone(),
        first_block,
    };
    let kv_blocks = u32::try_from(destination.block_ids.len()).unwrap_or(u32::MAX);
    // The prefill worker computes what its own cache lacks.
    let uncached = req
        .prompt
        .len()
        .saturating_sub(prefill.cached_blocks(names) * tandem_kv::BLOCK_SIZE);
    prefill.note_dispatch(0, uncached as u64);
    prefill.note_prompt(names);
    let mut prefill_client = prefill.prefill_client();
    let prefill_call = prefill_client.prefill(grpc_request(
        PrefillRequest {
            request_id: req.request_id.clone(),
            prompt: req.prompt.clone(),
            sampling: Some(req.sampling.clone()),
            destination: Some(destination),
            stop: Some(req.stop.clone()),
        },
        &req.request_id,
    ));
    tokio::pin!(prefill_call);
    let mut prefill_answer = None;
    let mut early = VecDeque::new();
    // While the prompt waits in the prefill worker's queue no KV moves, so the decode worker
    // would expire the reservation: renew it a few times per granted lease period until the
    // prefill answers. (If this router dies, the Generate stream closes and frees it anyway.)
    let renew_every = Duration::from_millis(u64::from(granted_ttl_ms.max(300)) / 3);
    let mut renew =
        tokio::time::interval_at(tokio::time::Instant::now() + renew_every, renew_every);
    // Both the prefill's answer (for the KV accounting in the head) and the first token are
    // needed before the head goes out; the decode stream stays open meanwhile.
    while prefill_answer.is_none() || early.is_empty() {
        tokio::select! {
            answer = &mut prefill_call, if prefill_answer.is_none() => match answer {
                Ok(response) => prefill_answer = Some(response.into_inner()),
                Err(status) if status.code() == tonic::Code::Aborted => {
                    // The prefill worker is fine: the KV could not reach this decode worker
                    // (it refused, died, or could not be verified). Another decode worker
                    // may do; the decode worker's own poll finds out about it.
                    tracing::warn!(prefill = %prefill.url, decode = %decode.url, message = status.message(), "KV transfer to the decode worker failed");
                    decode.probe_now();
                    // Returning drops the Generate stream, which cancels the reservation.
                    return Err(DisaggError::Decode(AttemptError::DecodeDown(
                        ApiError::WorkerUnavailable,
                    )));
                }
                Err(status) => {
                    tracing::warn!(prefill = %prefill.url, code = ?status.code(), message = status.message(), "prefill failed");
                    prefill.report_failure(&status);
                    // Returning drops the Generate stream, which cancels the reservation.
                    return Err(DisaggError::Prefill(ApiError::from_worker_status(&status)));
                }
            },
            item = next_item(&mut stream, decode), if early.is_empty() => {
                early.push_back(item.map_err(DisaggError::Decode)?);
                timing.on_token(RunMode::Disaggregated);
            }
            _ = renew.tick(), if prefill_answer.is_none() => {
                let mut renewer = client.clone();
                let request = grpc_request(RenewLeaseRequest { lease: lease_token.clone() }, &req.request_id);
                tokio::spawn(async move {
                    if let Err(status) = renewer.renew_lease(request).await {
                        tracing::debug!(code = ?status.code(), "lease renewal failed");
                    }
                });
            }
        }
    }
    let mut answer = prefill_answer.unwrap_or_default();
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
    Ok(Live {
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
    })
}

/// Whether `token` must be the last one, so its event can carry the finish.
fn is_known_last(req: &FlowRequest, token: &TokenEvent) -> bool {
    let may_stop = token.index >= req.stop.min_tokens;
    token.index.saturating_add(1) >= req.stop.max_tokens
        || (may_stop && !req.stop.ignore_eos && req.eos_token_ids.contains(&token.id))
        || (may_stop && req.stop.stop_token_ids.contains(&token.id))
}

fn token_out(t: TokenEvent, req: &FlowRequest) -> TokenOut {
    let mut top = t.top_logprobs;
    top.truncate(req.sampling.top_logprobs as usize);
    TokenOut {
        choice: t.choice,
        id: t.id,
        text: t.text,
        logprob: t.logprob,
        index: t.index,
        special: t.special,
        top_logprobs: top.into_iter().map(|t| (t.id, t.logprob)).collect(),
    }
}

/// Streams the rest of the generation to the HTTP layer.
async fn pump(
    mut live: Live,
    req: &FlowRequest,
    tx: &mpsc::Sender<FlowEvent>,
    timing: &mut Timing,
) -> Outcome {
    let mode = live.head.mode;
    let choices = req.sampling.n.max(1) as usize;
    // Per choice: the token held back until the next event, and whether it ended.
    let mut held: Vec<Option<TokenEvent>> = vec![None; choices];
    let mut ended = vec![false; choices];
    let mut total_completion_tokens = 0u32;
    let broken = |what: &str| Err(decode_protocol_error(&live.decode, what));
    loop {
        let item = match live.early.pop_front() {
            Some(item) => Ok(item),
            None => {
                let deadline = async {
                    match req.deadline {
                        Some(d) => tokio::time::sleep_until(d.into()).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    biased;
                    _ = tx.closed() => return Outcome::Cancelled(Some(mode)),
                    _ = deadline => Err(AttemptError::Fatal(ApiError::Timeout)),
                    item = next_item(&mut live.stream, &live.decode) => {
                        if matches!(item, Ok(DecodeItem::Token(_))) {
                            timing.on_token(mode);
                        }
                        item
                    }
                }
            }
        };
        // An event for a choice the request does not have, or one that already ended, is the
        // worker misbehaving.
        let item = match item {
            Ok(DecodeItem::Token(t)) if ended.get(t.choice as usize) != Some(&false) => {
                broken("a token of a choice that does not exist or has ended")
            }
            Ok(DecodeItem::Finished(f)) if ended.get(f.choice as usize) != Some(&false) => {
                broken("a finish of a choice that does not exist or has ended")
            }
            item => item,
        };
        match item {
            Ok(DecodeItem::Token(token)) => {
                let slot = &mut held[token.choice as usize];
                if let Some(prev) = slot.take()
                    && tx
                        .send(FlowEvent::Token(token_out(prev, req), None))
                        .await
                        .is_err()
                {
                    return Outcome::Cancelled(Some(mode));
                }
                if req.hold_every_token || is_known_last(req, &token) {
                    *slot = Some(token);
                } else if tx
                    .send(FlowEvent::Token(token_out(token, req), None))
                    .await
                    .is_err()
                {
                    return Outcome::Cancelled(Some(mode));
                }
            }
            Ok(DecodeItem::Finished(f)) => {
                let choice = f.choice as usize;
                ended[choice] = true;
                total_completion_tokens =
                    total_completion_tokens.saturating_add(f.completion_tokens);
                let mut finish = finish_out(&live.head, &f);
                finish.total_completion_tokens = total_completion_tokens;
                finish.last = ended.iter().all(|&e| e);
                if mode == RunMode::Disaggregated && finish.last {
                    metrics::histogram!(m::KV_WAIT_SECONDS, "transport" => transport_name(live.head.transport))
                        .record(f.kv_wait_seconds);
                }
                let event = match held[choice].take() {
                    Some(last) => FlowEvent::Token(token_out(last, req), Some(finish.clone())),
                    None => FlowEvent::Finished(finish.clone()),
                };
                match tx.send(event).await {
                    Ok(()) if finish.last => return Outcome::Ok(mode, finish),
                    Ok(()) => {}
                    Err(_) => return Outcome::Cancelled(Some(mode)),
                }
            }
            Err(e) => {
                let e = e.into_api();
                tracing::warn!(error = %e, "generation failed after the response head; ending the stream with an error event");
                for prev in held.iter_mut().filter_map(Option::take) {
                    let _ = tx.send(FlowEvent::Token(token_out(prev, req), None)).await;
                }
                let kind = e.kind();
                let _ = tx.send(FlowEvent::Failed(e)).await;
                return Outcome::Failed(Some(mode), kind);
            }
        }
    }
}

fn finish_out(head: &Head, f: &Finished) -> FinishOut {
    FinishOut {
        choice: f.choice,
        last: true,
        total_completion_tokens: f.completion_tokens,
        reason: match FinishReason::try_from(f.reason) {
            Ok(FinishReason::Length) => FinishReason::Length,
            _ => FinishReason::Stop,
        },
        prompt_tokens: f.prompt_tokens,
        completion_tokens: f.completion_tokens,
        kv_bytes: if head.kv_bytes > 0 {
            head.kv_bytes
        } else {
            f.kv_bytes
        },
        transport: head.transport,
        cached_tokens: match head.mode {
            RunMode::Disaggregated => head.cached_tokens,
            RunMode::Aggregated => f.cached_tokens.min(f.prompt_tokens),
        },
        kv_blocks: head.kv_blocks,
        decode_cached_tokens: match head.mode {
            RunMode::Disaggregated => head.decode_cached_tokens,
            RunMode::Aggregated => f.cached_tokens.min(f.prompt_tokens),
        },
        prefill_pulled_tokens: head.prefill_pulled_tokens,
    }
}
