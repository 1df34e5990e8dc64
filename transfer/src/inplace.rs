//! What the transports that write into the decode worker's memory themselves (`shm`,
//! `cuda-ipc`, `nccl`) share: the lease they write for, which (layer, logical block) pieces
//! went out, the byte count, and the commit over gRPC that hands the KV to the decode worker.
//! (The device transports' common sender on top of this is `device`'s.)

use std::time::Instant;

use tandem_auth::AuthChannel;
use tandem_proto::v1::decode_service_client::DecodeServiceClient;
use tandem_proto::v1::{KvCommit, KvDestination, Transport};

use crate::error::TransferError;
use crate::lease::LeaseToken;
use crate::sender::{FirstToken, SendFuture, SendStats};
use crate::transport::Opening;

/// One request's in-place transfer, up to its commit.
pub(crate) struct InPlace {
    pub dest: KvDestination,
    pub layers: usize,
    /// The lease's owner-tag value: a block may be written only while its tag says this.
    pub fence: u64,
    pub lease: LeaseToken,
    client: DecodeServiceClient<AuthChannel>,
    request_id: String,
    num_tokens: usize,
    pub transport: Transport,
    /// Layer-major: whether each (layer, logical block) was written.
    written: Vec<bool>,
    bytes: u64,
    started: Option<Instant>,
}

impl InPlace {
    pub fn new(op: Opening<'_>, transport: Transport) -> Result<Self, TransferError> {
        Ok(Self {
            client: op.reach.decode_client(&op.decode.endpoint)?,
            layers: op.layout.num_layers,
            fence: op.lease.fence(),
            lease: op.lease,
            written: vec![false; op.layout.num_layers * op.dest.block_ids.len()],
            bytes: 0,
            started: None,
            request_id: op.request_id.to_string(),
            num_tokens: op.num_tokens,
            transport,
            dest: op.dest,
        })
    }

    /// Starts the clock at the first piece.
    pub fn start(&mut self) {
        self.started.get_or_insert_with(Instant::now);
    }

    /// The destination block of logical block `lb`, refusing one outside the lease.
    pub fn block(&self, lb: u32) -> Result<u32, TransferError> {
        self.dest
            .block_ids
            .get(lb as usize)
            .copied()
            .ok_or_else(|| TransferError::Protocol(format!("logical block {lb} outside the lease")))
    }

    /// Refuses a layer outside the layout.
    pub fn check_layer(&self, layer: usize) -> Result<(), TransferError> {
        if layer >= self.layers {
            return Err(TransferError::Protocol(format!(
                "layer {layer} of {}",
                self.layers
            )));
        }
        Ok(())
    }

    /// Counts `logical` blocks of `layer`, `piece` bytes each, as written.
    pub fn mark(&mut self, layer: usize, logical: impl IntoIterator<Item = u32>, piece: usize) {
        let nblocks = self.dest.block_ids.len();
        for lb in logical {
            self.written[layer * nblocks + lb as usize] = true;
            self.bytes += piece as u64;
        }
    }

    /// Commits once every piece was written: the decode worker verifies (`checksums`, for
    /// transports whose memory it can read back) and admits the request with this token.
    pub fn commit(self, first: FirstToken, checksums: Vec<u32>) -> SendFuture {
        Box::pin(async move {
            if let Some(missing) = self.written.iter().position(|w| !w) {
                return Err(TransferError::Incomplete(format!(
                    "block-layer {missing} was never written"
                )));
            }
            let started = self.started.unwrap_or_else(Instant::now);
            let mut client = self.client.clone();
            let commit = KvCommit {
                lease: self.lease.as_bytes().to_vec(),
                kv_layout_hash: self.dest.kv_layout_hash.clone(),
                request_id: self.request_id.clone(),
                first_token: first.token,
                first_logprob: first.logprob,
                first_top_logprobs: first.top_to_proto(),
                other_choices: first.others_to_proto(),
                num_tokens: self.num_tokens as u32,
                checksums,
                transport: self.transport as i32,
                bytes: self.bytes,
            };
            client
                .commit_kv(commit)
                .await
                .map_err(|s| TransferError::Remote(s.message().to_string()))?;
            Ok(SendStats {
                bytes: self.bytes,
                seconds: started.elapsed().as_secs_f64(),
                transport: self.transport,
            })
        })
    }
}
