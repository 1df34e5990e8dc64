//! A reader for the metadata section of a GGUF file (format v2 and v3): the key/value pairs
//! that carry the architecture, the tokenizer and the chat template. Tensor data is not read
//! here; the engine loads tensors through candle.
//!
//! Every length read from the file is checked against the bytes that remain, so a truncated
//! or hostile file gives an error instead of a huge allocation or a panic.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use crate::TextError;

const MAGIC: &[u8; 4] = b"GGUF";

/// One metadata value, as GGUF types it.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// The value as an unsigned integer, if it is an integer of any width and not negative.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is any number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// The metadata key/value pairs of one GGUF file.
#[derive(Debug, Clone, Default)]
pub struct GgufMetadata {
    pub version: u32,
    pub tensor_count: u64,
    pub entries: BTreeMap<String, GgufValue>,
}

impl GgufMetadata {
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.entries.get(key)
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(GgufValue::as_str)
    }

    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(GgufValue::as_u64)
    }

    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.get(key).and_then(GgufValue::as_f64)
    }

    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.get(key).and_then(GgufValue::as_bool)
    }

    /// A string array, such as `tokenizer.ggml.tokens`.
    pub fn get_strings(&self, key: &str) -> Result<Vec<&str>, TextError> {
        let arr = self
            .get(key)
            .and_then(GgufValue::as_array)
            .ok_or_else(|| TextError::Gguf(format!("missing array `{key}`")))?;
        arr.iter()
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| TextError::Gguf(format!("`{key}` holds a non-string")))
            })
            .collect()
    }
}

/// Whether the file at `path` starts with the GGUF magic bytes.
pub fn is_gguf(path: &Path) -> bool {
    let mut magic = [0u8; 4];
    File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .map(|()| &magic == MAGIC)
        .unwrap_or(false)
}

/// Reads the header and all metadata of a GGUF file.
pub fn read_metadata(path: &Path) -> Result<GgufMetadata, TextError> {
    let file = File::open(path).map_err(|source| TextError::Io {
        path: path.to_owned(),
        source,
    })?;
    let len = file
        .metadata()
        .map_err(|source| TextError::Io {
            path: path.to_owned(),
            source,
        })?
        .len();
    let mut reader = Reader {
        inner: BufReader::with_capacity(1 << 20, file),
        remaining: len,
        items_left: MAX_METADATA_ITEMS,
    };
    reader.metadata()
}

/// Reads the header and all metadata of a GGUF file held in memory (the fuzz targets').
pub fn parse_metadata(bytes: &[u8]) -> Result<GgufMetadata, TextError> {
    let mut reader = Reader {
        inner: bytes,
        remaining: bytes.len() as u64,
        items_left: MAX_METADATA_ITEMS,
    };
    reader.metadata()
}

/// Array items the metadata of one file may hold in all. Each becomes a value of some 32
/// bytes in memory however few bytes it takes in the file (one, for a u8), so the file's
/// length alone does not bound what its arrays cost: this does (about 1 GB at most). The
/// largest vocabularies shipped (~260k tokens, their scores and types, ~500k merges) hold
/// about 1.3M.
pub const MAX_METADATA_ITEMS: u64 = 32 << 20;

/// The fewest bytes a value of GGUF type `type_id` takes in the file.
fn min_value_bytes(type_id: u32) -> u64 {
    match type_id {
        2 | 3 => 2,
        4..=6 => 4,
        // A string's length, an array's type and length.
        8 => 8,
        9 => 12,
        10..=12 => 8,
        _ => 1,
    }
}

struct Reader<R> {
    inner: R,
    /// Bytes left in the file: the ceiling for every length read from it.
    remaining: u64,
    /// Array items still allowed (see [`MAX_METADATA_ITEMS`]).
    items_left: u64,
}

