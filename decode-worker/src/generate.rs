//! One request's life on the decode worker (`DecodeService.Generate`).
//!
//! Disaggregated: hold the prompt's prefix that this worker's prefix cache has, reserve blocks
//! for the rest (from the shared pool, without waiting for a forward pass), open a lease over
//! those and tell the router where the KV goes and how much is cached (or, when the uncached
//! suffix is shorter than the router's `local_prefill_below`, run the request here instead),
//! wait for the commit while watching the client and the lease's idle time, stream the first
//! token the moment the commit is verified, then hand the sequence to the engine. Aggregated: queue the whole request. A request of
//! `n` choices streams every choice's tokens on the one stream (each event names its choice)
//! and ends after the n-th Finished event.
//! Whatever happens, the blocks go back: on cancel, expiry or a failed transfer they are
//! released (after a short quarantine when remote writers exist); after admission the
//! engine owns them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_engine::engine::{first_token_output, validate_request};
use tandem_engine::{ReceivedKv, SampledToken, SamplingParams, StepOutput, StopParams};
use tandem_kv::KvError;
use tandem_proto::v1::*;
use tandem_text::Guide;
use tandem_transfer::{Commit, Lease, Opened, TransferError, top_logprobs_to_proto};
use tandem_worker::convert::{
    engine_status, finish_to_proto, prompt_logprobs_to_proto, sampling_from_proto, stop_from_proto,
};
use tandem_worker::requests;
use tandem_worker::{PrefilledPart, SeqEvent};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;
use tracing::Instrument;

use crate::state::Inner;

type Out = mpsc::Sender<Result<GenerateEvent, Status>>;

/// What the final event reports about the KV that arrived.
#[derive(Debug, Clone, Copy)]
struct KvReport {
    bytes: u64,
    wait_seconds: f64,
    transport: Transport,
}

