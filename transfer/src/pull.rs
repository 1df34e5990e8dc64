//! KV read back from a decode worker's cached prefix (`DecodeService.PullKv`), both sides.
//!
//! The decode worker holds the prompt's cached prefix for a lease; a prefill worker whose own
//! cache lacks part of that prefix (a conversation's previous answer, or every turn after the
//! router moved it to another prefill worker) must attend over it. Computing it again costs
//! the prompt's compute; reading it costs its bytes, which on any link a worker pair uses are
//! cheaper by orders of magnitude on a CPU. The read is one gRPC server stream whatever the
//! transport the lease's KV takes (the blocks are few and it is not on the decode worker's
//! hot path), checked piece by piece like a transfer: layout hash, range, sizes, a CRC-32 of
//! each (layer, block), completeness.
//!
//! The lease is the capability here too: only its holder can read, only while it is open, and
//! only blocks the decode worker holds for it.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tandem_kv::KvLayout;
use tandem_proto::v1::{KvBlocks, KvDestination, PullKvRequest};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::checksum::crc32;
use crate::error::TransferError;
use crate::lease::LeaseTable;
use crate::peers::Peers;

/// Payload bytes per answer message (as for `PushKv`).
const MAX_PAYLOAD: usize = 1 << 20;
/// Messages read ahead of the network.
const QUEUE: usize = 4;
/// The longest a pull may take before the prefill worker computes the prefix instead.
pub const PULL_TIMEOUT: Duration = Duration::from_secs(10);

/// The stream `PullKv` answers with.
pub type PullStream = Pin<Box<dyn futures::Stream<Item = Result<KvBlocks, Status>> + Send>>;

