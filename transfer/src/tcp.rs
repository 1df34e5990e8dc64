//! The raw TCP transport: one connection per request to the decode worker's KV port. The
//! sender writes a hello (protocol version, lease, layout hash), then one frame per layer's
//! blocks as layers complete, then the commit, and reads back an ack or an error. The payload
//! travels as raw bytes: no protobuf encoding, one copy out of the cache.

use std::sync::Arc;
use std::time::Instant;

use tandem_engine::kv::KvLayout;
use tandem_proto::PROTOCOL_VERSION;
use tandem_proto::v1::{KvCommit, KvDestination, Transport};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::bufpool;
use crate::checksum::crc32;
use crate::error::TransferError;
use crate::frame::{self, HeaderReader, HeaderWriter, Kind};
use crate::lease::LeaseTable;
use crate::sender::{KvSender, SendFuture, SendStats};

/// Payload bytes per frame.
const MAX_FRAME_PAYLOAD: usize = 8 << 20;
const QUEUE: usize = 16;

pub(crate) struct TcpSender {
    tx: mpsc::Sender<Vec<u8>>,
    writer: JoinHandle<Result<(), TransferError>>,
    reader: OwnedReadHalf,
    dest: KvDestination,
    num_tokens: usize,
    bytes: u64,
    started: Option<Instant>,
}

impl TcpSender {
    pub(crate) async fn start(
        dest: KvDestination,
        _layout: &KvLayout,
        request_id: &str,
        num_tokens: usize,
    ) -> Result<Self, TransferError> {
        let stream = TcpStream::connect(&dest.kv_tcp_addr)
            .await
            .map_err(|e| TransferError::Connect(format!("KV port {}: {e}", dest.kv_tcp_addr)))?;
        stream.set_nodelay(true)?;
        let (reader, mut write_half) = stream.into_split();
        let mut hello = HeaderWriter::default();
        hello
            .u32(PROTOCOL_VERSION)
            .u64(dest.lease_id)
            .str(&dest.kv_layout_hash)
            .str(request_id);
        frame::write(&mut write_half, Kind::Hello, &hello.0, &[]).await?;
        let (tx, mut rx) = mpsc::channel::<Vec<u8>>(QUEUE);
        let writer = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            while let Some(buf) = rx.recv().await {
                write_half.write_all(&buf).await?;
                bufpool::give(buf);
            }
            write_half.flush().await?;
            Ok(())
        });
        Ok(Self {
            tx,
            writer,
            reader,
            dest,
            num_tokens,
            bytes: 0,
            started: None,
        })
    }
}

impl KvSender for TcpSender {
    fn send_layer(&mut self, layer: usize, blocks: &[(u32, &[u8])]) -> Result<(), TransferError> {
        self.started.get_or_insert_with(Instant::now);
        let per_frame = blocks
            .first()
            .map_or(1, |(_, b)| (MAX_FRAME_PAYLOAD / b.len().max(1)).max(1));
        for group in blocks.chunks(per_frame) {
            let mut header = HeaderWriter::default();
            header.u32(layer as u32).u32(group.len() as u32);
            for &(lb, bytes) in group {
                header.u32(lb).u32(crc32(bytes));
            }
            let payload_len: usize = group.iter().map(|(_, b)| b.len()).sum();
            let header_frame = frame::encode(Kind::Blocks, &header.0, &[]);
            let mut buf = bufpool::take(header_frame.len() + payload_len);
            buf.extend_from_slice(&header_frame);
            // Patch the payload length into the prefix, then append the blocks: one copy.
            buf[12..20].copy_from_slice(&(payload_len as u64).to_le_bytes());
            buf.reserve(payload_len);
            for &(_, bytes) in group {
                buf.extend_from_slice(bytes);
            }
            self.bytes += payload_len as u64;
            if self.tx.blocking_send(buf).is_err() {
                return Err(TransferError::Connect("the KV connection closed".into()));
            }
        }
        Ok(())
    }