/// Validates, then starts the request; the returned stream carries its events. `caller`
/// (the calling address) is charged for the blocks of a reservation until its KV arrives.
pub(crate) async fn start(
    inner: Arc<Inner>,
    req: GenerateRequest,
    caller: String,
) -> Result<ReceiverStream<Result<GenerateEvent, Status>>, Status> {
    let sampling = sampling_from_proto(req.sampling.as_ref());
    let stop = stop_from_proto(req.stop.as_ref());
    // A caller's target sets how long a lending worker idles after each pass: bounded.
    let tpot_target = requests::tpot_target(req.tpot_target_ms);
    let pool = inner.core.engine.pool();
    validate_request(
        inner.core.model.config(),
        pool.total(),
        &req.prompt,
        &sampling,
        &stop,
    )
    .map_err(|e| engine_status(&e))?;
    let (out, rx) = mpsc::channel(64);
    let span = tracing::info_span!("generate", request_id = %req.request_id);
    match Mode::try_from(req.mode).unwrap_or(Mode::Unspecified) {
        Mode::Disaggregated => {
            // A busy worker (its pool, or this caller's share of it, full of reservations
            // and running sequences) makes the request wait for room rather than fail it:
            // blocks come back as KV arrives and sequences end, and the caller's admission
            // control already bounds how many requests wait. Only the deadline refuses.
            let deadline = Instant::now() + inner.config.reserve_wait;
            let turn = reserve_turn(&inner, &caller);
            let Ok(_turn) = tokio::time::timeout_at(deadline.into(), turn.lock()).await else {
                return Err(Status::resource_exhausted(format!(
                    "no room to reserve the prompt's KV blocks within {} ms (earlier requests \
                     from this caller are still waiting)",
                    inner.config.reserve_wait.as_millis()
                )));
            };
            let split = accepted_split(&inner, &req, &sampling, &span);
            let mut waiting_since: Option<Instant> = None;
            let (lease, commit, cached_tokens, tail) = loop {
                // The prompt's prefix this worker's cache holds stays here (held now, so it
                // cannot be evicted while the rest arrives); only the blocks after it are
                // leased. A waiting request holds nothing: each try takes it again.
                let cached = inner.core.engine.hold_cached_prefix(&req.prompt);
                let cached_tokens = cached.len() * tandem_kv::BLOCK_SIZE;
                let uncached = req.prompt.len() - cached_tokens;
                // A split whose first part the cache holds already leaves only this
                // worker's part: it runs here.
                let split_cached = split > 0 && cached_tokens >= split;
                if split_cached
                    || (!cached.is_empty() && uncached < req.local_prefill_below as usize)
                {
                    // So little is missing that moving it would cost more than computing it.
                    release(&inner, cached, false);
                    tracing::debug!(parent: &span, cached_tokens, uncached, "prefilling the uncached suffix here");
                    let event = GenerateEvent {
                        event: Some(generate_event::Event::Local(LocalPrefill {
                            cached_tokens: cached_tokens as u32,
                        })),
                    };
                    let _ = out.try_send(Ok(event));
                    run_here(&inner, req.prompt, sampling, stop, tpot_target, out, span).await?;
                    return Ok(ReceiverStream::new(rx));
                }
                match reserve(&inner, &caller, &req, cached.clone(), split) {
                    Ok(((lease, commit), tail)) => {
                        if let Some(since) = waiting_since {
                            tracing::debug!(parent: &span, waited_ms = since.elapsed().as_millis(), "reserved after waiting for room");
                        }
                        break (lease, commit, cached_tokens, tail);
                    }
                    Err(Refusal::Busy(status))
                        if Instant::now() < deadline && !inner.core.is_draining() =>
                    {
                        release(&inner, cached, false);
                        if waiting_since.is_none() {
                            tracing::debug!(parent: &span, reason = status.message(), "waiting for room to reserve the prompt's blocks");
                            waiting_since = Some(Instant::now());
                        }
                        tokio::time::sleep(RESERVE_RETRY).await;
                    }
                    Err(Refusal::Busy(status) | Refusal::Final(status)) => {
                        release(&inner, cached, false);
                        if waiting_since.is_some() {
                            tracing::warn!(parent: &span, reason = status.message(), wait_ms = inner.config.reserve_wait.as_millis(), "refused as busy after waiting for room");
                        }
                        return Err(status);
                    }
                }
            };
            // Whatever the caller asks, a reservation waits at most the configured maximum,
            // and the caller learns what it got (it renews within that).
            let ttl = requests::lease_ttl(
                req.lease_ttl_ms,
                inner.config.default_lease_ttl,
                inner.config.max_lease_ttl,
            );
            tracing::debug!(parent: &span, blocks = lease.blocks.len(), cached_tokens, split, ttl_ms = ttl.as_millis(), "reserved");
            let event = GenerateEvent {
                event: Some(generate_event::Event::Lease(tandem_proto::v1::Lease {
                    token: lease.token().as_bytes().to_vec(),
                    block_ids: lease.blocks.clone(),
                    ttl_ms: u32::try_from(ttl.as_millis()).unwrap_or(u32::MAX),
                    cached_tokens: cached_tokens as u32,
                    split_prompt_at: split as u32,
                })),
            };
            // The channel is fresh and has room; a failure means the client is gone already.
            let _ = out.try_send(Ok(event));
            let held = Reserved {
                lease,
                tail,
                split,
                ttl,
                tpot_target,
            };
            tokio::spawn(
                disaggregated(inner, held, commit, out, req.prompt, sampling, stop)
                    .instrument(span),
            );
        }
        Mode::Aggregated | Mode::Unspecified => {
            run_here(&inner, req.prompt, sampling, stop, tpot_target, out, span).await?;
        }
    }
    Ok(ReceiverStream::new(rx))
}

/// The caller's turn to reserve: held while a request reserves, and while it waits for room,
/// so that the caller's requests reserve in arrival order and one at a time retries.
fn reserve_turn(inner: &Inner, caller: &str) -> Arc<tokio::sync::Mutex<()>> {
    let mut turns = inner
        .reserve_turns
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    Arc::clone(turns.entry(caller.to_string()).or_default())
}

/// How often a request waiting for room to reserve its blocks tries again.
const RESERVE_RETRY: Duration = Duration::from_millis(10);

/// Why a reservation was not made.
enum Refusal {
    /// No room now (the pool, or the caller's share): worth waiting for.
    Busy(Status),
    /// It can never be made, or something else failed.
    Final(Status),
}

/// The split of the prompt this worker takes (see `GenerateRequest.split_prompt_at`), 0 for
/// none: it must fall on a block boundary inside the prompt, and the model and the request
/// must be able to resume there (no sliding window, no prompt logprobs).
fn accepted_split(
    inner: &Inner,
    req: &GenerateRequest,
    sampling: &SamplingParams,
    span: &tracing::Span,
) -> usize {
    let split = req.split_prompt_at as usize;
    if split == 0 {
        return 0;
    }
    let config = inner.core.model.config();
    match requests::split_declined(config, req.prompt.len(), split, sampling) {
        None => split,
        Some(why) => {
            tracing::debug!(parent: span, split, prompt = req.prompt.len(), why, "the split is declined: the prefill worker computes the whole prompt");
            0
        }
    }
}

