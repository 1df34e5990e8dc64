//! The raw TCP transport: one connection per request to the decode worker's KV port.
//!
//! The listener speaks first: a challenge (protocol version, 32 random bytes). The sender
//! answers with its hello (version, lease capability, layout hash, request id, and a proof
//! of the deployment secret over the challenge and the lease), then one frame per layer's
//! blocks as layers complete, then the commit, and reads back an ack or an error. The
//! payload travels as raw bytes: no protobuf encoding, one copy out of the cache.
//!
//! The listener cannot be made to allocate by a stranger: it reads nothing but a bounded
//! hello until the proof and the lease check out; after that, each frame's declared sizes must
//! be exactly what its block count and the lease allow, and payloads stream through a buffer
//! of the listener's size into the lease's blocks. Every read has a timeout, and connections
//! beyond [`TcpLimits::max_connections`] are closed at once.
//!
//! With internal TLS on (see `tandem-auth`), the whole exchange runs inside mutual TLS: the
//! handshake happens first and counts against the hello's deadline.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_auth::InternalAuth;
use tandem_proto::PROTOCOL_VERSION;
use tandem_proto::limits::{MAX_CHOICES, MAX_TOP_LOGPROBS};
use tandem_proto::v1::{FirstChoice, KvCommit, TopLogprob, Transport};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinHandle;

use crate::bufpool;
use crate::checksum::crc32;
use crate::error::TransferError;
use crate::frame::{self, Frame, HeaderReader, HeaderWriter, Kind};
use crate::lease::{Lease, LeaseTable};
use crate::sender::{FirstToken, KvSender, SendFuture, SendStats};
use crate::stall::stall_limit;
use crate::transport::{KvTransport, OpenFuture, Opening};

/// Payload bytes per frame the sender builds.
const MAX_FRAME_PAYLOAD: usize = 8 << 20;
const QUEUE: usize = 16;
/// Payload bytes the listener reads at once (whole pieces), per connection.
const RECEIVE_CHUNK: usize = 1 << 20;
/// The sender's patience: connecting, and the listener's challenge.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// One choice's first token in a commit header at most: token, logprob, the count of top
/// logprobs and as many (id, logprob) pairs as a request may ask for.
const CHOICE_HEADER: u32 = 4 + 4 + 4 + 8 * MAX_TOP_LOGPROBS as u32;
/// A commit frame's header at most: choice 0's first token, tokens, bytes, the count of other
/// choices and as many first tokens as a request may have.
const COMMIT_HEADER: u32 = CHOICE_HEADER + 4 + 8 + 4 + (MAX_CHOICES as u32 - 1) * CHOICE_HEADER;

/// The listener's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpLimits {
    /// Connections served at once; more are closed as they arrive.
    pub max_connections: usize,
    /// From accepting a connection to a verified hello.
    pub hello_timeout: Duration,
    /// Any later read (a frame, a chunk of payload).
    pub read_timeout: Duration,
}

impl Default for TcpLimits {
    fn default() -> Self {
        Self {
            max_connections: 256,
            hello_timeout: Duration::from_secs(5),
            read_timeout: Duration::from_secs(30),
        }
    }
}

/// A KV connection: plain TCP, or TCP inside TLS.
trait KvIo: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> KvIo for T {}
type KvStream = Box<dyn KvIo>;

/// The host part of `host:port` (IPv6 addresses in brackets).
fn host_of(addr: &str) -> &str {
    addr.rsplit_once(':').map_or(addr, |(host, _)| host)
}

/// The `tcp` transport: a connection per request, to the KV port the decode worker
/// advertised in its verified info.
pub(crate) struct TcpTransport;

impl KvTransport for TcpTransport {
    fn kind(&self) -> Transport {
        Transport::Tcp
    }

    fn open<'a>(&'a self, op: Opening<'a>) -> OpenFuture<'a> {
        Box::pin(async move { Ok(Box::new(TcpSender::start(op).await?) as Box<dyn KvSender>) })
    }
}

