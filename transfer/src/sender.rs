//! The sending half's contract: one [`KvSender`] per request, fed layer by layer from the
//! engine's thread, finished by a commit. The transports implement it; [`crate::connect()`]
//! makes one for the transport the router chose. This module depends on nothing else of the
//! crate but its error type.

use std::pin::Pin;

use tandem_kv::DeviceKv;
use tandem_proto::limits::{MAX_CHOICES, MAX_TOP_LOGPROBS};
use tandem_proto::v1::{FirstChoice, TopLogprob, Transport};

use crate::error::TransferError;

/// What a finished transfer cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SendStats {
    pub bytes: u64,
    /// From the first byte handed over to the commit's acknowledgement.
    pub seconds: f64,
    pub transport: Transport,
}

/// The future returned by [`KvSender::commit`].
pub type SendFuture = Pin<Box<dyn Future<Output = Result<SendStats, TransferError>> + Send>>;

/// Moves one request's KV to its decode worker.
///
/// `send_layer` runs on the engine's thread (never inside an async runtime) right after a
/// layer's KV is in the cache; it copies what it needs before returning, so the engine may
/// reuse its blocks at once. Dropping a sender without committing abandons the transfer.
pub trait KvSender: Send {
    /// Ships `(logical block, bytes)` pieces of one layer.
    fn send_layer(&mut self, layer: usize, blocks: &[(u32, &[u8])]) -> Result<(), TransferError>;

    /// Whether this sender copies from the engine's device KV pool ([`Self::send_device_layer`])
    /// instead of taking host bytes.
    fn reads_device(&self) -> bool {
        false
    }

    /// Ships one layer's blocks straight from a GPU engine's pool `src`, as `(logical block,
    /// physical block in src)` pairs. The copies are queued on `src`'s stream, after the forward
    /// pass that wrote them.
    fn send_device_layer(
        &mut self,
        layer: usize,
        src: &DeviceKv,
        blocks: &[(u32, u32)],
    ) -> Result<(), TransferError> {
        let _ = (layer, src, blocks);
        Err(TransferError::Protocol(
            "this transport sends host bytes, not device memory".into(),
        ))
    }

    /// Finishes: every piece has been sent; the decode worker verifies and admits the request
    /// with this first token.
    fn commit(self: Box<Self>, first: FirstToken) -> SendFuture;
}

/// The token the prefill worker sampled, as the decode worker admits the request with it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FirstToken {
    pub token: u32,
    pub logprob: f32,
    /// The most likely alternatives, when the request asked for them.
    pub top_logprobs: Vec<(u32, f32)>,
    /// The first tokens of choices 1.. of an `n > 1` request (this one is choice 0's); their
    /// own `other_choices` are empty.
    pub other_choices: Vec<FirstToken>,
}

impl FirstToken {
    /// A first token without alternatives.
    pub fn new(token: u32, logprob: f32) -> Self {
        Self {
            token,
            logprob,
            ..Self::default()
        }
    }

    pub fn top_to_proto(&self) -> Vec<TopLogprob> {
        top_logprobs_to_proto(&self.top_logprobs)
    }

    /// `other_choices` as the wire carries them.
    pub fn others_to_proto(&self) -> Vec<FirstChoice> {
        self.other_choices
            .iter()
            .map(|c| FirstChoice {
                token: c.token,
                logprob: c.logprob,
                top_logprobs: c.top_to_proto(),
            })
            .collect()
    }
}

/// A peer's other choices, refused when there are more than a request may have or any has
/// more alternatives than a request may ask for.
pub fn other_choices_from_proto(others: &[FirstChoice]) -> Result<Vec<FirstToken>, TransferError> {
    if others.len() >= MAX_CHOICES {
        return Err(TransferError::Protocol(format!(
            "{} more choices (at most {})",
            others.len(),
            MAX_CHOICES - 1
        )));
    }
    others
        .iter()
        .map(|c| {
            Ok(FirstToken {
                token: c.token,
                logprob: c.logprob,
                top_logprobs: top_logprobs_from_proto(&c.top_logprobs)?,
                other_choices: Vec::new(),
            })
        })
        .collect()
}

pub fn top_logprobs_to_proto(top: &[(u32, f32)]) -> Vec<TopLogprob> {
    top.iter()
        .map(|&(id, logprob)| TopLogprob { id, logprob })
        .collect()
}

/// A peer's alternatives, refused when there are more than any request may ask for.
pub fn top_logprobs_from_proto(top: &[TopLogprob]) -> Result<Vec<(u32, f32)>, TransferError> {
    if top.len() > MAX_TOP_LOGPROBS {
        return Err(TransferError::Protocol(format!(
            "{} top logprobs (at most {MAX_TOP_LOGPROBS})",
            top.len()
        )));
    }
    Ok(top.iter().map(|t| (t.id, t.logprob)).collect())
}
