//! The raw TCP framing: a fixed 20-byte prefix (magic, kind, header length, payload length),
//! a small little-endian header, then the payload bytes untouched.
//!
//! Nothing a peer declares is allocated as declared: [`read_prefix`] returns the lengths, the
//! caller checks them against what the frame's kind and the lease allow, and only then reads
//! the header ([`read_header`], bounded) and streams the payload into buffers of its own size.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::error::TransferError;

pub(crate) const MAGIC: [u8; 4] = *b"TKV2";
pub(crate) const PREFIX: usize = 20;
/// The largest header of a control frame (challenge, hello, commit, ack, error).
pub(crate) const MAX_CONTROL_HEADER: u32 = 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    Hello = 1,
    Blocks = 2,
    Commit = 3,
    Ack = 4,
    Error = 5,
    /// The listener's first words: a nonce the sender's hello must answer.
    Challenge = 6,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Kind::Hello,
            2 => Kind::Blocks,
            3 => Kind::Commit,
            4 => Kind::Ack,
            5 => Kind::Error,
            6 => Kind::Challenge,
            _ => return None,
        })
    }
}

/// A frame's prefix: what the peer claims follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Prefix {
    pub kind: Kind,
    pub header_len: u32,
    pub payload_len: u64,
}

/// A control frame: header only.
#[derive(Debug)]
pub(crate) struct Frame {
    pub kind: Kind,
    pub header: Vec<u8>,
}

/// The prefix of a frame whose payload is `payload_len` bytes (the payload follows apart).
pub(crate) fn encode_prefix(kind: Kind, header_len: usize, payload_len: u64) -> [u8; PREFIX] {
    let mut out = [0u8; PREFIX];
    out[..4].copy_from_slice(&MAGIC);
    out[4] = kind as u8;
    out[8..12].copy_from_slice(&(header_len as u32).to_le_bytes());
    out[12..20].copy_from_slice(&payload_len.to_le_bytes());
    out
}

/// Serializes a control frame.
pub(crate) fn encode(kind: Kind, header: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(PREFIX + header.len());
    out.extend_from_slice(&encode_prefix(kind, header.len(), 0));
    out.extend_from_slice(header);
    out
}

async fn timed<T>(
    limit: Duration,
    what: &str,
    fut: impl Future<Output = std::io::Result<T>>,
) -> Result<T, TransferError> {
    match tokio::time::timeout(limit, fut).await {
        Ok(r) => r.map_err(TransferError::from),
        Err(_) => Err(TransferError::TimedOut(format!(
            "the peer sent nothing for {} ms ({what})",
            limit.as_millis()
        ))),
    }
}

/// Reads a prefix within `limit`; `Ok(None)` at a clean end of stream.
pub(crate) async fn read_prefix<R: AsyncReadExt + Unpin>(
    r: &mut R,
    limit: Duration,
) -> Result<Option<Prefix>, TransferError> {
    let mut prefix = [0u8; PREFIX];
    match tokio::time::timeout(limit, r.read_exact(&mut prefix)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Ok(Err(e)) => return Err(e.into()),
        Err(_) => {
            return Err(TransferError::TimedOut(format!(
                "the peer sent no frame for {} ms",
                limit.as_millis()
            )));
        }
    }
    if prefix[..4] != MAGIC {
        return Err(TransferError::Protocol("bad frame magic".into()));
    }
    let kind = Kind::from_u8(prefix[4])
        .ok_or_else(|| TransferError::Protocol(format!("unknown frame kind {}", prefix[4])))?;
    let header_len = u32::from_le_bytes([prefix[8], prefix[9], prefix[10], prefix[11]]);
    let mut payload = [0u8; 8];
    payload.copy_from_slice(&prefix[12..20]);
    Ok(Some(Prefix {
        kind,
        header_len,
        payload_len: u64::from_le_bytes(payload),
    }))
}

/// Reads a header of `len` bytes, refusing more than `max`.
pub(crate) async fn read_header<R: AsyncReadExt + Unpin>(
    r: &mut R,
    len: u32,
    max: u32,
    limit: Duration,
) -> Result<Vec<u8>, TransferError> {
    if len > max {
        return Err(TransferError::Protocol(format!(
            "a frame header of {len} bytes (at most {max} here)"
        )));
    }
    let mut header = vec![0u8; len as usize];
    timed(limit, "frame header", r.read_exact(&mut header)).await?;
    Ok(header)
}

/// Reads exactly `buf.len()` payload bytes within `limit`.
pub(crate) async fn read_payload<R: AsyncReadExt + Unpin>(
    r: &mut R,
    buf: &mut [u8],
    limit: Duration,
) -> Result<(), TransferError> {
    timed(limit, "frame payload", r.read_exact(buf)).await?;
    Ok(())
}

/// Reads one control frame (no payload, header at most [`MAX_CONTROL_HEADER`]); `Ok(None)` at
/// a clean end of stream.
pub(crate) async fn read_control<R: AsyncReadExt + Unpin>(
    r: &mut R,
    limit: Duration,
) -> Result<Option<Frame>, TransferError> {
    let Some(prefix) = read_prefix(r, limit).await? else {
        return Ok(None);
    };
    if prefix.payload_len != 0 {
        return Err(TransferError::Protocol(format!(
            "a {:?} frame carries no payload, this one claims {} bytes",
            prefix.kind, prefix.payload_len
        )));
    }
    let header = read_header(r, prefix.header_len, MAX_CONTROL_HEADER, limit).await?;
    Ok(Some(Frame {
        kind: prefix.kind,
        header,
    }))
}

