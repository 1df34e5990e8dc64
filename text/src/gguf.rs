//! A reader for the metadata section of a GGUF file (format v2 and v3): the key/value pairs
//! that carry the architecture, the tokenizer and the chat template. Tensor data is not read
//! here; the engine loads tensors through candle.
//!
//! Every length read from the file is checked against the bytes that remain and against the
//! [`ModelLimits`] ceilings before anything is allocated for it, so a truncated or hostile
//! file gives an error naming the key (or tensor) at fault instead of a huge allocation or a
//! panic. [`read_file`] also reads the tensor directory, for the engine to check against the
//! file before candle reads a tensor.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use crate::TextError;
use crate::limits::{Ceiling, ModelLimits};

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

/// Reads the header and all metadata of a GGUF file, under the default [`ModelLimits`].
pub fn read_metadata(path: &Path) -> Result<GgufMetadata, TextError> {
    read_metadata_with(path, &ModelLimits::default())
}

/// Reads the header and all metadata of a GGUF file, under `limits`.
pub fn read_metadata_with(path: &Path, limits: &ModelLimits) -> Result<GgufMetadata, TextError> {
    let (mut reader, _) = open(path, limits)?;
    reader.metadata()
}

/// One entry of a GGUF file's tensor directory as the file states it: its dimensions
/// innermost first, its GGML type id, its data's offset from [`GgufFile::data_offset`]. The
/// engine checks types and extents against the file before it reads any data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    pub type_id: u32,
    pub offset: u64,
}

/// Everything before a GGUF file's tensor data: the metadata and the tensor directory.
#[derive(Debug, Clone)]
pub struct GgufFile {
    pub metadata: GgufMetadata,
    pub tensors: Vec<GgufTensorInfo>,
    /// Where the tensor data starts (the directory's end, aligned to `general.alignment`).
    pub data_offset: u64,
    /// The file's length in bytes.
    pub file_len: u64,
}

/// Dimensions a GGUF tensor may have (ggml's `GGML_MAX_DIMS`).
pub const MAX_TENSOR_DIMS: u32 = 4;

/// Reads the metadata and the tensor directory of a GGUF file, under `limits`.
pub fn read_file(path: &Path, limits: &ModelLimits) -> Result<GgufFile, TextError> {
    let (mut reader, file_len) = open(path, limits)?;
    let metadata = reader.metadata()?;
    let tensors = reader.tensor_directory(metadata.tensor_count)?;
    let alignment = match metadata.get("general.alignment") {
        None => 32,
        Some(v) => match v.as_u64() {
            Some(a) if a.is_power_of_two() && a <= 1 << 20 => a,
            _ => {
                return Err(TextError::Gguf(format!(
                    "`general.alignment` {v:?} is not a power of two up to 1 MiB"
                )));
            }
        },
    };
    let position = file_len - reader.remaining;
    let data_offset = position.next_multiple_of(alignment);
    Ok(GgufFile {
        metadata,
        tensors,
        data_offset,
        file_len,
    })
}