/// Claims the caller's share for the prompt's blocks after the held prefix `cached`, reserves
/// them and opens their lease (the lease then holds `cached` too). With a `split`, the lease
/// covers the blocks before it and the rest come back apart (this worker computes them).
fn reserve(
    inner: &Inner,
    caller: &str,
    req: &GenerateRequest,
    cached: Vec<u32>,
    split: usize,
) -> Result<(Opened, Vec<u32>), Refusal> {
    // A sliding-window model's decode steps never read the blocks before the first step's
    // window: the lease holds only the rest (such models cache nothing).
    let first = inner
        .core
        .model
        .config()
        .first_needed_block(req.prompt.len())
        .max(cached.len());
    let needed = tandem_kv::blocks_for(req.prompt.len()) - first;
    // The cached prefix cannot be evicted while the lease holds it, so it counts against
    // the caller's share like the blocks reserved for the rest.
    let claim = inner
        .leases
        .claim(caller, needed + cached.len())
        .map_err(|e| match e {
            TransferError::QuotaExceeded(_) => Refusal::Busy(Status::from(e)),
            e => Refusal::Final(Status::from(e)),
        })?;
    let mut blocks = inner
        .core
        .engine
        .pool()
        .reserve_blocks(needed)
        .map_err(|e| match e {
            KvError::OutOfBlocks { .. } => Refusal::Busy(engine_status(&e.into())),
            e => Refusal::Final(engine_status(&e.into())),
        })?;
    let (tail, sent_tokens) = match split {
        0 => (Vec::new(), req.prompt.len()),
        at => (blocks.split_off(at / tandem_kv::BLOCK_SIZE - first), at),
    };
    inner
        .leases
        .create_claimed(
            Some(claim),
            blocks.clone(),
            cached,
            sent_tokens,
            &req.request_id,
        )
        .map(|opened| (opened, tail.clone()))
        .map_err(|e| {
            release(inner, blocks, false);
            release(inner, tail, false);
            Refusal::Final(Status::from(e))
        })
}

/// Queues the whole request on this worker's engine (aggregated).
async fn run_here(
    inner: &Arc<Inner>,
    prompt: Vec<u32>,
    sampling: SamplingParams,
    stop: StopParams,
    tpot_target: Option<Duration>,
    out: Out,
    span: tracing::Span,
) -> Result<(), Status> {
    let choices = sampling.n;
    let (events_tx, events) = mpsc::unbounded_channel();
    inner
        .core
        .engine
        .add(prompt, sampling, stop, None, tpot_target, events_tx)
        .await
        .map_err(|e| engine_status(&e))?;
    let report = KvReport {
        bytes: 0,
        wait_seconds: 0.0,
        transport: Transport::Unspecified,
    };
    tokio::spawn(forward(Arc::clone(inner), events, out, report, choices).instrument(span));
    Ok(())
}

/// A disaggregated request's blocks until the engine takes them: the lease's (the blocks the
/// prefill worker writes, after the prefix this worker's cache already held, `lease.cached`).
struct Reserved {
    lease: Arc<Lease>,
    /// With a split prompt, the blocks after the split, which this worker computes.
    tail: Vec<u32>,
    /// The prompt tokens whose KV the peer sends (0: all of them).
    split: usize,
    ttl: Duration,
    /// The stream's TPOT target, for its admission.
    tpot_target: Option<Duration>,
}

impl Reserved {
    /// Every block, in logical order.
    fn all_blocks(&self) -> Vec<u32> {
        [
            self.lease.cached.as_slice(),
            self.lease.blocks.as_slice(),
            self.tail.as_slice(),
        ]
        .concat()
    }
}

