//! The `nccl` transport's protocol, over any [`Link`] that moves device byte ranges in order
//! (NCCL point-to-point in production, an in-memory queue in tests).
//!
//! NCCL matches each send with the receive posted in the same position on the other rank, and
//! both must name the same size; it carries no addresses. So before a layer's blocks the
//! sender announces them: a 40-byte header (magic, lease capability, layer, block count, piece
//! size), then
//! the logical block indices (4 bytes each), then one message per block. The receiver reads
//! the header and indices back to the host, asks the lease table where those blocks live in
//! its device pool (or drains them into scratch if the lease has ended), posts one receive per
//! block, waits, and counts them toward the lease's commit. Many leases can share one link:
//! the sender's engine thread issues each layer's messages together, in the order the
//! receiver reads them.

use crate::error::TransferError;
use crate::lease::{DevicePool, LeaseTable, LeaseToken};

/// Bytes of a layer header.
pub const HEADER_BYTES: usize = 40;
/// The most blocks one layer message may announce (256k tokens of 16).
pub const MAX_BLOCKS_PER_LAYER: usize = 16 * 1024;
/// Device scratch a link needs for messages (header and indices).
pub const MESSAGE_AREA_BYTES: usize = HEADER_BYTES + 4 * MAX_BLOCKS_PER_LAYER;
const MAGIC: u32 = 0x4b56_4e43;
const VERSION: u32 = 2;

/// What one layer message carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerHeader {
    pub lease: LeaseToken,
    pub layer: u32,
    pub count: u32,
    pub piece: u64,
}

impl LayerHeader {
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut out = [0u8; HEADER_BYTES];
        out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        out[4..8].copy_from_slice(&VERSION.to_le_bytes());
        out[8..24].copy_from_slice(self.lease.as_bytes());
        out[24..28].copy_from_slice(&self.layer.to_le_bytes());
        out[28..32].copy_from_slice(&self.count.to_le_bytes());
        out[32..40].copy_from_slice(&self.piece.to_le_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, TransferError> {
        let word = |at: usize| {
            u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        let long = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(b)
        };
        if bytes.len() != HEADER_BYTES || word(0) != MAGIC || word(4) != VERSION {
            return Err(TransferError::Protocol(
                "not an nccl layer header (magic or version)".into(),
            ));
        }
        let header = Self {
            lease: LeaseToken::from_wire(&bytes[8..24])?,
            layer: word(24),
            count: word(28),
            piece: long(32),
        };
        if header.count as usize > MAX_BLOCKS_PER_LAYER {
            return Err(TransferError::Protocol(format!(
                "{} blocks in one layer message (at most {MAX_BLOCKS_PER_LAYER})",
                header.count
            )));
        }
        Ok(header)
    }
}

/// An ordered channel of device byte ranges to one peer, plus the scratch the protocol uses.
/// Operations are queued in order on the link's stream; `download` waits for them.
pub trait Link {
    /// Queues a send of `bytes` at device address `ptr`.
    fn send(&mut self, ptr: u64, bytes: usize) -> Result<(), TransferError>;
    /// Queues a receive of `bytes` into device address `ptr`.
    fn recv(&mut self, ptr: u64, bytes: usize) -> Result<(), TransferError>;
    /// Queues a copy of `host` to device address `ptr` (ordered before later sends).
    fn upload(&mut self, ptr: u64, host: &[u8]) -> Result<(), TransferError>;
    /// Waits for everything queued, then copies device memory at `ptr` into `host`.
    fn download(&mut self, ptr: u64, host: &mut [u8]) -> Result<(), TransferError>;
    /// Waits for everything queued.
    fn synchronize(&mut self) -> Result<(), TransferError>;
    /// [`MESSAGE_AREA_BYTES`] of device scratch for headers and indices.
    fn message_area(&self) -> u64;
    /// Device scratch of at least one piece, where unwanted blocks are drained.
    fn drain_area(&self) -> u64;
}

/// Queues one layer of one lease: header, indices, then each block from `sources` (the
/// device address of each of `logical`'s blocks in the sender's pool).
pub fn send_layer(
    link: &mut impl Link,
    lease: &LeaseToken,
    layer: usize,
    piece: usize,
    logical: &[u32],
    sources: &[u64],
) -> Result<(), TransferError> {
    if logical.len() != sources.len() || logical.len() > MAX_BLOCKS_PER_LAYER {
        return Err(TransferError::Protocol(format!(
            "{} logical blocks for {} sources (at most {MAX_BLOCKS_PER_LAYER})",
            logical.len(),
            sources.len()
        )));
    }
    let header = LayerHeader {
        lease: *lease,
        layer: layer as u32,
        count: logical.len() as u32,
        piece: piece as u64,
    };
    let area = link.message_area();
    link.upload(area, &header.encode())?;
    link.send(area, HEADER_BYTES)?;
    let indices: Vec<u8> = logical.iter().flat_map(|lb| lb.to_le_bytes()).collect();
    let at = area + HEADER_BYTES as u64;
    link.upload(at, &indices)?;
    link.send(at, indices.len())?;
    for &src in sources {
        link.send(src, piece)?;
    }
    Ok(())
}

/// What [`receive_layer`] did with one layer message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Received {
    pub header: LayerHeader,
    /// False when the blocks were drained (the lease had ended or did not match).
    pub kept: bool,
}

