//! The sending half's contract: one [`KvSender`] per request, fed layer by layer from the
//! engine's thread, finished by a commit. The transports implement it; [`crate::connect`]
//! makes one for the transport the router chose. This module depends on nothing else of the
//! crate but its error type.

use std::pin::Pin;

use tandem_kv::DeviceKv;
use tandem_proto::v1::Transport;

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
    fn commit(self: Box<Self>, first_token: u32, first_logprob: f32) -> SendFuture;
}