/// The decode side: checks the request against the lease table and streams the blocks layer
/// by layer, reading each message's blocks under the lease's state lock (so a lease that ends
/// meanwhile stops the stream rather than let a released block be read).
pub fn serve_pull(table: &Arc<LeaseTable>, req: PullKvRequest) -> Result<PullStream, Status> {
    let lease = table.check_header(&req.lease, &req.kv_layout_hash)?;
    let (from, to) = (req.from_block as usize, req.to_block as usize);
    if from >= to || to > lease.cached.len() {
        return Err(TransferError::Protocol(format!(
            "blocks {from}..{to} asked; the lease holds a cached prefix of {} blocks",
            lease.cached.len()
        ))
        .into());
    }
    // Refuse before the stream starts when the bytes cannot be read here at all.
    table.read_cached(&lease, 0, from..from + 1)?;
    let per_msg = (MAX_PAYLOAD / table.piece_bytes()).max(1);
    let layers = table.num_layers();
    let (tx, rx) = mpsc::channel(QUEUE);
    let table = Arc::clone(table);
    tracing::debug!(request_id = %req.request_id, from, to, "serving a pull of cached KV");
    tokio::spawn(async move {
        for layer in 0..layers {
            let mut start = from;
            while start < to {
                let end = (start + per_msg).min(to);
                let msg = table
                    .read_cached(&lease, layer, start..end)
                    .map(|(payload, checksums)| KvBlocks {
                        layer: layer as u32,
                        logical_blocks: (start as u32..end as u32).collect(),
                        checksums,
                        payload: payload.into(),
                    })
                    .map_err(Status::from);
                let failed = msg.is_err();
                if tx.send(msg).await.is_err() || failed {
                    return;
                }
                start = end;
            }
        }
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}

/// Cached prefix KV read from a decode worker: logical blocks `first..first + blocks` of the
/// prompt, block-major (each block's layers in order, each `block_layer_bytes` long), as
/// [`tandem_kv::KvCache::write_block_layer_bytes`] takes them.
#[derive(Debug, Clone, PartialEq)]
pub struct PulledPrefix {
    pub first: usize,
    pub blocks: usize,
    pub data: Vec<u8>,
    pub seconds: f64,
}

/// The prefill side: reads logical blocks `from..to` of the prompt from the cached prefix
/// that `dest`'s lease holds, verifying the decode worker as a transfer does and every piece
/// against its checksum and place. Nothing a peer sends is allocated before it is checked:
/// the buffer is sized from our own layout and the range we asked for. `Ok(None)`: the
/// decode worker does not serve pulls (said once, then not asked again until it restarts).
pub async fn pull_cached_prefix(
    peers: &Peers,
    dest: &KvDestination,
    layout: &KvLayout,
    request_id: &str,
    from: usize,
    to: usize,
) -> Result<Option<PulledPrefix>, TransferError> {
    let started = Instant::now();
    let ours = layout.hash();
    let decode = peers.verified_decode(dest).await?;
    if decode.refuses_pull.load(Ordering::Relaxed) {
        return Ok(None);
    }
    if decode.info.kv_layout_hash != ours {
        return Err(TransferError::LayoutMismatch(format!(
            "the decode worker has layout {}, this worker {ours}",
            decode.info.kv_layout_hash
        )));
    }
    let blocks = to
        .checked_sub(from)
        .filter(|&n| n > 0)
        .ok_or_else(|| TransferError::Protocol(format!("an empty pull of blocks {from}..{to}")))?;
    let mut client = peers.decode_client(&decode.endpoint)?;
    let request = PullKvRequest {
        lease: dest.lease.clone(),
        kv_layout_hash: ours,
        request_id: request_id.to_string(),
        from_block: from as u32,
        to_block: to as u32,
    };
    let pulled = tokio::time::timeout(PULL_TIMEOUT, async {
        let mut stream = match client.pull_kv(request).await {
            Ok(answer) => answer.into_inner(),
            Err(s) if s.code() == tonic::Code::FailedPrecondition => {
                tracing::info!(decode = %decode.endpoint, reason = %s.message(), "this decode worker does not serve its cached prefix: computing what this worker lacks of it");
                decode.refuses_pull.store(true, Ordering::Relaxed);
                return Ok(None);
            }
            Err(s) => {
                return Err(TransferError::Remote(format!("{}: {}", s.code(), s.message())));
            }
        };
        let mut into = Assembly::new(layout, from, blocks);
        while let Some(msg) = stream
            .message()
            .await
            .map_err(|s| TransferError::Remote(format!("{}: {}", s.code(), s.message())))?
        {
            into.add(&msg)?;
        }
        into.finish().map(Some)
    })
    .await
    .map_err(|_| {
        TransferError::Connect(format!(
            "the decode worker did not answer a pull within {} s",
            PULL_TIMEOUT.as_secs()
        ))
    })??;
    Ok(pulled.map(|data| PulledPrefix {
        first: from,
        blocks,
        data,
        seconds: started.elapsed().as_secs_f64(),
    }))
}

/// The pieces of a pull as they arrive, each checked and put in its place once.
pub(crate) struct Assembly {
    layers: usize,
    piece: usize,
    first: usize,
    blocks: usize,
    data: Vec<u8>,
    received: Vec<bool>,
}

impl Assembly {
    pub(crate) fn new(layout: &KvLayout, first: usize, blocks: usize) -> Self {
        let (layers, piece) = (layout.num_layers, layout.block_layer_bytes());
        Self {
            layers,
            piece,
            first,
            blocks,
            data: vec![0; blocks * layers * piece],
            received: vec![false; blocks * layers],
        }
    }

    pub(crate) fn add(&mut self, msg: &KvBlocks) -> Result<(), TransferError> {
        let layer = msg.layer as usize;
        if layer >= self.layers
            || msg.logical_blocks.len() != msg.checksums.len()
            || msg.payload.len() != msg.logical_blocks.len() * self.piece
        {
            return Err(TransferError::Corrupt(format!(
                "a pulled message of layer {layer} with {} blocks, {} checksums and {} bytes",
                msg.logical_blocks.len(),
                msg.checksums.len(),
                msg.payload.len()
            )));
        }
        for ((&lb, &crc), bytes) in msg
            .logical_blocks
            .iter()
            .zip(&msg.checksums)
            .zip(msg.payload.chunks_exact(self.piece))
        {
            let Some(block) = (lb as usize)
                .checked_sub(self.first)
                .filter(|&b| b < self.blocks)
            else {
                return Err(TransferError::Corrupt(format!(
                    "pulled block {lb} was not asked for"
                )));
            };
            let slot = block * self.layers + layer;
            if self.received[slot] {
                return Err(TransferError::Corrupt(format!(
                    "pulled block {lb} of layer {layer} twice"
                )));
            }
            let got = crc32(bytes);
            if got != crc {
                return Err(TransferError::Corrupt(format!(
                    "checksum of pulled layer {layer} block {lb}: {got:08x} != {crc:08x}"
                )));
            }
            self.data[slot * self.piece..(slot + 1) * self.piece].copy_from_slice(bytes);
            self.received[slot] = true;
        }
        Ok(())
    }

    pub(crate) fn finish(self) -> Result<Vec<u8>, TransferError> {
        let missing = self.received.iter().filter(|r| !**r).count();
        if missing > 0 {
            return Err(TransferError::Incomplete(format!(
                "{missing} of {} pulled block-layers never arrived",
                self.received.len()
            )));
        }
        Ok(self.data)
    }
}

/// The `PullKv` handler's shape for services that delegate to [`serve_pull`].
pub(crate) fn respond(
    table: &Arc<LeaseTable>,
    req: Request<PullKvRequest>,
) -> Result<Response<PullStream>, Status> {
    serve_pull(table, req.into_inner()).map(Response::new)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_kv::{KvCache, KvDtype};

    fn layout() -> KvLayout {
        KvLayout {
            num_layers: 2,
            num_kv_heads: 1,
            head_dim: 4,
            block_size: 16,
            dtype: KvDtype::F32,
            model_fingerprint: "m".into(),
        }
    }

    /// One block's bytes of one layer of a pull (`block` counts from its first): where the
    /// block-major layout puts them.
    fn piece_of<'a>(
        pulled: &'a PulledPrefix,
        layout: &KvLayout,
        block: usize,
        layer: usize,
    ) -> &'a [u8] {
        let bb = layout.block_layer_bytes();
        let at = (block * layout.num_layers + layer) * bb;
        &pulled.data[at..at + bb]
    }

    /// A pull of blocks `from..to` of `lease` in layout `l`.
    fn ask(lease: &crate::Lease, l: &KvLayout, from: u32, to: u32) -> PullKvRequest {
        PullKvRequest {
            lease: lease.token().as_bytes().to_vec(),
            kv_layout_hash: l.hash(),
            request_id: "r".into(),
            from_block: from,
            to_block: to,
        }
    }

    fn blocks_msg(layer: u32, logical: &[u32], piece: usize, fill: u8) -> KvBlocks {
        let payload: Vec<u8> = (0..logical.len() * piece)
            .map(|i| fill.wrapping_add(i as u8))
            .collect();
        KvBlocks {
            layer,
            logical_blocks: logical.to_vec(),
            checksums: payload.chunks_exact(piece).map(crc32).collect(),
            payload: payload.into(),
        }
    }

    #[test]
    fn an_assembly_takes_each_piece_once_in_its_place_and_refuses_the_rest() {
        let l = layout();
        let piece = l.block_layer_bytes();
        let mut a = Assembly::new(&l, 3, 2);
        a.add(&blocks_msg(1, &[3, 4], piece, 10)).unwrap();
        assert!(matches!(
            a.add(&blocks_msg(1, &[4], piece, 0)),
            Err(TransferError::Corrupt(_))
        ));
        for bad in [
            blocks_msg(0, &[2], piece, 0),
            blocks_msg(0, &[5], piece, 0),
            blocks_msg(2, &[3], piece, 0),
        ] {
            assert!(matches!(a.add(&bad), Err(TransferError::Corrupt(_))));
        }
        let mut torn = blocks_msg(0, &[3], piece, 0);
        torn.payload.truncate(piece - 1);
        assert!(a.add(&torn).is_err());
        let mut flipped = blocks_msg(0, &[3], piece, 0);
        let mut bytes = flipped.payload.to_vec();
        bytes[0] ^= 1;
        flipped.payload = bytes.into();
        assert!(a.add(&flipped).is_err());
        a.add(&blocks_msg(0, &[3], piece, 50)).unwrap();
        let partial = Assembly {
            received: a.received.clone(),
            data: a.data.clone(),
            ..Assembly::new(&l, 3, 2)
        };
        assert!(matches!(
            partial.finish(),
            Err(TransferError::Incomplete(_))
        ));
        a.add(&blocks_msg(0, &[4], piece, 90)).unwrap();
        let data = a.finish().unwrap();
        let pulled = PulledPrefix {
            first: 3,
            blocks: 2,
            data,
            seconds: 0.0,
        };
        // Block-major: block 3's layers 0 and 1, then block 4's.
        assert_eq!(
            piece_of(&pulled, &l, 0, 0),
            &blocks_msg(0, &[3], piece, 50).payload[..]
        );
        assert_eq!(
            piece_of(&pulled, &l, 0, 1),
            &blocks_msg(1, &[3], piece, 10).payload[..piece]
        );
        assert_eq!(
            piece_of(&pulled, &l, 1, 1),
            &blocks_msg(1, &[3, 4], piece, 10).payload[piece..]
        );
        assert_eq!(
            piece_of(&pulled, &l, 1, 0),
            &blocks_msg(0, &[4], piece, 90).payload[..]
        );
    }

    #[tokio::test]
    async fn a_pull_serves_the_cached_blocks_of_an_open_lease_only() {
        let l = layout();
        let piece = l.block_layer_bytes();
        let mut cache = KvCache::with_budget(l.clone(), 8 * l.block_bytes()).unwrap();
        for block in 0..8u32 {
            for layer in 0..2 {
                let fill = vec![(block * 2 + layer as u32) as u8; piece];
                cache.write_block_layer_bytes(layer, block, &fill).unwrap();
            }
        }
        let table = Arc::new(LeaseTable::new(cache.block_writer(), l.hash(), None));
        let (lease, _rx) = table
            .create_claimed(None, vec![7], vec![5, 1, 6], 60, "r")
            .unwrap();
        let ask = |from, to| ask(&lease, &l, from, to);
        let mut stream = serve_pull(&table, ask(1, 3)).unwrap();
        let mut a = Assembly::new(&l, 1, 2);
        while let Some(msg) = futures::StreamExt::next(&mut stream).await {
            a.add(&msg.unwrap()).unwrap();
        }
        let data = a.finish().unwrap();
        let pulled = PulledPrefix {
            first: 1,
            blocks: 2,
            data,
            seconds: 0.0,
        };
        // Logical block 1 is physical block 1, logical 2 is physical 6.
        assert_eq!(piece_of(&pulled, &l, 0, 1), &vec![3u8; piece][..]);
        assert_eq!(piece_of(&pulled, &l, 1, 0), &vec![12u8; piece][..]);
        // Past the cached prefix (the leased block is not readable), empty, or a bad layout.
        for bad in [ask(2, 4), ask(2, 2), ask(3, 1)] {
            let code = serve_pull(&table, bad).err().unwrap().code();
            assert_eq!(code, tonic::Code::InvalidArgument);
        }
        let mut other = ask(0, 1);
        other.kv_layout_hash = "other".into();
        assert_eq!(
            serve_pull(&table, other).err().unwrap().code(),
            tonic::Code::FailedPrecondition
        );
        let mut guess = ask(0, 1);
        guess.lease = vec![0; 16];
        assert_eq!(
            serve_pull(&table, guess).err().unwrap().code(),
            tonic::Code::NotFound
        );
        // Once the lease ends, its blocks may be released: nothing more is read.
        table.cancel(lease.token());
        assert_eq!(
            serve_pull(&table, ask(0, 1)).err().unwrap().code(),
            tonic::Code::NotFound
        );
        assert!(matches!(
            table.read_cached(&lease, 0, 0..1),
            Err(TransferError::UnknownLease)
        ));
    }

    #[test]
    fn a_worker_whose_cache_is_on_its_device_refuses_pulls() {
        let l = layout();
        let cache = KvCache::with_budget(l.clone(), 4 * l.block_bytes()).unwrap();
        let table = LeaseTable::new(cache.block_writer(), l.hash(), None)
            .with_device_pool(l.block_layer_bytes());
        let (lease, _rx) = table
            .create_claimed(None, vec![2], vec![0], 20, "r")
            .unwrap();
        assert!(matches!(
            table.read_cached(&lease, 0, 0..1),
            Err(TransferError::Unsupported(_))
        ));
        let table = Arc::new(table);
        assert_eq!(
            serve_pull(&table, ask(&lease, &l, 0, 1))
                .err()
                .unwrap()
                .code(),
            tonic::Code::FailedPrecondition,
            "the prefill worker stops asking on this code"
        );
    }
}