impl<R: Read> Reader<R> {
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], TextError> {
        let mut buf = [0u8; N];
        self.inner
            .read_exact(&mut buf)
            .map_err(|e| TextError::Gguf(format!("truncated file: {e}")))?;
        self.remaining = self.remaining.saturating_sub(N as u64);
        Ok(buf)
    }

    fn u32(&mut self) -> Result<u32, TextError> {
        self.bytes::<4>().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, TextError> {
        self.bytes::<8>().map(u64::from_le_bytes)
    }

    /// A count that promises `count * min_item_bytes` more bytes in the file.
    fn checked_len(&mut self, min_item_bytes: u64) -> Result<usize, TextError> {
        let count = self.u64()?;
        if count.saturating_mul(min_item_bytes) > self.remaining {
            return Err(TextError::Gguf(format!(
                "length {count} runs past the end of the file"
            )));
        }
        usize::try_from(count).map_err(|_| TextError::Gguf(format!("length {count} too large")))
    }

    fn string(&mut self) -> Result<String, TextError> {
        let len = self.checked_len(1)?;
        let mut buf = vec![0u8; len];
        self.inner
            .read_exact(&mut buf)
            .map_err(|e| TextError::Gguf(format!("truncated string: {e}")))?;
        self.remaining = self.remaining.saturating_sub(len as u64);
        // Some vocabularies hold invalid UTF-8 pieces; keep them visible rather than fail.
        Ok(String::from_utf8(buf).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into()))
    }

    fn value(&mut self, type_id: u32, depth: u32) -> Result<GgufValue, TextError> {
        Ok(match type_id {
            0 => GgufValue::U8(self.bytes::<1>()?[0]),
            1 => GgufValue::I8(i8::from_le_bytes(self.bytes::<1>()?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.bytes::<2>()?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.bytes::<2>()?)),
            4 => GgufValue::U32(self.u32()?),
            5 => GgufValue::I32(i32::from_le_bytes(self.bytes::<4>()?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.bytes::<4>()?)),
            7 => GgufValue::Bool(self.bytes::<1>()?[0] != 0),
            8 => GgufValue::String(self.string()?),
            9 => {
                if depth > 4 {
                    return Err(TextError::Gguf("arrays nested too deeply".into()));
                }
                let item_type = self.u32()?;
                let len = self.checked_len(min_value_bytes(item_type))?;
                self.items_left = self.items_left.checked_sub(len as u64).ok_or_else(|| {
                    TextError::Gguf(format!(
                        "metadata arrays hold more than {MAX_METADATA_ITEMS} items in all"
                    ))
                })?;
                let mut items = Vec::with_capacity(len.min(1 << 20));
                for _ in 0..len {
                    items.push(self.value(item_type, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64()?),
            11 => GgufValue::I64(i64::from_le_bytes(self.bytes::<8>()?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.bytes::<8>()?)),
            other => return Err(TextError::Gguf(format!("unknown value type {other}"))),
        })
    }

    fn metadata(&mut self) -> Result<GgufMetadata, TextError> {
        if &self.bytes::<4>()? != MAGIC {
            return Err(TextError::Gguf("missing GGUF magic".into()));
        }
        let version = self.u32()?;
        if !(2..=3).contains(&version) {
            return Err(TextError::Gguf(format!(
                "unsupported GGUF version {version}"
            )));
        }
        let tensor_count = self.u64()?;
        // A key/value pair is at least a key length, a type and one byte.
        let kv_count = self.checked_len(13)?;
        let mut entries = BTreeMap::new();
        for _ in 0..kv_count {
            let key = self.string()?;
            let type_id = self.u32()?;
            let value = self.value(type_id, 0)?;
            entries.insert(key, value);
        }
        Ok(GgufMetadata {
            version,
            tensor_count,
            entries,
        })
    }
}

/// Writes a metadata-only GGUF file: used by tests here and in the engine to build
/// small fixtures without a download.
pub fn write_metadata(
    out: &mut impl std::io::Write,
    entries: &[(&str, GgufValue)],
    tensor_count: u64,
) -> std::io::Result<()> {
    fn string(out: &mut impl std::io::Write, s: &str) -> std::io::Result<()> {
        out.write_all(&(s.len() as u64).to_le_bytes())?;
        out.write_all(s.as_bytes())
    }
    fn type_id(v: &GgufValue) -> u32 {
        match v {
            GgufValue::U8(_) => 0,
            GgufValue::I8(_) => 1,
            GgufValue::U16(_) => 2,
            GgufValue::I16(_) => 3,
            GgufValue::U32(_) => 4,
            GgufValue::I32(_) => 5,
            GgufValue::F32(_) => 6,
            GgufValue::Bool(_) => 7,
            GgufValue::String(_) => 8,
            GgufValue::Array(_) => 9,
            GgufValue::U64(_) => 10,
            GgufValue::I64(_) => 11,
            GgufValue::F64(_) => 12,
        }
    }
    fn value(out: &mut impl std::io::Write, v: &GgufValue) -> std::io::Result<()> {
        match v {
            GgufValue::U8(x) => out.write_all(&[*x]),
            GgufValue::I8(x) => out.write_all(&x.to_le_bytes()),
            GgufValue::U16(x) => out.write_all(&x.to_le_bytes()),
            GgufValue::I16(x) => out.write_all(&x.to_le_bytes()),
            GgufValue::U32(x) => out.write_all(&x.to_le_bytes()),
            GgufValue::I32(x) => out.write_all(&x.to_le_bytes()),
            GgufValue::U64(x) => out.write_all(&x.to_le_bytes()),
            GgufValue::I64(x) => out.write_all(&x.to_le_bytes()),
            GgufValue::F32(x) => out.write_all(&x.to_le_bytes()),
            GgufValue::F64(x) => out.write_all(&x.to_le_bytes()),
            GgufValue::Bool(x) => out.write_all(&[u8::from(*x)]),
            GgufValue::String(s) => string(out, s),
            GgufValue::Array(items) => {
                let item_type = items.first().map_or(8, type_id);
                out.write_all(&item_type.to_le_bytes())?;
                out.write_all(&(items.len() as u64).to_le_bytes())?;
                items.iter().try_for_each(|item| value(out, item))
            }
        }
    }
    out.write_all(MAGIC)?;
    out.write_all(&3u32.to_le_bytes())?;
    out.write_all(&tensor_count.to_le_bytes())?;
    out.write_all(&(entries.len() as u64).to_le_bytes())?;
    for (key, v) in entries {
        string(out, key)?;
        out.write_all(&type_id(v).to_le_bytes())?;
        value(out, v)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> Vec<u8> {
        let mut buf = Vec::new();
        write_metadata(
            &mut buf,
            &[
                ("general.architecture", GgufValue::String("llama".into())),
                ("llama.block_count", GgufValue::U32(30)),
                ("llama.rope.freq_base", GgufValue::F32(100000.0)),
                (
                    "tokenizer.ggml.tokens",
                    GgufValue::Array(vec![
                        GgufValue::String("a".into()),
                        GgufValue::String("b".into()),
                    ]),
                ),
                ("tokenizer.ggml.add_bos_token", GgufValue::Bool(false)),
            ],
            0,
        )
        .unwrap();
        buf
    }

    #[test]
    fn round_trips_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        std::fs::write(&path, fixture()).unwrap();
        assert!(is_gguf(&path));
        let meta = read_metadata(&path).unwrap();
        assert_eq!(meta.version, 3);
        assert_eq!(meta.get_str("general.architecture"), Some("llama"));
        assert_eq!(meta.get_u64("llama.block_count"), Some(30));
        assert_eq!(meta.get_f64("llama.rope.freq_base"), Some(100000.0));
        assert_eq!(
            meta.get_strings("tokenizer.ggml.tokens").unwrap(),
            ["a", "b"]
        );
        assert_eq!(meta.get_bool("tokenizer.ggml.add_bos_token"), Some(false));
    }

    #[test]
    fn truncated_and_hostile_files_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let full = fixture();
        for cut in [0, 3, 10, 30, full.len() - 1] {
            let path = dir.path().join(format!("cut{cut}.gguf"));
            std::fs::write(&path, &full[..cut]).unwrap();
            assert!(read_metadata(&path).is_err(), "cut at {cut} must fail");
        }
        // A key count far beyond the file size must not allocate or loop.
        let mut hostile = full[..16].to_vec();
        hostile.extend_from_slice(&u64::MAX.to_le_bytes());
        let path = dir.path().join("hostile.gguf");
        std::fs::write(&path, hostile).unwrap();
        assert!(matches!(read_metadata(&path), Err(TextError::Gguf(_))));
        // An array of u32 whose count fits the file's bytes one per item but not four.
        let array_of = |count: u64, item_type: u32| {
            let mut f = full[..16].to_vec();
            f.extend_from_slice(&1u64.to_le_bytes()); // one key/value pair
            f.extend_from_slice(&1u64.to_le_bytes());
            f.push(b'k');
            f.extend_from_slice(&9u32.to_le_bytes()); // an array
            f.extend_from_slice(&item_type.to_le_bytes());
            f.extend_from_slice(&count.to_le_bytes());
            f
        };
        let mut short = array_of(1000, 4);
        short.extend(std::iter::repeat_n(0u8, 1000));
        let path = dir.path().join("short.gguf");
        std::fs::write(&path, short).unwrap();
        let err = read_metadata(&path).unwrap_err().to_string();
        assert!(err.contains("past the end"), "{err}");
        // Past the item ceiling: refused before anything is read.
        let mut many = Reader {
            inner: std::io::Cursor::new(array_of(MAX_METADATA_ITEMS + 1, 0)),
            remaining: u64::MAX,
            items_left: MAX_METADATA_ITEMS,
        };
        let err = many.metadata().unwrap_err().to_string();
        assert!(err.contains("items in all"), "{err}");
        let not = dir.path().join("not.gguf");
        std::fs::write(&not, b"hello world").unwrap();
        assert!(!is_gguf(&not));
    }
}