pub(crate) async fn write<W: AsyncWriteExt + Unpin>(
    w: &mut W,
    kind: Kind,
    header: &[u8],
) -> Result<(), TransferError> {
    w.write_all(&encode(kind, header)).await?;
    w.flush().await?;
    Ok(())
}

/// Little-endian header building.
#[derive(Debug, Default)]
pub(crate) struct HeaderWriter(pub Vec<u8>);

impl HeaderWriter {
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn f32(&mut self, v: f32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// A string of at most `u16::MAX` bytes, cut at a character boundary.
    pub fn str(&mut self, s: &str) -> &mut Self {
        let mut end = s.len().min(u16::MAX as usize);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.bytes(&s.as_bytes()[..end])
    }
    /// Bytes with a u16 length.
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        let b = &b[..b.len().min(u16::MAX as usize)];
        self.0.extend_from_slice(&(b.len() as u16).to_le_bytes());
        self.0.extend_from_slice(b);
        self
    }
}

/// Little-endian header parsing; every read is bounds-checked.
#[derive(Debug)]
pub(crate) struct HeaderReader<'a>(pub &'a [u8]);

impl HeaderReader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], TransferError> {
        if self.0.len() < n {
            return Err(TransferError::Protocol("truncated frame header".into()));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], TransferError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
    pub fn u32(&mut self) -> Result<u32, TransferError> {
        self.array().map(u32::from_le_bytes)
    }
    pub fn u64(&mut self) -> Result<u64, TransferError> {
        self.array().map(u64::from_le_bytes)
    }
    pub fn f32(&mut self) -> Result<f32, TransferError> {
        self.array().map(f32::from_le_bytes)
    }
    pub fn bytes(&mut self) -> Result<Vec<u8>, TransferError> {
        let n = u16::from_le_bytes(self.array()?) as usize;
        Ok(self.take(n)?.to_vec())
    }
    pub fn str(&mut self) -> Result<String, TransferError> {
        String::from_utf8(self.bytes()?)
            .map_err(|_| TransferError::Protocol("non-UTF-8 string in header".into()))
    }
    /// Refuses trailing bytes (a frame must be exactly what its kind says).
    pub fn end(&self) -> Result<(), TransferError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(TransferError::Protocol(format!(
                "{} unexpected bytes after the frame header",
                self.0.len()
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: Duration = Duration::from_secs(1);

    #[tokio::test]
    async fn round_trip_and_limits() {
        let mut h = HeaderWriter::default();
        h.u32(7).u64(1 << 40).f32(-1.5).str("req-1").bytes(&[9, 8]);
        let bytes = encode(Kind::Hello, &h.0);
        let frame = read_control(&mut &bytes[..], LIMIT).await.unwrap().unwrap();
        assert_eq!(frame.kind, Kind::Hello);
        let mut r = HeaderReader(&frame.header);
        assert_eq!(
            (
                r.u32().unwrap(),
                r.u64().unwrap(),
                r.f32().unwrap(),
                r.str().unwrap(),
                r.bytes().unwrap()
            ),
            (7, 1 << 40, -1.5, "req-1".to_string(), vec![9, 8])
        );
        assert!(r.end().is_ok());
        assert!(r.u32().is_err(), "reading past the header is an error");
        assert!(read_control(&mut &b""[..], LIMIT).await.unwrap().is_none());
        let mut bad = bytes.clone();
        bad[0] = b'X';
        assert!(read_control(&mut &bad[..], LIMIT).await.is_err());
        assert!(
            read_control(&mut &bytes[..bytes.len() - 1], LIMIT)
                .await
                .is_err(),
            "truncated header"
        );
    }

    #[tokio::test]
    async fn declared_sizes_are_refused_before_anything_is_allocated() {
        // A control frame that claims a payload, or a header past the bound.
        let with_payload = encode_prefix(Kind::Hello, 4, 256 << 20);
        let e = read_control(&mut &with_payload[..], LIMIT)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("claims 268435456 bytes"), "{e}");
        let huge_header = encode_prefix(Kind::Hello, u32::MAX as usize, 0);
        let e = read_control(&mut &huge_header[..], LIMIT)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("at most 1024"), "{e}");
        // A prefix is read without waiting for what it announces.
        let prefix = encode_prefix(Kind::Blocks, 16, 1 << 30);
        let p = read_prefix(&mut &prefix[..], LIMIT).await.unwrap().unwrap();
        assert_eq!(
            (p.kind, p.header_len, p.payload_len),
            (Kind::Blocks, 16, 1 << 30)
        );
    }

    #[tokio::test]
    async fn a_silent_peer_times_out() {
        let (_keep_open, mut quiet) = tokio::io::duplex(64);
        let e = read_prefix(&mut quiet, Duration::from_millis(20))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("no frame"), "{e}");
    }
}
