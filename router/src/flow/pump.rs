//! The pump: after the head, the decode worker's tokens and finishes go to the HTTP layer,
//! choice by choice, until the last choice ends, the client goes away, the deadline passes,
//! or the worker fails (then the stream ends with an error event).
//!
//! A token is held back until the next event when it may be the last of its choice, so that
//! the finish rides on it (`FlowEvent::Token(token, Some(finish))`).

use tandem_proto::v1::{FinishReason, Finished, TokenEvent};
use tokio::sync::mpsc;

use super::decode::{AttemptError, DecodeItem, Live, decode_protocol_error, next_item};
use super::events::{FinishOut, FlowEvent, Head, RunMode, TokenOut, transport_name};
use super::outcome::{Outcome, Timing};
use super::request::FlowRequest;
use crate::error::ApiError;
use crate::metrics as m;
use crate::workers::Worker;

/// Streams the rest of the generation to the HTTP layer.
pub(super) async fn pump(
    mut live: Live,
    req: &FlowRequest,
    tx: &mpsc::Sender<FlowEvent>,
    timing: &mut Timing,
) -> Outcome {
    let mode = live.head.mode;
    let mut choices = Choices::new(req.sampling.n.max(1) as usize);
    loop {
        let item = match live.early.pop_front() {
            Some(item) => Ok(item),
            None => match next_streamed(&mut live, req, tx, timing).await {
                Some(item) => item,
                None => return Outcome::Cancelled(Some(mode)),
            },
        };
        let sent = match choices.check(item, &live.decode) {
            Ok(DecodeItem::Token(token)) => choices.on_token(token, req, tx).await.map(|()| None),
            Ok(DecodeItem::Finished(f)) => choices.on_finish(&f, &live.head, req, tx).await,
            Err(e) => return choices.fail(e, req, tx, mode).await,
        };
        match sent {
            Ok(Some(last)) => return Outcome::Ok(mode, last),
            Ok(None) => {}
            Err(ClientGone) => return Outcome::Cancelled(Some(mode)),
        }
    }
}

/// The next item of the decode stream, or None when the client went away first. Past the
/// request's deadline the item is a timeout.
async fn next_streamed(
    live: &mut Live,
    req: &FlowRequest,
    tx: &mpsc::Sender<FlowEvent>,
    timing: &mut Timing,
) -> Option<Result<DecodeItem, AttemptError>> {
    let mode = live.head.mode;
    let deadline = async {
        match req.deadline {
            Some(d) => tokio::time::sleep_until(d.into()).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        biased;
        _ = tx.closed() => None,
        _ = deadline => Some(Err(AttemptError::Fatal(ApiError::Timeout))),
        item = next_item(&mut live.stream, &live.decode) => {
            if matches!(item, Ok(DecodeItem::Token(_))) {
                timing.on_token(mode);
            }
            Some(item)
        }
    }
}

/// The receiver of the events is gone: the client went away.
struct ClientGone;

async fn send(tx: &mpsc::Sender<FlowEvent>, event: FlowEvent) -> Result<(), ClientGone> {
    tx.send(event).await.map_err(|_| ClientGone)
}

/// Where each of the request's choices stands.
struct Choices {
    /// Per choice: the token held back until the next event.
    held: Vec<Option<TokenEvent>>,
    /// Per choice: whether it ended.
    ended: Vec<bool>,
    /// The tokens of every choice that has ended so far.
    total_completion_tokens: u32,
}

impl Choices {
    fn new(n: usize) -> Self {
        Choices {
            held: vec![None; n],
            ended: vec![false; n],
            total_completion_tokens: 0,
        }
    }

    /// An event for a choice the request does not have, or one that already ended, is the
    /// worker misbehaving.
    fn check(
        &self,
        item: Result<DecodeItem, AttemptError>,
        decode: &Worker,
    ) -> Result<DecodeItem, AttemptError> {
        let open = |choice: u32| self.ended.get(choice as usize) == Some(&false);
        match item {
            Ok(DecodeItem::Token(t)) if !open(t.choice) => Err(decode_protocol_error(
                decode,
                "a token of a choice that does not exist or has ended",
            )),
            Ok(DecodeItem::Finished(f)) if !open(f.choice) => Err(decode_protocol_error(
                decode,
                "a finish of a choice that does not exist or has ended",
            )),
            item => item,
        }
    }

    /// Sends the token its choice held, then this one unless it may be the last.
    async fn on_token(
        &mut self,
        token: TokenEvent,
        req: &FlowRequest,
        tx: &mpsc::Sender<FlowEvent>,
    ) -> Result<(), ClientGone> {
        let slot = &mut self.held[token.choice as usize];
        if let Some(prev) = slot.take() {
            send(tx, FlowEvent::Token(token_out(prev, req), None)).await?;
        }
        if req.hold_every_token || is_known_last(req, &token) {
            *slot = Some(token);
            Ok(())
        } else {
            send(tx, FlowEvent::Token(token_out(token, req), None)).await
        }
    }

    /// Ends a choice: its held token carries the finish, else the finish goes alone. Returns
    /// the finish when it was the request's last.
    async fn on_finish(
        &mut self,
        f: &Finished,
        head: &Head,
        req: &FlowRequest,
        tx: &mpsc::Sender<FlowEvent>,
    ) -> Result<Option<FinishOut>, ClientGone> {
        let choice = f.choice as usize;
        self.ended[choice] = true;
        self.total_completion_tokens = self
            .total_completion_tokens
            .saturating_add(f.completion_tokens);
        let mut finish = finish_out(head, f);
        finish.total_completion_tokens = self.total_completion_tokens;
        finish.last = self.ended.iter().all(|&e| e);
        if head.mode == RunMode::Disaggregated && finish.last {
            metrics::histogram!(m::KV_WAIT_SECONDS, "transport" => transport_name(head.transport))
                .record(f.kv_wait_seconds);
        }
        let event = match self.held[choice].take() {
            Some(last) => FlowEvent::Token(token_out(last, req), Some(finish.clone())),
            None => FlowEvent::Finished(finish.clone()),
        };
        send(tx, event).await?;
        Ok(finish.last.then_some(finish))
    }

    /// The generation broke after the head: sends what is held, then the error.
    async fn fail(
        &mut self,
        e: AttemptError,
        req: &FlowRequest,
        tx: &mpsc::Sender<FlowEvent>,
        mode: RunMode,
    ) -> Outcome {
        let e = e.into_api();
        tracing::warn!(error = %e, "generation failed after the response head; ending the stream with an error event");
        for prev in self.held.iter_mut().filter_map(Option::take) {
            let _ = tx.send(FlowEvent::Token(token_out(prev, req), None)).await;
        }
        let kind = e.kind();
        let _ = tx.send(FlowEvent::Failed(e)).await;
        Outcome::Failed(Some(mode), kind)
    }
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
