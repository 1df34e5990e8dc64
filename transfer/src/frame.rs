//! The raw TCP framing: a fixed 20-byte prefix (magic, kind, header length, payload length),
//! a small little-endian header, then the payload bytes untouched. Lengths are bounded before
//! anything is allocated.

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::error::TransferError;

pub(crate) const MAGIC: [u8; 4] = *b"TKV1";
const PREFIX: usize = 20;
const MAX_HEADER: u32 = 1 << 20;
pub(crate) const MAX_PAYLOAD: u64 = 256 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    Hello = 1,
    Blocks = 2,
    Commit = 3,
    Ack = 4,
    Error = 5,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Kind::Hello,
            2 => Kind::Blocks,
            3 => Kind::Commit,
            4 => Kind::Ack,
            5 => Kind::Error,
            _ => return None,
        })
    }
}

/// A decoded frame.
#[derive(Debug)]
pub(crate) struct Frame {
    pub kind: Kind,
    pub header: Vec<u8>,
}

/// Serializes a frame.
pub(crate) fn encode(kind: Kind, header: &[u8], payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(PREFIX + header.len() + payload.len());
    out.extend_from_slice(&MAGIC);
    out.push(kind as u8);
    out.extend_from_slice(&[0, 0, 0]);
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(header);
    out.extend_from_slice(payload);
    out
}

/// Reads one control frame (its payload, if any, is discarded); `Ok(None)` at a clean end
/// of stream.
pub(crate) async fn read<R: AsyncReadExt + Unpin>(
    r: &mut R,
) -> Result<Option<Frame>, TransferError> {
    let mut payload = Vec::new();
    Ok(read_into(r, &mut payload)
        .await?
        .map(|(kind, header)| Frame { kind, header }))
}

/// Reads one frame, its payload into `payload`: reused across frames, because fresh
/// multi-megabyte buffers cost a page fault per 4 KiB, which halves loopback throughput.
pub(crate) async fn read_into<R: AsyncReadExt + Unpin>(
    r: &mut R,
    payload: &mut Vec<u8>,
) -> Result<Option<(Kind, Vec<u8>)>, TransferError> {
    let mut prefix = [0u8; PREFIX];
    match r.read_exact(&mut prefix).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    if prefix[..4] != MAGIC {
        return Err(TransferError::Protocol("bad frame magic".into()));
    }
    let kind = Kind::from_u8(prefix[4])
        .ok_or_else(|| TransferError::Protocol(format!("unknown frame kind {}", prefix[4])))?;
    let header_len = u32::from_le_bytes([prefix[8], prefix[9], prefix[10], prefix[11]]);
    let payload_len = u64::from_le_bytes(prefix[12..20].try_into().unwrap_or([0; 8]));
    if header_len > MAX_HEADER || payload_len > MAX_PAYLOAD {
        return Err(TransferError::Protocol(format!(
            "frame too large ({header_len} + {payload_len} bytes)"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    r.read_exact(&mut header).await?;
    payload.resize(payload_len as usize, 0);
    r.read_exact(payload).await?;
    Ok(Some((kind, header)))
}

pub(crate) async fn write<W: AsyncWriteExt + Unpin>(
    w: &mut W,
    kind: Kind,
    header: &[u8],
    payload: &[u8],
) -> Result<(), TransferError> {
    w.write_all(&encode(kind, header, payload)).await?;
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
    pub fn str(&mut self, s: &str) -> &mut Self {
        let b = &s.as_bytes()[..s.len().min(u16::MAX as usize)];
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
    pub fn u32(&mut self) -> Result<u32, TransferError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().unwrap_or([0; 4]),
        ))
    }
    pub fn u64(&mut self) -> Result<u64, TransferError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().unwrap_or([0; 8]),
        ))
    }
    pub fn f32(&mut self) -> Result<f32, TransferError> {
        Ok(f32::from_le_bytes(
            self.take(4)?.try_into().unwrap_or([0; 4]),
        ))
    }
    pub fn str(&mut self) -> Result<String, TransferError> {
        let n = u16::from_le_bytes(self.take(2)?.try_into().unwrap_or([0; 2])) as usize;
        String::from_utf8(self.take(n)?.to_vec())
            .map_err(|_| TransferError::Protocol("non-UTF-8 string in header".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn round_trip_and_limits() {
        let mut h = HeaderWriter::default();
        h.u32(7).u64(1 << 40).f32(-1.5).str("req-1");
        let bytes = encode(Kind::Blocks, &h.0, b"payload");
        let mut payload = Vec::new();
        let (kind, header) = read_into(&mut &bytes[..], &mut payload)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(kind, Kind::Blocks);
        assert_eq!(payload, b"payload");
        let mut r = HeaderReader(&header);
        assert_eq!(
            (
                r.u32().unwrap(),
                r.u64().unwrap(),
                r.f32().unwrap(),
                r.str().unwrap()
            ),
            (7, 1 << 40, -1.5, "req-1".to_string())
        );
        assert!(r.u32().is_err(), "reading past the header is an error");
        assert!(read(&mut &b""[..]).await.unwrap().is_none());
        let mut bad = bytes.clone();
        bad[0] = b'X';
        assert!(read(&mut &bad[..]).await.is_err());
        let mut huge = bytes.clone();
        huge[12..20].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(read(&mut &huge[..]).await.is_err());
        assert!(
            read(&mut &bytes[..bytes.len() - 1]).await.is_err(),
            "truncated payload"
        );
    }
}