    fn commit(self: Box<Self>, first_token: u32, first_logprob: f32) -> SendFuture {
        Box::pin(async move {
            let mut me = *self;
            let started = me.started.unwrap_or_else(Instant::now);
            let mut header = HeaderWriter::default();
            header
                .u32(first_token)
                .f32(first_logprob)
                .u32(me.num_tokens as u32)
                .u64(me.bytes);
            let sent = me
                .tx
                .send(frame::encode(Kind::Commit, &header.0, &[]))
                .await;
            drop(me.tx);
            let wrote = me
                .writer
                .await
                .map_err(|e| TransferError::Connect(format!("KV writer: {e}")))?;
            // The peer's answer explains a failed write better than the write error does.
            let reply = frame::read(&mut me.reader).await;
            match reply {
                Ok(Some(f)) if f.kind == Kind::Ack => {
                    sent.map_err(|_| TransferError::Connect("the KV connection closed".into()))?;
                    wrote?;
                    Ok(SendStats {
                        bytes: me.bytes,
                        seconds: started.elapsed().as_secs_f64(),
                        transport: Transport::Tcp,
                    })
                }
                Ok(Some(f)) if f.kind == Kind::Error => Err(TransferError::Remote(
                    HeaderReader(&f.header).str().unwrap_or_default(),
                )),
                Ok(_) => Err(TransferError::Protocol(format!(
                    "no acknowledgement from {}",
                    me.dest.kv_tcp_addr
                ))),
                Err(e) => Err(e),
            }
        })
    }
}

/// Accepts KV connections until `shutdown` resolves; each is served on its own task.
pub async fn serve_tcp(
    listener: TcpListener,
    table: Arc<LeaseTable>,
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let table = table.clone();
                    tokio::spawn(async move {
                        if let Err(e) = serve_connection(stream, &table).await {
                            tracing::warn!(%peer, error = %e, "KV transfer over tcp failed");
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a KV connection failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    }
}

async fn serve_connection(stream: TcpStream, table: &LeaseTable) -> Result<(), TransferError> {
    stream.set_nodelay(true)?;
    let (mut reader, mut writer) = stream.into_split();
    let result = receive(&mut reader, table).await;
    match &result {
        Ok(bytes) => {
            let mut h = HeaderWriter::default();
            h.u64(*bytes);
            frame::write(&mut writer, Kind::Ack, &h.0, &[]).await?;
        }
        Err(e) => {
            let mut h = HeaderWriter::default();
            h.str(&e.to_string());
            let _ = frame::write(&mut writer, Kind::Error, &h.0, &[]).await;
        }
    }
    result.map(|_| ())
}

async fn receive(reader: &mut OwnedReadHalf, table: &LeaseTable) -> Result<u64, TransferError> {
    let hello = frame::read(reader)
        .await?
        .ok_or_else(|| TransferError::Protocol("connection closed before hello".into()))?;
    if hello.kind != Kind::Hello {
        return Err(TransferError::Protocol(
            "a transfer must start with hello".into(),
        ));
    }
    let mut h = HeaderReader(&hello.header);
    let version = h.u32()?;
    if version != PROTOCOL_VERSION {
        return Err(TransferError::Protocol(format!(
            "protocol version {version}, this worker speaks {PROTOCOL_VERSION}"
        )));
    }
    let lease_id = h.u64()?;
    let layout_hash = h.str()?;
    let request_id = h.str()?;
    let lease = table.check_header(lease_id, &layout_hash)?;
    let mut payload = bufpool::take(0);
    let result = receive_frames(
        reader,
        table,
        &lease,
        lease_id,
        layout_hash,
        request_id,
        &mut payload,
    )
    .await;
    bufpool::give(payload);
    result
}

#[allow(clippy::too_many_arguments)]
async fn receive_frames(
    reader: &mut OwnedReadHalf,
    table: &LeaseTable,
    lease: &crate::lease::Lease,
    lease_id: u64,
    layout_hash: String,
    request_id: String,
    payload: &mut Vec<u8>,
) -> Result<u64, TransferError> {
    loop {
        let (kind, header) = frame::read_into(reader, payload).await?.ok_or_else(|| {
            TransferError::Incomplete(format!("lease {lease_id}: connection closed before commit"))
        })?;
        let mut h = HeaderReader(&header);
        match kind {
            Kind::Blocks => {
                let layer = h.u32()? as usize;
                let count = h.u32()? as usize;
                if count > header.len() / 8 {
                    return Err(TransferError::Protocol(
                        "block count exceeds the header".into(),
                    ));
                }
                let mut logical = Vec::with_capacity(count);
                let mut checksums = Vec::with_capacity(count);
                for _ in 0..count {
                    logical.push(h.u32()?);
                    checksums.push(h.u32()?);
                }
                table.write_blocks(lease, layer, &logical, &checksums, payload)?;
            }
            Kind::Commit => {
                let commit = KvCommit {
                    lease_id,
                    kv_layout_hash: layout_hash,
                    request_id,
                    first_token: h.u32()?,
                    first_logprob: h.f32()?,
                    num_tokens: h.u32()?,
                    bytes: h.u64()?,
                    checksums: Vec::new(),
                    transport: Transport::Tcp as i32,
                };
                return table.commit(&commit);
            }
            other => {
                return Err(TransferError::Protocol(format!(
                    "unexpected {other:?} frame"
                )));
            }
        }
    }
}