/// `io` (a write toward the decode worker), failing as timed out if it makes no progress for
/// `limit`: a link that went silent mid-transfer (TCP itself retries for many minutes).
async fn within_stall<T>(
    limit: Duration,
    what: &str,
    io: impl std::future::Future<Output = std::io::Result<T>>,
) -> Result<T, TransferError> {
    match tokio::time::timeout(limit, io).await {
        Ok(r) => r.map_err(TransferError::from),
        Err(_) => Err(TransferError::TimedOut(format!(
            "{what} could not be written for {} ms",
            limit.as_millis()
        ))),
    }
}

/// The task writing a sender's frames, aborted when the sender is dropped unfinished (the
/// request was cancelled, or failed): a write blocked on a link that went silent would
/// otherwise hold its socket and buffers until TCP gives up, minutes later.
struct WriterTask(JoinHandle<Result<(), TransferError>>);

impl Drop for WriterTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

struct TcpSender {
    tx: mpsc::Sender<Vec<u8>>,
    writer: WriterTask,
    /// How long a write or the acknowledgement may make no progress.
    stall: Duration,
    reader: ReadHalf<KvStream>,
    addr: String,
    num_tokens: usize,
    bytes: u64,
    started: Option<Instant>,
}

impl TcpSender {
    async fn start(op: Opening<'_>) -> Result<Self, TransferError> {
        let addr =
            op.decode.kv_tcp_addr.clone().ok_or_else(|| {
                TransferError::Connect("the decode worker has no KV TCP port".into())
            })?;
        let stream = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(&addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(TransferError::Connect(format!("KV port {addr}: {e}"))),
            Err(_) => {
                return Err(TransferError::Connect(format!(
                    "KV port {addr}: no connection within {} s",
                    CONNECT_TIMEOUT.as_secs()
                )));
            }
        };
        stream.set_nodelay(true)?;
        let stream: KvStream = match op.reach.auth().kv_connector(host_of(&addr)) {
            Ok(None) => Box::new(stream),
            Ok(Some((connector, name))) => {
                let tls = tokio::time::timeout(CONNECT_TIMEOUT, connector.connect(name, stream))
                    .await
                    .map_err(|_| {
                        TransferError::Connect(format!("KV port {addr}: no TLS handshake"))
                    })?
                    .map_err(|e| {
                        TransferError::Unauthenticated(format!("KV port {addr}: TLS: {e}"))
                    })?;
                Box::new(tls)
            }
            Err(e) => return Err(TransferError::Connect(e.to_string())),
        };
        let (mut reader, mut write_half) = tokio::io::split(stream);
        let challenge = frame::read_control(&mut reader, CONNECT_TIMEOUT)
            .await?
            .ok_or_else(|| TransferError::Connect(format!("{addr} closed before its challenge")))?;
        let nonce = challenge_nonce(&addr, &challenge)?;
        let lease = op.lease.as_bytes();
        let mut hello = HeaderWriter::default();
        hello
            .u32(PROTOCOL_VERSION)
            .bytes(lease)
            .str(&op.dest.kv_layout_hash)
            .str(op.request_id)
            .bytes(&op.reach.auth().kv_hello_proof(&nonce, lease));
        frame::write(&mut write_half, Kind::Hello, &hello.0).await?;
        let stall = stall_limit(op.dest.lease_ttl_ms);
        let (tx, mut rx) = mpsc::channel::<Vec<u8>>(QUEUE);
        let writer = tokio::spawn(async move {
            while let Some(buf) = rx.recv().await {
                within_stall(stall, "a KV frame", write_half.write_all(&buf)).await?;
                bufpool::give(buf);
            }
            within_stall(stall, "the last KV frame", write_half.flush()).await?;
            Ok(())
        });
        Ok(Self {
            tx,
            writer: WriterTask(writer),
            stall,
            reader,
            addr,
            num_tokens: op.num_tokens,
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
            let prefix = frame::encode_prefix(Kind::Blocks, header.0.len(), payload_len as u64);
            let mut buf = bufpool::take(prefix.len() + header.0.len() + payload_len);
            buf.extend_from_slice(&prefix);
            buf.extend_from_slice(&header.0);
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

    fn commit(self: Box<Self>, first: FirstToken) -> SendFuture {
        Box::pin(async move {
            let mut me = *self;
            let started = me.started.unwrap_or_else(Instant::now);
            let mut header = HeaderWriter::default();
            header
                .u32(first.token)
                .f32(first.logprob)
                .u32(me.num_tokens as u32)
                .u64(me.bytes)
                .u32(first.top_logprobs.len() as u32);
            for &(id, logprob) in &first.top_logprobs {
                header.u32(id).f32(logprob);
            }
            header.u32(first.other_choices.len() as u32);
            for choice in &first.other_choices {
                header
                    .u32(choice.token)
                    .f32(choice.logprob)
                    .u32(choice.top_logprobs.len() as u32);
                for &(id, logprob) in &choice.top_logprobs {
                    header.u32(id).f32(logprob);
                }
            }
            let sent = me.tx.send(frame::encode(Kind::Commit, &header.0)).await;
            drop(me.tx);
            let wrote = (&mut me.writer.0)
                .await
                .map_err(|e| TransferError::Connect(format!("KV writer: {e}")))?;
            // A write that stalled past the lease: the link is gone, no answer will come.
            if let Err(e @ TransferError::TimedOut(_)) = wrote {
                return Err(e);
            }
            // The peer's answer explains a failed write better than the write error does.
            let reply = frame::read_control(&mut me.reader, me.stall).await;
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
                Ok(Some(f)) if f.kind == Kind::Error => Err(remote_error(&f)),
                // The connection closed without an answer: the peer gave up on the lease, or
                // the link failed; either way the request may be placed again.
                Ok(None) => Err(TransferError::Connect(format!(
                    "{} closed the KV connection without an acknowledgement",
                    me.addr
                ))),
                Ok(Some(f)) => Err(TransferError::Protocol(format!(
                    "{} answered the commit with a {:?} frame",
                    me.addr, f.kind
                ))),
                Err(e) => Err(e),
            }
        })
    }
}

/// The nonce of the listener's challenge, the first frame a sender reads from `addr`.
pub(crate) fn challenge_nonce(addr: &str, challenge: &Frame) -> Result<Vec<u8>, TransferError> {
    if challenge.kind != Kind::Challenge {
        return Err(TransferError::Protocol(format!(
            "{addr} opened with a {:?} frame instead of a challenge",
            challenge.kind
        )));
    }
    let mut h = HeaderReader(&challenge.header);
    let version = h.u32()?;
    if version != PROTOCOL_VERSION {
        return Err(TransferError::Protocol(format!(
            "{addr} speaks KV protocol {version}, this worker {PROTOCOL_VERSION}"
        )));
    }
    h.bytes()
}

/// The listener's error frame, as the sender reports it.
pub(crate) fn remote_error(f: &Frame) -> TransferError {
    TransferError::Remote(HeaderReader(&f.header).str().unwrap_or_default())
}

/// Accepts KV connections until `shutdown` resolves; each is served on its own task, at most
/// `limits.max_connections` at once.
pub async fn serve_tcp(
    listener: TcpListener,
    table: Arc<LeaseTable>,
    auth: InternalAuth,
    limits: TcpLimits,
    shutdown: impl Future<Output = ()>,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                        REFUSED.note(|suppressed| tracing::warn!(
                            %peer,
                            suppressed,
                            limit = limits.max_connections,
                            "KV connection closed: the listener serves at most this many at once"
                        ));
                        drop(stream);
                        continue;
                    };
                    let table = table.clone();
                    let auth = auth.clone();
                    tokio::spawn(async move {
                        let _slot = slot;
                        if let Err(e) = serve_connection(stream, &table, &auth, limits).await {
                            tracing::warn!(%peer, error = %e, "KV transfer over tcp failed");
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a KV connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
}

/// Refused connections are logged at most once a second.
static REFUSED: tandem_auth::RateLimitedLog =
    tandem_auth::RateLimitedLog::new(Duration::from_secs(1));

async fn serve_connection(
    stream: TcpStream,
    table: &LeaseTable,
    auth: &InternalAuth,
    limits: TcpLimits,
) -> Result<(), TransferError> {
    stream.set_nodelay(true)?;
    let stream: KvStream = match auth.kv_acceptor() {
        None => Box::new(stream),
        Some(acceptor) => {
            let tls = tokio::time::timeout(limits.hello_timeout, acceptor.accept(stream))
                .await
                .map_err(|_| TransferError::TimedOut("no TLS handshake in time".into()))?
                .map_err(|e| TransferError::Unauthenticated(format!("TLS: {e}")))?;
            Box::new(tls)
        }
    };
    let (mut reader, mut writer) = tokio::io::split(stream);
    let nonce = tandem_auth::challenge().map_err(|e| TransferError::Protocol(e.to_string()))?;
    let mut challenge = HeaderWriter::default();
    challenge.u32(PROTOCOL_VERSION).bytes(&nonce);
    frame::write(&mut writer, Kind::Challenge, &challenge.0).await?;
    let result = receive(&mut reader, table, auth, &nonce, limits).await;
    match &result {
        Ok(bytes) => {
            let mut h = HeaderWriter::default();
            h.u64(*bytes);
            frame::write(&mut writer, Kind::Ack, &h.0).await?;
        }
        Err(e) => {
            let mut h = HeaderWriter::default();
            h.str(&e.to_string());
            let _ = frame::write(&mut writer, Kind::Error, &h.0).await;
        }
    }
    result.map(|_| ())
}

/// The hello: bounded, within `hello_timeout`, checked before anything else is read.
async fn hello<R: AsyncReadExt + Unpin>(
    reader: &mut R,
    table: &LeaseTable,
    auth: &InternalAuth,
    nonce: &[u8],
    limits: TcpLimits,
) -> Result<(Arc<Lease>, KvCommit), TransferError> {
    // One deadline for the whole hello (prefix and header): a peer dripping bytes cannot
    // stretch it. (The per-read limit inside is only a backstop.)
    let hello = tokio::time::timeout(
        limits.hello_timeout,
        frame::read_control(reader, 2 * limits.hello_timeout),
    )
    .await
    .map_err(|_| {
        TransferError::TimedOut(format!(
            "no hello within {} ms",
            limits.hello_timeout.as_millis()
        ))
    })??
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
    let lease = h.bytes()?;
    let layout_hash = h.str()?;
    let request_id = h.str()?;
    let proof = h.bytes()?;
    h.end()?;
    auth.verify_kv_hello(nonce, &lease, &proof).map_err(|_| {
        TransferError::Unauthenticated(
            "the KV hello does not prove the deployment's internal secret".into(),
        )
    })?;
    let open = table.check_header(&lease, &layout_hash)?;
    // What the commit will need besides the commit frame's own fields.
    let commit = KvCommit {
        lease,
        kv_layout_hash: layout_hash,
        request_id,
        transport: Transport::Tcp as i32,
        ..KvCommit::default()
    };
    Ok((open, commit))
}

/// Everything after the challenge: the hello, the blocks, the commit. Returns the bytes
/// received.
pub(crate) async fn receive<R: AsyncReadExt + Unpin>(
    reader: &mut R,
    table: &LeaseTable,
    auth: &InternalAuth,
    nonce: &[u8],
    limits: TcpLimits,
) -> Result<u64, TransferError> {
    let (lease, mut commit) = hello(reader, table, auth, nonce, limits).await?;
    let piece = table.piece_bytes();
    let nblocks = lease.blocks.len();
    // Frames may not announce more blocks than the lease has.
    let max_header = 8 + 8 * nblocks as u32;
    let chunk_pieces = (RECEIVE_CHUNK / piece.max(1)).max(1);
    let mut buf = bufpool::take(chunk_pieces * piece);
    let result = async {
        loop {
            let prefix = frame::read_prefix(reader, limits.read_timeout)
                .await?
                .ok_or_else(|| {
                    TransferError::Incomplete("the connection closed before the commit".into())
                })?;
            match prefix.kind {
                Kind::Blocks => {
                    lease.note_sending();
                    let header = frame::read_header(
                        reader,
                        prefix.header_len,
                        max_header,
                        limits.read_timeout,
                    )
                    .await?;
                    let mut h = HeaderReader(&header);
                    let layer = h.u32()? as usize;
                    let count = h.u32()? as usize;
                    if count == 0 || count > nblocks || header.len() != 8 + 8 * count {
                        return Err(TransferError::Protocol(format!(
                            "a blocks frame of {count} blocks in a {}-byte header (the lease \
                             has {nblocks})",
                            header.len()
                        )));
                    }
                    if prefix.payload_len != (count * piece) as u64 {
                        return Err(TransferError::Protocol(format!(
                            "{count} blocks of {piece} bytes announced with {} payload bytes",
                            prefix.payload_len
                        )));
                    }
                    let mut logical = Vec::with_capacity(count);
                    let mut checksums = Vec::with_capacity(count);
                    for _ in 0..count {
                        logical.push(h.u32()?);
                        checksums.push(h.u32()?);
                    }
                    for start in (0..count).step_by(chunk_pieces) {
                        let end = (start + chunk_pieces).min(count);
                        buf.resize((end - start) * piece, 0);
                        frame::read_payload(reader, &mut buf, limits.read_timeout).await?;
                        table.write_blocks(
                            &lease,
                            layer,
                            &logical[start..end],
                            &checksums[start..end],
                            &buf,
                        )?;
                    }
                }
                Kind::Commit => {
                    if prefix.payload_len != 0 {
                        return Err(TransferError::Protocol(
                            "a commit carries no payload".into(),
                        ));
                    }
                    let header = frame::read_header(
                        reader,
                        prefix.header_len,
                        COMMIT_HEADER,
                        limits.read_timeout,
                    )
                    .await?;
                    let mut h = HeaderReader(&header);
                    commit.first_token = h.u32()?;
                    commit.first_logprob = h.f32()?;
                    commit.num_tokens = h.u32()?;
                    commit.bytes = h.u64()?;
                    // Bounded by the header's length, which read_header bounded.
                    commit.first_top_logprobs = read_alternatives(&mut h)?;
                    // Bounded likewise; the lease table checks the counts.
                    let others = h.u32()?;
                    for _ in 0..others {
                        let token = h.u32()?;
                        let logprob = h.f32()?;
                        let top_logprobs = read_alternatives(&mut h)?;
                        commit.other_choices.push(FirstChoice {
                            token,
                            logprob,
                            top_logprobs,
                        });
                    }
                    h.end()?;
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
    .await;
    bufpool::give(buf);
    result
}

/// A count of (id, logprob) pairs and the pairs; the count is bounded by the header's
/// length, which `read_header` bounded.
fn read_alternatives(h: &mut HeaderReader<'_>) -> Result<Vec<TopLogprob>, TransferError> {
    let count = h.u32()?;
    let mut top = Vec::new();
    for _ in 0..count {
        let id = h.u32()?;
        let logprob = h.f32()?;
        top.push(TopLogprob { id, logprob });
    }
    Ok(top)
}
