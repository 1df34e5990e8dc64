//! The launch step the four generation routes share, once a request passed its cheap
//! checks: take a running slot, start the request's flow, and (for the non-streaming routes)
//! read the whole generation; plus the bookkeeping of requests refused before any of that.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use super::state::AppState;
use crate::admission::InFlight;
use crate::error::ApiError;
use crate::flow::{self, FinishOut, FlowEvent, FlowPending, FlowRequest, FlowStream, TokenOut};
use crate::metrics as m;

/// Counts a request refused before any worker was involved.
pub fn record_rejection(e: &ApiError) {
    if e.is_server_side() {
        tracing::warn!(error = %e, "request refused");
    } else {
        tracing::info!(error = %e, "request refused");
    }
    metrics::counter!(m::REQUESTS_TOTAL, "mode" => "none", "outcome" => e.kind()).increment(1);
}

/// Takes a running slot for a request that passed its cheap checks (429 when every place is
/// taken, 503 after waiting past the deadline). Tokenization and template rendering happen
/// after this, so overload is refused before any of that work.
pub async fn admit(state: &AppState, deadline: Option<Instant>) -> Result<InFlight, ApiError> {
    let admit = state.admission().admit();
    match deadline {
        Some(d) => tokio::time::timeout_at(d.into(), admit)
            .await
            .unwrap_or(Err(ApiError::QueueTimeout)),
        None => admit.await,
    }
}

/// Starts an admitted request.
pub fn start(state: &AppState, request: FlowRequest, in_flight: InFlight) -> FlowPending {
    flow::start(Arc::clone(state.flow()), request, in_flight)
}

/// One choice of a whole generation, for the non-streaming routes.
#[derive(Debug)]
pub struct Collected {
    /// The text of the non-special tokens.
    pub text: String,
    pub finish: FinishOut,
    /// The id of the last token, if any (TGI tells EOS from stop sequences by it).
    pub last_token: Option<u32>,
    /// Every token as it was generated (TGI's `details.tokens`).
    pub tokens: Vec<TokenOut>,
    /// The choice it was generated as (its seed is the request's plus this), whatever
    /// [`CollectedAll::best`] numbers it.
    pub generated_as: u32,
}

impl Collected {
    /// The mean logprob of its tokens, how `best_of` ranks choices (OpenAI: "the highest log
    /// probability per token"); a choice without tokens ranks last.
    pub fn mean_logprob(&self) -> f64 {
        if self.tokens.is_empty() {
            return f64::NEG_INFINITY;
        }
        let sum: f64 = self.tokens.iter().map(|t| f64::from(t.logprob)).sum();
        sum / self.tokens.len() as f64
    }
}

/// Every choice of a whole generation, by choice index.
#[derive(Debug)]
pub struct CollectedAll {
    pub choices: Vec<Collected>,
    /// The last finish: its `total_completion_tokens` counts every choice.
    pub finish: FinishOut,
}

impl CollectedAll {
    /// The `keep` best choices by [`Collected::mean_logprob`], best first (ties keep their
    /// order), numbered again from 0.
    pub fn best(mut self, keep: usize) -> Self {
        self.choices
            .sort_by(|a, b| b.mean_logprob().total_cmp(&a.mean_logprob()));
        self.choices.truncate(keep.max(1));
        for (i, c) in (0..).zip(self.choices.iter_mut()) {
            c.finish.choice = i;
            for t in &mut c.tokens {
                t.choice = i;
            }
        }
        self
    }
}

/// Reads a started generation to its end. Nothing has been sent yet, so a failure here
/// still becomes a real HTTP status.
pub async fn collect(mut stream: FlowStream) -> Result<CollectedAll, ApiError> {
    let mut texts: BTreeMap<u32, (String, Vec<TokenOut>)> = BTreeMap::new();
    let mut done: Vec<Collected> = Vec::new();
    while let Some(event) = stream.events.recv().await {
        let finish = match event {
            FlowEvent::Token(token, finish) => {
                let (text, tokens) = texts.entry(token.choice).or_default();
                if !token.special {
                    text.push_str(&token.text);
                }
                tokens.push(token);
                match finish {
                    Some(finish) => finish,
                    None => continue,
                }
            }
            FlowEvent::Finished(finish) => finish,
            FlowEvent::Failed(e) => return Err(e),
        };
        let (text, tokens) = texts.remove(&finish.choice).unwrap_or_default();
        let last = finish.last;
        done.push(Collected {
            generated_as: finish.choice,
            text,
            last_token: tokens.last().map(|t| t.id),
            tokens,
            finish: finish.clone(),
        });
        if last {
            done.sort_by_key(|c| c.finish.choice);
            return Ok(CollectedAll {
                choices: done,
                finish,
            });
        }
    }
    tracing::error!("event stream ended without a finish");
    Err(ApiError::WorkerFailed)
}

/// The request deadline from the configured timeout.
pub fn deadline_from(state: &AppState, arrival: Instant) -> Option<Instant> {
    state.config().request_timeout.map(|t| arrival + t)
}

/// Unix seconds now (the `created` field).
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}