/// Receives the next layer message into `pool` through `table`.
pub fn receive_layer(
    link: &mut impl Link,
    table: &LeaseTable,
    pool: &DevicePool,
) -> Result<Received, TransferError> {
    let area = link.message_area();
    link.recv(area, HEADER_BYTES)?;
    let mut raw = [0u8; HEADER_BYTES];
    link.download(area, &mut raw)?;
    let header = LayerHeader::decode(&raw)?;
    let count = header.count as usize;
    let piece = usize::try_from(header.piece)
        .map_err(|_| TransferError::Protocol("piece size overflows".into()))?;
    let at = area + HEADER_BYTES as u64;
    link.recv(at, 4 * count)?;
    let mut raw = vec![0u8; 4 * count];
    link.download(at, &mut raw)?;
    let logical: Vec<u32> = raw
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    // A sender whose piece size differs from ours still sends `count` pieces of its size:
    // drain them all so the link stays in step, and the lease fails for lack of KV.
    let ours = DevicePool { piece, ..*pool };
    let drain = link.drain_area();
    let kept = table.receive_device(
        &header.lease,
        header.layer as usize,
        &logical,
        &ours,
        |targets| {
            let drains = piece <= pool.piece;
            for i in 0..count {
                let dst = match targets {
                    Some(t) if piece == pool.piece => t[i],
                    _ if drains => drain,
                    _ => {
                        return Err(TransferError::Protocol(format!(
                            "pieces of {piece} bytes do not fit this pool's {}",
                            pool.piece
                        )));
                    }
                };
                link.recv(dst, piece)?;
            }
            link.synchronize()
        },
    )?;
    Ok(Received { header, kept })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use tandem_kv::{KvCache, KvDtype, KvLayout};
    use tandem_proto::v1::{KvCommit, Transport};

    /// Device memory as one byte vector (addresses are offsets) and the wire as a queue:
    /// a receive must name the size of the send it matches, as NCCL requires.
    struct MemLink<'a> {
        memory: &'a mut Vec<u8>,
        wire: &'a mut VecDeque<Vec<u8>>,
        message: u64,
        drain: u64,
        /// Models a peer that died mid-message: the wait for the data gives up.
        stalls: bool,
    }

    impl Link for MemLink<'_> {
        fn send(&mut self, ptr: u64, bytes: usize) -> Result<(), TransferError> {
            let at = ptr as usize;
            self.wire.push_back(self.memory[at..at + bytes].to_vec());
            Ok(())
        }
        fn recv(&mut self, ptr: u64, bytes: usize) -> Result<(), TransferError> {
            let msg = self
                .wire
                .pop_front()
                .ok_or_else(|| TransferError::Protocol("nothing to receive".into()))?;
            if msg.len() != bytes {
                return Err(TransferError::Protocol(format!(
                    "receive of {bytes} bytes matched a send of {}",
                    msg.len()
                )));
            }
            let at = ptr as usize;
            self.memory[at..at + bytes].copy_from_slice(&msg);
            Ok(())
        }
        fn upload(&mut self, ptr: u64, host: &[u8]) -> Result<(), TransferError> {
            let at = ptr as usize;
            self.memory[at..at + host.len()].copy_from_slice(host);
            Ok(())
        }
        fn download(&mut self, ptr: u64, host: &mut [u8]) -> Result<(), TransferError> {
            let at = ptr as usize;
            host.copy_from_slice(&self.memory[at..at + host.len()]);
            Ok(())
        }
        fn synchronize(&mut self) -> Result<(), TransferError> {
            if self.stalls {
                return Err(TransferError::Protocol("link aborted".into()));
            }
            Ok(())
        }
        fn message_area(&self) -> u64 {
            self.message
        }
        fn drain_area(&self) -> u64 {
            self.drain
        }
    }

    /// The sending end; the tests switch `message` to the receiver's area before receiving.
    fn sender_link<'a>(memory: &'a mut Vec<u8>, wire: &'a mut VecDeque<Vec<u8>>) -> MemLink<'a> {
        MemLink {
            memory,
            wire,
            message: SEND_MSG,
            drain: DRAIN,
            stalls: false,
        }
    }

    const PIECE: usize = 64;
    const LAYERS: usize = 2;
    const SRC_BLOCKS: usize = 8;
    const DST_BLOCKS: usize = 16;
    // Regions of the one memory: sender pool, receiver pool, two message areas, a drain.
    const SRC: u64 = 0;
    const DST: u64 = (LAYERS * SRC_BLOCKS * PIECE) as u64;
    const SEND_MSG: u64 = DST + (LAYERS * DST_BLOCKS * PIECE) as u64;
    const RECV_MSG: u64 = SEND_MSG + MESSAGE_AREA_BYTES as u64;
    const DRAIN: u64 = RECV_MSG + MESSAGE_AREA_BYTES as u64;
    const MEMORY: usize = DRAIN as usize + PIECE;

    fn table() -> (KvCache, LeaseTable) {
        let layout = KvLayout {
            num_layers: LAYERS,
            num_kv_heads: 1,
            head_dim: 4,
            block_size: 16,
            dtype: KvDtype::F32,
            model_fingerprint: "m".into(),
        };
        let cache =
            KvCache::with_budget(layout.clone(), DST_BLOCKS * layout.block_bytes()).unwrap();
        let table =
            LeaseTable::new(cache.block_writer(), layout.hash(), None).with_device_pool(PIECE);
        (cache, table)
    }

    fn pool() -> DevicePool {
        DevicePool {
            base: DST,
            num_blocks: DST_BLOCKS,
            piece: PIECE,
        }
    }

    fn src_addr(layer: usize, block: usize) -> u64 {
        SRC + ((layer * SRC_BLOCKS + block) * PIECE) as u64
    }

    fn dst_addr(layer: usize, block: usize) -> usize {
        DST as usize + (layer * DST_BLOCKS + block) * PIECE
    }

    fn memory() -> Vec<u8> {
        let mut m = vec![0u8; MEMORY];
        for (i, b) in m[..DST as usize].iter_mut().enumerate() {
            *b = (i % 251) as u8 + 1;
        }
        m
    }

    #[test]
    fn two_leases_interleaved_land_in_their_blocks_and_commit() {
        let (_cache, table) = table();
        let (a, mut a_rx) = table.create(vec![9, 3], 20, "a").unwrap();
        let (b, mut b_rx) = table.create(vec![12], 10, "b").unwrap();
        let mut mem = memory();
        let mut wire = VecDeque::new();
        let mut link = sender_link(&mut mem, &mut wire);
        // As the engine thread does: per layer, every chunk of the step.
        for layer in 0..LAYERS {
            send_layer(
                &mut link,
                a.token(),
                layer,
                PIECE,
                &[0, 1],
                &[src_addr(layer, 0), src_addr(layer, 1)],
            )
            .unwrap();
            send_layer(
                &mut link,
                b.token(),
                layer,
                PIECE,
                &[0],
                &[src_addr(layer, 5)],
            )
            .unwrap();
        }
        link.message = RECV_MSG;
        for _ in 0..2 * LAYERS {
            let got = receive_layer(&mut link, &table, &pool()).unwrap();
            assert!(got.kept);
        }
        assert!(link.wire.is_empty(), "every message was received");
        for layer in 0..LAYERS {
            for (src, dst) in [(0, 9), (1, 3), (5, 12)] {
                let s = src_addr(layer, src) as usize;
                assert_eq!(
                    mem[dst_addr(layer, dst)..][..PIECE],
                    mem[s..s + PIECE],
                    "layer {layer} block {dst}"
                );
            }
        }
        for (lease, rx) in [(&a, &mut a_rx), (&b, &mut b_rx)] {
            let commit = KvCommit {
                lease: lease.token().as_bytes().to_vec(),
                kv_layout_hash: table.layout_hash().into(),
                num_tokens: lease.num_tokens as u32,
                transport: Transport::Nccl as i32,
                ..Default::default()
            };
            let bytes = table.commit(&commit).unwrap();
            assert_eq!(bytes, (LAYERS * lease.blocks.len() * PIECE) as u64);
            assert_eq!(rx.try_recv().unwrap().unwrap().transport, Transport::Nccl);
        }
    }

    #[test]
    fn an_ended_lease_is_drained_and_the_link_stays_in_step() {
        let (_cache, table) = table();
        let (gone, _rx) = table.create(vec![4], 10, "gone").unwrap();
        let (live, _rx2) = table.create(vec![6], 10, "live").unwrap();
        assert!(table.cancel(gone.token()).is_some());
        let mut mem = memory();
        let before = mem[dst_addr(0, 4)..][..PIECE].to_vec();
        let mut wire = VecDeque::new();
        let mut link = sender_link(&mut mem, &mut wire);
        send_layer(&mut link, gone.token(), 0, PIECE, &[0], &[src_addr(0, 1)]).unwrap();
        send_layer(&mut link, live.token(), 0, PIECE, &[0], &[src_addr(0, 2)]).unwrap();
        // A block outside the lease is drained too.
        send_layer(&mut link, live.token(), 1, PIECE, &[3], &[src_addr(1, 2)]).unwrap();
        link.message = RECV_MSG;
        assert!(!receive_layer(&mut link, &table, &pool()).unwrap().kept);
        assert!(receive_layer(&mut link, &table, &pool()).unwrap().kept);
        assert!(!receive_layer(&mut link, &table, &pool()).unwrap().kept);
        assert!(link.wire.is_empty());
        assert_eq!(
            mem[dst_addr(0, 4)..][..PIECE],
            before[..],
            "a cancelled lease's block is untouched"
        );
        let s = src_addr(0, 2) as usize;
        assert_eq!(mem[dst_addr(0, 6)..][..PIECE], mem[s..s + PIECE]);
    }

    #[test]
    fn a_commit_before_every_piece_arrived_is_incomplete() {
        let (_cache, table) = table();
        let (lease, _rx) = table.create(vec![1, 2], 20, "r").unwrap();
        let mut mem = memory();
        let mut wire = VecDeque::new();
        let mut link = sender_link(&mut mem, &mut wire);
        send_layer(
            &mut link,
            lease.token(),
            0,
            PIECE,
            &[0, 1],
            &[src_addr(0, 0), src_addr(0, 1)],
        )
        .unwrap();
        link.message = RECV_MSG;
        receive_layer(&mut link, &table, &pool()).unwrap();
        let commit = KvCommit {
            lease: lease.token().as_bytes().to_vec(),
            kv_layout_hash: table.layout_hash().into(),
            num_tokens: 20,
            transport: Transport::Nccl as i32,
            ..Default::default()
        };
        let why = table.commit(&commit).unwrap_err().to_string();
        assert!(why.contains("never arrived"), "{why}");
    }

    #[test]
    fn a_stalled_receive_fails_without_keeping_the_lease_locked() {
        let (_cache, table) = table();
        let (lease, _rx) = table.create(vec![2], 10, "r").unwrap();
        let mut mem = memory();
        let mut wire = VecDeque::new();
        let mut link = sender_link(&mut mem, &mut wire);
        link.stalls = true;
        send_layer(&mut link, lease.token(), 0, PIECE, &[0], &[src_addr(0, 0)]).unwrap();
        link.message = RECV_MSG;
        assert!(receive_layer(&mut link, &table, &pool()).is_err());
        // The lease can still end (its waiter is told), and nothing counted as received.
        assert_eq!(table.cancel(lease.token()), Some(vec![2]));
        assert_eq!(lease.progress().bytes, 0);
    }

    #[test]
    fn headers_round_trip_and_garbage_is_refused() {
        let h = LayerHeader {
            lease: LeaseToken::generate().unwrap(),
            layer: 31,
            count: 128,
            piece: 65536,
        };
        assert_eq!(LayerHeader::decode(&h.encode()).unwrap(), h);
        assert!(LayerHeader::decode(&[0u8; HEADER_BYTES]).is_err());
        let mut too_many = h;
        too_many.count = MAX_BLOCKS_PER_LAYER as u32 + 1;
        assert!(LayerHeader::decode(&too_many.encode()).is_err());
        assert!(LayerHeader::decode(&h.encode()[..16]).is_err());
    }
}
