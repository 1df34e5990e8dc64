//! The gRPC transport: a `PushKv` client stream per request (header, blocks layer by layer in
//! messages of at most 1 MiB, commit), and the decode worker's handler for it. It keeps
//! nothing per decode worker beyond the shared gRPC channel ([`crate::reach`]).

use std::time::Instant;

use bytes::Bytes;
use futures::StreamExt;
use tandem_proto::v1::{KvBlocks, KvCommit, KvHeader, KvMessage, Transport, kv_message};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;

use crate::checksum::crc32;
use crate::error::TransferError;
use crate::lease::{LeaseTable, LeaseToken};
use crate::sender::{FirstToken, KvSender, SendFuture, SendStats};
use crate::transport::{KvTransport, OpenFuture, Opening};

/// Payload bytes per message, well under tonic's 4 MiB default limit.
const MAX_PAYLOAD: usize = 1 << 20;
/// Messages in flight between the engine thread and the network task.
const QUEUE: usize = 16;

/// The `grpc` transport.
pub(crate) struct GrpcTransport;

impl KvTransport for GrpcTransport {
    fn kind(&self) -> Transport {
        Transport::Grpc
    }

    fn open<'a>(&'a self, op: Opening<'a>) -> OpenFuture<'a> {
        Box::pin(async move { Ok(Box::new(GrpcSender::start(op).await?) as Box<dyn KvSender>) })
    }
}

struct GrpcSender {
    tx: mpsc::Sender<KvMessage>,
    done: oneshot::Receiver<Result<u64, TransferError>>,
    lease: LeaseToken,
    layout_hash: String,
    request_id: String,
    num_tokens: usize,
    bytes: u64,
    started: Option<Instant>,
}

impl GrpcSender {
    async fn start(op: Opening<'_>) -> Result<Self, TransferError> {
        let mut client = op.reach.decode_client(&op.decode.endpoint)?;
        let (tx, rx) = mpsc::channel(QUEUE);
        let header = KvMessage {
            msg: Some(kv_message::Msg::Header(KvHeader {
                lease: op.lease.as_bytes().to_vec(),
                kv_layout_hash: op.dest.kv_layout_hash.clone(),
                request_id: op.request_id.to_string(),
            })),
        };
        tx.send(header)
            .await
            .map_err(|_| TransferError::Connect("transfer task ended".into()))?;
        let (done_tx, done) = oneshot::channel();
        tokio::spawn(async move {
            let result = client
                .push_kv(ReceiverStream::new(rx))
                .await
                .map(|ack| ack.into_inner().bytes_received)
                .map_err(|s| TransferError::Remote(format!("{}: {}", s.code(), s.message())));
            let _ = done_tx.send(result);
        });
        Ok(Self {
            tx,
            done,
            lease: op.lease,
            layout_hash: op.dest.kv_layout_hash,
            request_id: op.request_id.to_string(),
            num_tokens: op.num_tokens,
            bytes: 0,
            started: None,
        })
    }

    fn failed(&mut self) -> TransferError {
        match self.done.try_recv() {
            Ok(Err(e)) => e,
            _ => TransferError::Connect("the gRPC transfer stream closed".into()),
        }
    }
}

impl KvSender for GrpcSender {
    fn send_layer(&mut self, layer: usize, blocks: &[(u32, &[u8])]) -> Result<(), TransferError> {
        self.started.get_or_insert_with(Instant::now);
        let per_msg = blocks
            .first()
            .map_or(1, |(_, b)| (MAX_PAYLOAD / b.len().max(1)).max(1));
        for group in blocks.chunks(per_msg) {
            let mut payload = Vec::with_capacity(group.iter().map(|(_, b)| b.len()).sum());
            let mut logical = Vec::with_capacity(group.len());
            let mut checksums = Vec::with_capacity(group.len());
            for &(lb, bytes) in group {
                payload.extend_from_slice(bytes);
                logical.push(lb);
                checksums.push(crc32(bytes));
            }
            self.bytes += payload.len() as u64;
            let msg = KvMessage {
                msg: Some(kv_message::Msg::Blocks(KvBlocks {
                    layer: layer as u32,
                    logical_blocks: logical,
                    checksums,
                    payload: Bytes::from(payload),
                })),
            };
            if self.tx.blocking_send(msg).is_err() {
                return Err(self.failed());
            }
        }
        Ok(())
    }

    fn commit(self: Box<Self>, first: FirstToken) -> SendFuture {
        Box::pin(async move {
            let me = *self;
            let started = me.started.unwrap_or_else(Instant::now);
            let commit = KvMessage {
                msg: Some(kv_message::Msg::Commit(KvCommit {
                    lease: me.lease.as_bytes().to_vec(),
                    kv_layout_hash: me.layout_hash.clone(),
                    request_id: me.request_id.clone(),
                    first_token: first.token,
                    first_logprob: first.logprob,
                    first_top_logprobs: first.top_to_proto(),
                    other_choices: first.others_to_proto(),
                    num_tokens: me.num_tokens as u32,
                    checksums: Vec::new(),
                    transport: Transport::Grpc as i32,
                    bytes: me.bytes,
                })),
            };
            let sent = me.tx.send(commit).await;
            drop(me.tx);
            let result = me
                .done
                .await
                .map_err(|_| TransferError::Connect("transfer task ended".into()))?;
            sent.map_err(|_| TransferError::Connect("the gRPC transfer stream closed".into()))
                .and(result)?;
            Ok(SendStats {
                bytes: me.bytes,
                seconds: started.elapsed().as_secs_f64(),
                transport: Transport::Grpc,
            })
        })
    }
}

/// The decode worker's side of `PushKv`: checks the header, writes every block through the
/// lease table, and commits. Any error fails the stream (and, for bad data, the lease).
/// `stream` is the call's `tonic::Streaming` (any stream of messages, so that the fuzz target
/// feeds it decoded bytes).
pub async fn receive_push_kv<S>(table: &LeaseTable, stream: &mut S) -> Result<u64, TransferError>
where
    S: futures::Stream<Item = Result<KvMessage, tonic::Status>> + Unpin,
{
    let next =
        |s: tonic::Status| TransferError::Protocol(format!("transfer stream: {}", s.message()));
    let Some(first) = stream.next().await.transpose().map_err(next)? else {
        return Err(TransferError::Protocol("empty transfer stream".into()));
    };
    let Some(kv_message::Msg::Header(header)) = first.msg else {
        return Err(TransferError::Protocol(
            "a transfer must start with its header".into(),
        ));
    };
    let lease = table.check_header(&header.lease, &header.kv_layout_hash)?;
    while let Some(msg) = stream.next().await.transpose().map_err(next)? {
        match msg.msg {
            Some(kv_message::Msg::Blocks(b)) => {
                table.write_blocks(
                    &lease,
                    b.layer as usize,
                    &b.logical_blocks,
                    &b.checksums,
                    &b.payload,
                )?;
            }
            Some(kv_message::Msg::Commit(c)) => {
                if c.lease != lease.token().as_bytes() {
                    return Err(TransferError::Protocol(
                        "a transfer commits the lease its header named".into(),
                    ));
                }
                return table.commit(&c);
            }
            _ => {
                return Err(TransferError::Protocol(
                    "unexpected message in a transfer".into(),
                ));
            }
        }
    }
    Err(TransferError::Incomplete(
        "the transfer ended without a commit".into(),
    ))
}