async fn disaggregated(
    inner: Arc<Inner>,
    held: Reserved,
    mut commit: oneshot::Receiver<Result<Commit, String>>,
    out: Out,
    prompt: Vec<u32>,
    sampling: SamplingParams,
    stop: StopParams,
) {
    let (lease, ttl) = (&held.lease, held.ttl);
    let started = Instant::now();
    let check = ttl.min(Duration::from_millis(100));
    let lifetime = inner.config.max_lease_lifetime;
    let result = loop {
        tokio::select! {
            r = &mut commit => break r,
            () = out.closed() => {
                tracing::debug!("request went away before its KV arrived");
                abandon(&inner, &held);
                return;
            }
            () = tokio::time::sleep(check) => {
                let progress = lease.progress();
                let why = if progress.idle > ttl {
                    format!("no KV arrived for {} ms", ttl.as_millis())
                } else if progress.age > lifetime {
                    format!("the reservation was open for {} s, the most this worker allows", lifetime.as_secs())
                } else {
                    continue;
                };
                tracing::warn!(bytes = progress.bytes, reason = %why, "lease expired");
                abandon(&inner, &held);
                let _ = out.send(Err(Status::deadline_exceeded(why))).await;
                return;
            }
        }
    };
    let commit = match result {
        Ok(Ok(c)) => c,
        Ok(Err(reason)) => {
            tracing::warn!(%reason, "KV transfer failed");
            abandon(&inner, &held);
            let _ = out
                .send(Err(Status::data_loss(format!(
                    "KV transfer failed: {reason}"
                ))))
                .await;
            return;
        }
        Err(_) => {
            abandon(&inner, &held);
            let _ = out
                .send(Err(Status::internal("lease ended without a commit")))
                .await;
            return;
        }
    };
    let report = KvReport {
        bytes: commit.bytes,
        wait_seconds: started.elapsed().as_secs_f64(),
        transport: commit.transport,
    };
    // The grammar, if any, compiled once off the async workers: a copy follows the first
    // token here, the original goes to the engine.
    let guide = match inner.core.engine.compile_guide(&sampling).await {
        Ok(guide) => guide,
        Err(e) => {
            release(&inner, held.all_blocks(), false);
            let _ = out.send(Err(engine_status(&e))).await;
            return;
        }
    };
    let admission = Admission {
        held,
        location: tandem_transfer::kv_location(commit.transport),
        report,
        guide,
    };
    if admission.held.split > 0 {
        // The peer's first token is of the prompt's first part only: not this request's. The
        // rest of the prompt runs here, and the request streams from its first token.
        let (part, open) = (PrefilledPart::Prefix(admission.held.split), sampling.n);
        admit(inner, admission, out, prompt, part, sampling, stop, open).await;
        return;
    }
    let held = &admission.held;
    // Stream the first tokens now rather than after the engine's current step.
    let context = inner.core.model.config().max_position_embeddings;
    let firsts: Vec<SampledToken> = std::iter::once(SampledToken {
        token: commit.first_token,
        logprob: commit.first_logprob,
        top_logprobs: commit.first_top_logprobs,
    })
    .chain(commit.other_choices.into_iter().map(|c| SampledToken {
        token: c.token,
        logprob: c.logprob,
        top_logprobs: c.top_logprobs,
    }))
    .collect();
    if firsts.len() != sampling.n {
        release(&inner, held.all_blocks(), false);
        let why = format!("{} first tokens for {} choices", firsts.len(), sampling.n);
        let _ = out.send(Err(Status::data_loss(why))).await;
        return;
    }
    let mut open = 0;
    for (choice, sampled) in (0..).zip(&firsts) {
        let mut first = first_token_output(
            &inner.core.tokenizer,
            context,
            &prompt,
            sampled.clone(),
            &sampling,
            &stop,
            admission.guide.as_ref().map(Guide::copy),
        );
        first.choice = choice;
        if out.send(Ok(token_event(&inner, &first))).await.is_err() {
            release(&inner, held.all_blocks(), false);
            return;
        }
        if first.finish.is_some() {
            let _ = out.send(Ok(finished_event(&first, report))).await;
        } else {
            open += 1;
        }
    }
    if open == 0 {
        release(&inner, held.all_blocks(), false);
        return;
    }
    let part = PrefilledPart::Whole(firsts);
    admit(inner, admission, out, prompt, part, sampling, stop, open).await;
}

/// A disaggregated request whose KV is in: its blocks, where the peer wrote them, what the
/// final event reports of the transfer, and its compiled grammar.
struct Admission {
    held: Reserved,
    location: tandem_kv::KvLocation,
    report: KvReport,
    guide: Option<Guide>,
}