/// The file at `path` opened for reading under `limits`, and its length.
fn open(path: &Path, limits: &ModelLimits) -> Result<(Reader<BufReader<File>>, u64), TextError> {
    let io = |source| TextError::Io {
        path: path.to_owned(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    let reader = Reader::new(BufReader::with_capacity(1 << 20, file), len, limits);
    Ok((reader, len))
}

/// Reads the header and all metadata of a GGUF file held in memory (the fuzz targets').
pub fn parse_metadata(bytes: &[u8]) -> Result<GgufMetadata, TextError> {
    Reader::new(bytes, bytes.len() as u64, &ModelLimits::default()).metadata()
}

pub use crate::limits::MAX_METADATA_ITEMS;

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

/// The ceiling a well-known key's top-level size answers to besides the general ones: the
/// vocabulary's arrays hold one item per token, the merge list one per merge, and a chat
/// template is a string of bounded length.
fn key_ceiling(key: &str) -> Option<Ceiling> {
    match key {
        "tokenizer.ggml.tokens" | "tokenizer.ggml.scores" | "tokenizer.ggml.token_type" => {
            Some(Ceiling::Vocab)
        }
        "tokenizer.ggml.merges" => Some(Ceiling::Merges),
        k if k.starts_with("tokenizer.chat_template") => Some(Ceiling::TemplateBytes),
        _ => None,
    }
}

struct Reader<R> {
    inner: R,
    /// Bytes left in the file: the ceiling for every length read from it.
    remaining: u64,
    /// Array items still allowed (see [`MAX_METADATA_ITEMS`]).
    items_left: u64,
    limits: ModelLimits,
}

impl<R: Read> Reader<R> {
    fn new(inner: R, len: u64, limits: &ModelLimits) -> Self {
        Self {
            inner,
            remaining: len,
            items_left: limits.get(Ceiling::MetadataItems),
            limits: *limits,
        }
    }

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

    /// A count of `what` that promises `count * min_item_bytes` more bytes in the file.
    fn count(&mut self, what: &str, min_item_bytes: u64) -> Result<u64, TextError> {
        let count = self.u64()?;
        if count.saturating_mul(min_item_bytes) > self.remaining {
            return Err(TextError::Gguf(format!(
                "{what} {count} runs past the end of the file ({} bytes left)",
                self.remaining
            )));
        }
        Ok(count)
    }

    /// A string of `what`, at most `ceiling` bytes (besides the file's own bound).
    fn string(&mut self, what: &str, ceiling: Ceiling) -> Result<String, TextError> {
        let len = self.count(&format!("{what}: a string of length"), 1)?;
        self.limits
            .check(ceiling, len, format_args!("{what}: string bytes"))?;
        let mut buf = vec![0u8; len as usize];
        self.inner
            .read_exact(&mut buf)
            .map_err(|e| TextError::Gguf(format!("{what}: truncated string: {e}")))?;
        self.remaining = self.remaining.saturating_sub(len);
        // Some vocabularies hold invalid UTF-8 pieces; keep them visible rather than fail.
        Ok(String::from_utf8(buf).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into()))
    }

    /// A value of type `type_id` under metadata key `key`; `top` is the key's own ceiling
    /// ([`key_ceiling`]), which applies to the value itself, not to nested ones.
    fn value(
        &mut self,
        key: &str,
        type_id: u32,
        depth: u32,
        top: Option<Ceiling>,
    ) -> Result<GgufValue, TextError> {
        let what = || format!("metadata `{key}`");
        Ok(match type_id {
            0 => GgufValue::U8(self.bytes::<1>()?[0]),
            1 => GgufValue::I8(i8::from_le_bytes(self.bytes::<1>()?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.bytes::<2>()?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.bytes::<2>()?)),
            4 => GgufValue::U32(self.u32()?),
            5 => GgufValue::I32(i32::from_le_bytes(self.bytes::<4>()?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.bytes::<4>()?)),
            7 => GgufValue::Bool(self.bytes::<1>()?[0] != 0),
            8 => {
                let ceiling = match top {
                    Some(Ceiling::TemplateBytes) => Ceiling::TemplateBytes,
                    _ => Ceiling::StringBytes,
                };
                GgufValue::String(self.string(&what(), ceiling)?)
            }
            9 => {
                if depth > 4 {
                    return Err(TextError::Gguf(format!(
                        "{}: arrays nested more than 4 deep",
                        what()
                    )));
                }
                let item_type = self.u32()?;
                let len = self.count(
                    &format!("{}: an array of length", what()),
                    min_value_bytes(item_type),
                )?;
                if let Some(ceiling @ (Ceiling::Vocab | Ceiling::Merges)) = top {
                    self.limits
                        .check(ceiling, len, format_args!("{}: items", what()))?;
                }
                self.items_left =
                    self.items_left
                        .checked_sub(len)
                        .ok_or_else(|| TextError::OverLimit {
                            what: "GGUF metadata array items in all".into(),
                            value: len,
                            limit: self.limits.get(Ceiling::MetadataItems),
                            key: Ceiling::MetadataItems.key(),
                        })?;
                // `len` fits the file, but a capacity is allocated at once: grow past 1M.
                let mut items = Vec::with_capacity(len.min(1 << 20) as usize);
                for _ in 0..len {
                    items.push(self.value(key, item_type, depth + 1, None)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64()?),
            11 => GgufValue::I64(i64::from_le_bytes(self.bytes::<8>()?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.bytes::<8>()?)),
            other => {
                return Err(TextError::Gguf(format!(
                    "{}: unknown value type {other}",
                    what()
                )));
            }
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
        // Checked against the file by `tensor_directory`, which reads the entries.
        let tensor_count = self.u64()?;
        // A key/value pair is at least a key length, a type and one byte.
        let kv_count = self.count("metadata key count", 13)?;
        let mut entries = BTreeMap::new();
        for _ in 0..kv_count {
            let key = self.string("a metadata key", Ceiling::StringBytes)?;
            let type_id = self.u32()?;
            let value = self.value(&key, type_id, 0, key_ceiling(&key))?;
            entries.insert(key, value);
        }
        Ok(GgufMetadata {
            version,
            tensor_count,
            entries,
        })
    }

    /// The `count` entries of the tensor directory, which follows the metadata.
    fn tensor_directory(&mut self, count: u64) -> Result<Vec<GgufTensorInfo>, TextError> {
        // An entry is at least a name length, a dimension count, a type and an offset.
        const MIN_ENTRY_BYTES: u64 = 8 + 4 + 4 + 8;
        if count.saturating_mul(MIN_ENTRY_BYTES) > self.remaining {
            return Err(TextError::Gguf(format!(
                "tensor count {count} runs past the end of the file ({} bytes left)",
                self.remaining
            )));
        }
        self.limits.check(Ceiling::Tensors, count, "tensor count")?;
        let mut tensors = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let name = self.string("a tensor name", Ceiling::StringBytes)?;
            let n_dims = self.u32()?;
            if n_dims > MAX_TENSOR_DIMS {
                return Err(TextError::Gguf(format!(
                    "tensor `{name}` has {n_dims} dimensions, more than GGUF's {MAX_TENSOR_DIMS}"
                )));
            }
            let dims = (0..n_dims)
                .map(|_| self.u64())
                .collect::<Result<Vec<_>, _>>()?;
            let type_id = self.u32()?;
            let offset = self.u64()?;
            tensors.push(GgufTensorInfo {
                name,
                dims,
                type_id,
                offset,
            });
        }
        Ok(tensors)
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
        let mut many = Reader::new(
            std::io::Cursor::new(array_of(MAX_METADATA_ITEMS + 1, 0)),
            u64::MAX,
            &ModelLimits::default(),
        );
        let err = many.metadata().unwrap_err().to_string();
        assert!(err.contains("items in all"), "{err}");
        let not = dir.path().join("not.gguf");
        std::fs::write(&not, b"hello world").unwrap();
        assert!(!is_gguf(&not));
    }

    /// A metadata-only file (no tensors) with `entries`, then `tail` bytes appended.
    fn file_with(
        dir: &Path,
        name: &str,
        entries: &[(&str, GgufValue)],
        tensors: u64,
        tail: &[u8],
    ) -> std::path::PathBuf {
        let mut buf = Vec::new();
        write_metadata(&mut buf, entries, tensors).unwrap();
        buf.extend_from_slice(tail);
        let path = dir.join(name);
        std::fs::write(&path, buf).unwrap();
        path
    }

    #[test]
    fn keys_answer_to_their_own_ceilings_and_errors_name_them() {
        let dir = tempfile::tempdir().unwrap();
        let merges = (0..5)
            .map(|i| GgufValue::String(format!("a{i} b")))
            .collect();
        let path = file_with(
            dir.path(),
            "m.gguf",
            &[
                ("tokenizer.ggml.merges", GgufValue::Array(merges)),
                (
                    "tokenizer.chat_template",
                    GgufValue::String("x".repeat(100)),
                ),
            ],
            0,
            &[],
        );
        assert!(read_metadata(&path).is_ok());
        let few = ModelLimits::default().with(Ceiling::Merges, 4);
        let err = read_metadata_with(&path, &few).unwrap_err().to_string();
        assert!(
            err.contains("`tokenizer.ggml.merges`: items: 5 is above the ceiling of 4"),
            "{err}"
        );
        let short = ModelLimits::default().with(Ceiling::TemplateBytes, 99);
        let err = read_metadata_with(&path, &short).unwrap_err().to_string();
        assert!(
            err.contains("`tokenizer.chat_template`: string bytes: 100 is above"),
            "{err}"
        );
    }

    #[test]
    fn the_tensor_directory_is_read_and_checked_against_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let entry = |name: &str, dims: &[u64], type_id: u32, offset: u64| {
            let mut e = (name.len() as u64).to_le_bytes().to_vec();
            e.extend_from_slice(name.as_bytes());
            e.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            dims.iter()
                .for_each(|d| e.extend_from_slice(&d.to_le_bytes()));
            e.extend_from_slice(&type_id.to_le_bytes());
            e.extend_from_slice(&offset.to_le_bytes());
            e
        };
        let arch = [("general.architecture", GgufValue::String("llama".into()))];
        let mut two = entry("a", &[4, 2], 0, 0);
        two.extend(entry("b", &[8], 1, 32));
        let path = file_with(dir.path(), "ok.gguf", &arch, 2, &two);
        let file = read_file(&path, &ModelLimits::default()).unwrap();
        assert_eq!(file.tensors.len(), 2);
        assert_eq!(file.tensors[1].dims, [8]);
        assert_eq!((file.tensors[1].type_id, file.tensors[1].offset), (1, 32));
        assert_eq!(file.data_offset % 32, 0);
        assert!(file.data_offset >= file.file_len);
        let err = |tensors: u64, tail: &[u8], limits: &ModelLimits| {
            let path = file_with(dir.path(), "bad.gguf", &arch, tensors, tail);
            read_file(&path, limits).unwrap_err().to_string()
        };
        let e = err(1 << 40, &two, &ModelLimits::default());
        assert!(
            e.contains("tensor count 1099511627776 runs past the end"),
            "{e}"
        );
        let e = err(2, &two, &ModelLimits::default().with(Ceiling::Tensors, 1));
        assert!(
            e.contains("tensor count: 2 is above the ceiling of 1"),
            "{e}"
        );
        let e = err(
            1,
            &entry("five", &[1, 1, 1, 1, 1], 0, 0),
            &ModelLimits::default(),
        );
        assert!(e.contains("tensor `five` has 5 dimensions"), "{e}");
        let odd = [
            ("general.architecture", GgufValue::String("llama".into())),
            ("general.alignment", GgufValue::U32(0)),
        ];
        let path = file_with(dir.path(), "align.gguf", &odd, 0, &[]);
        let e = read_file(&path, &ModelLimits::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("`general.alignment`"), "{e}");
    }
}