/// Hands the request to the engine (`part` of its prompt computed by the peer) and relays
/// its events until its `open` choices finish; its blocks go back if the engine refuses it.
#[allow(clippy::too_many_arguments)]
async fn admit(
    inner: Arc<Inner>,
    admission: Admission,
    out: Out,
    prompt: Vec<u32>,
    part: PrefilledPart,
    sampling: SamplingParams,
    stop: StopParams,
    open: usize,
) {
    let Admission {
        held,
        location,
        report,
        guide,
    } = admission;
    let kv = ReceivedKv {
        blocks: held.all_blocks(),
        location,
        cached: held.lease.cached.len(),
    };
    let (events_tx, events) = mpsc::unbounded_channel();
    let admitted = inner
        .core
        .engine
        .add_prefilled(
            prompt,
            part,
            kv,
            sampling,
            stop,
            guide,
            held.tpot_target,
            events_tx,
        )
        .await;
    match admitted {
        Ok(_) => forward(inner, events, out, report, open).await,
        Err(e) => {
            release(&inner, held.all_blocks(), false);
            let _ = out.send(Err(engine_status(&e))).await;
        }
    }
}

/// Relays the engine's events for one request until its `open` choices finish or the client
/// leaves (dropping `events` then makes the engine abort the request before its next step).
async fn forward(
    inner: Arc<Inner>,
    mut events: mpsc::UnboundedReceiver<SeqEvent>,
    out: Out,
    report: KvReport,
    mut open: usize,
) {
    loop {
        let event = tokio::select! {
            e = events.recv() => e,
            () = out.closed() => return,
        };
        match event {
            Some(SeqEvent::Token(o)) => {
                if out.send(Ok(token_event(&inner, &o))).await.is_err() {
                    return;
                }
                if o.finish.is_some() {
                    if out.send(Ok(finished_event(&o, report))).await.is_err() {
                        return;
                    }
                    open = open.saturating_sub(1);
                    if open == 0 {
                        return;
                    }
                }
            }
            Some(SeqEvent::Failed(reason) | SeqEvent::TransferFailed(reason)) => {
                let _ = out.send(Err(Status::internal(reason))).await;
                return;
            }
            Some(SeqEvent::Prefilled { .. }) | None => {
                let _ = out
                    .send(Err(Status::internal("the engine dropped the request")))
                    .await;
                return;
            }
        }
    }
}

fn token_event(inner: &Inner, o: &StepOutput) -> GenerateEvent {
    GenerateEvent {
        event: Some(generate_event::Event::Token(TokenEvent {
            id: o.token,
            text: o.text.clone(),
            logprob: o.logprob,
            index: o.completion_tokens.saturating_sub(1) as u32,
            special: inner.core.tokenizer.is_special(o.token),
            top_logprobs: top_logprobs_to_proto(&o.top_logprobs),
            choice: o.choice,
            prompt_logprobs: prompt_logprobs_to_proto(&o.prompt_logprobs),
        })),
    }
}

fn finished_event(o: &StepOutput, kv: KvReport) -> GenerateEvent {
    let reason = o.finish.map_or(FinishReason::Unspecified, finish_to_proto);
    GenerateEvent {
        event: Some(generate_event::Event::Finished(Finished {
            reason: reason as i32,
            prompt_tokens: o.prompt_tokens as u32,
            completion_tokens: o.completion_tokens as u32,
            kv_bytes: kv.bytes,
            kv_wait_seconds: kv.wait_seconds,
            transport: kv.transport as i32,
            choice: o.choice,
            cached_tokens: o.cached_tokens as u32,
        })),
    }
}

/// Ends the lease if still open and gives its blocks back. Once a lease is no longer open
/// (cancelled here, failed, or committed with nobody left to admit it) its blocks are ours.
/// The cached prefix was never writable by the peer: it goes back at once.
fn abandon(inner: &Inner, held: &Reserved) {
    inner.leases.cancel(held.lease.token());
    release(
        inner,
        held.lease.blocks.clone(),
        inner.leases.has_remote_writers(),
    );
    release(inner, held.lease.cached.clone(), false);
    release(inner, held.tail.clone(), false);
}

fn release(inner: &Inner, blocks: Vec<u32>, quarantine: bool) {
    let pool = inner.core.engine.pool().clone();
    if quarantine {
        let wait = inner.config.quarantine;
        tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            if let Err(e) = pool.release(&blocks) {
                tracing::error!(error = %e, "releasing quarantined blocks failed");
            }
        });
    } else if let Err(e) = pool.release(&blocks) {
        tracing::error!(error = %e, "releasing blocks failed");
    }
}
