//! What a model file declares, checked against the file's own length and the
//! [`ModelLimits`] ceilings before anything is allocated for it:
//!
//! - a GGUF's tensor directory (read by `tandem_text::gguf::read_file`): each tensor's type
//!   known, its dimensions' product without overflow and a whole number of blocks, its bytes
//!   inside the file and apart from every other tensor's (so the tensors' memory is the
//!   file's length at most), handed to candle as its `Content` without candle re-reading the
//!   header;
//! - an HF folder's `config.json` (read up to the JSON ceiling) and each safetensors file's
//!   header (its 8-byte length inside the file and under the ceiling, its tensor count);
//! - the parameter count a config implies against the bytes of weights there are (no format
//!   tandem reads stores a weight in fewer than 2 bits), before a layer is loaded.
//!
//! Every refusal is an [`EngineError::Load`] naming the file and what is too large.

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use candle_core::quantized::gguf_file::{Content, TensorInfo, VersionedMagic};
use serde::de::{IgnoredAny, MapAccess, Visitor};
use tandem_text::gguf::GgufFile;
use tandem_text::{Ceiling, ModelLimits};

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};

/// Weights per byte of weight files at most: the densest GGML format candle reads (Q2_K) holds
/// 256 weights in 84 bytes, ~3 a byte.
const MAX_WEIGHTS_PER_BYTE: u128 = 4;

/// `e`, from reading the file at `path`, as an error naming the file: a config or text error
/// becomes [`EngineError::Load`]; what already names its file, or is not the file's fault
/// (an architecture tandem does not run), stays as it is.
pub(super) fn in_file(path: &Path, e: EngineError) -> EngineError {
    match e {
        EngineError::Config(_) | EngineError::Text(_) | EngineError::Candle(_) => {
            EngineError::load(path, e)
        }
        other => other,
    }
}

/// The GGML type of a GGUF type id, among those candle reads.
fn ggml_type(id: u32) -> Option<GgmlDType> {
    Some(match id {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// The tensor directory of `file` (read from `path`) checked against the file, as candle's
/// `Content` (without its metadata, which tandem reads itself).
pub(super) fn gguf_content(path: &Path, file: &GgufFile) -> Result<Content> {
    let fail = |reason: String| EngineError::load(path, reason);
    let mut extents: Vec<(u64, u64, &str)> = Vec::with_capacity(file.tensors.len());
    let mut tensor_infos = HashMap::with_capacity(file.tensors.len());
    for t in &file.tensors {
        let name = t.name.as_str();
        let dtype = ggml_type(t.type_id).ok_or_else(|| {
            fail(format!(
                "tensor `{name}` has GGML type {}, not one tandem reads",
                t.type_id
            ))
        })?;
        let elements = t
            .dims
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d))
            .ok_or_else(|| {
                fail(format!(
                    "tensor `{name}`: dimensions {:?} multiply past 64 bits",
                    t.dims
                ))
            })?;
        let block = dtype.block_size() as u64;
        if !elements.is_multiple_of(block) {
            return Err(fail(format!(
                "tensor `{name}`: {elements} elements are not whole {dtype:?} blocks of {block}"
            )));
        }
        let bytes = (elements / block)
            .checked_mul(dtype.type_size() as u64)
            .ok_or_else(|| fail(format!("tensor `{name}`: its size overflows 64 bits")))?;
        let start = file.data_offset.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(bytes));
        match (start, end) {
            (Some(start), Some(end)) if end <= file.file_len => {
                extents.push((start, end, name));
            }
            _ => {
                return Err(fail(format!(
                    "tensor `{name}`: {bytes} bytes at offset {} run past the end of the file \
                     ({} bytes)",
                    t.offset, file.file_len
                )));
            }
        }
        // Candle's shapes are outermost first; GGUF lists the innermost first.
        let shape: Vec<usize> = t.dims.iter().rev().map(|&d| d as usize).collect();
        tensor_infos.insert(
            t.name.clone(),
            TensorInfo {
                ggml_dtype: dtype,
                shape: shape.into(),
                offset: t.offset,
            },
        );
    }
    // Tensors sharing bytes would load the same bytes many times over: a small file could
    // then declare any amount of weights.
    extents.sort_unstable();
    if let Some(w) = extents.windows(2).find(|w| w[1].0 < w[0].1) {
        return Err(fail(format!(
            "tensors `{}` and `{}` overlap in the file",
            w[0].2, w[1].2
        )));
    }
    Ok(Content {
        magic: if file.metadata.version == 2 {
            VersionedMagic::GgufV2
        } else {
            VersionedMagic::GgufV3
        },
        metadata: HashMap::new(),
        tensor_infos,
        tensor_data_offset: file.data_offset,
    })
}

/// Bytes of tensor data in `file` (checked by [`gguf_content`] first).
pub(super) fn gguf_weight_bytes(file: &GgufFile) -> u64 {
    file.tensors
        .iter()
        .filter_map(|t| {
            let dtype = ggml_type(t.type_id)?;
            let elements = t.dims.iter().product::<u64>();
            Some(elements / dtype.block_size() as u64 * dtype.type_size() as u64)
        })
        .sum()
}

/// Refuses a config whose parameters could not be in `weight_bytes` bytes of weights (read
/// from `path`), before any layer is loaded.
pub(super) fn check_parameters(cfg: &ModelConfig, weight_bytes: u64, path: &Path) -> Result<()> {
    let (h, layers) = (cfg.hidden_size as u128, cfg.num_hidden_layers as u128);
    let q = cfg.num_attention_heads as u128 * cfg.head_dim as u128;
    let kv = cfg.num_key_value_heads as u128 * cfg.head_dim as u128;
    let per_layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size as u128;
    // The embeddings once (a tied LM head shares them); u128 holds any product of u64 sizes
    // this small a sum makes.
    let params = per_layer.saturating_mul(layers) + cfg.vocab_size as u128 * h;
    let room = weight_bytes as u128 * MAX_WEIGHTS_PER_BYTE;
    if params > room {
        return Err(EngineError::load(
            path,
            format!(
                "the config declares {params} weights ({} layers, hidden size {}, vocabulary {}), \
                 more than the {weight_bytes} bytes of weights there are can hold",
                cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
            ),
        ));
    }
    Ok(())
}

/// The `*.safetensors` files of an HF folder, in name order: the ones the check and the
/// loader both read.
pub(super) fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| EngineError::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    Ok(files)
}

/// The checks of an HF folder before its config is parsed for loading: `config.json` within
/// the JSON ceiling, and each `*.safetensors` file's header. Returns the config and the
/// weight files' total length.
pub(super) fn check_hf_folder(dir: &Path, limits: &ModelLimits) -> Result<(ModelConfig, u64)> {
    let config_path = dir.join("config.json");
    let json = read_bounded(&config_path, limits)?;
    let json =
        String::from_utf8(json).map_err(|_| EngineError::load(&config_path, "not UTF-8 text"))?;
    let cfg = ModelConfig::from_hf_json(&json).map_err(|e| in_file(&config_path, e))?;
    let files = safetensors_files(dir)?;
    let mut bytes = 0u64;
    let mut tensors = 0u64;
    for file in &files {
        let (len, count) = safetensors_header(file, limits)?;
        bytes = bytes.saturating_add(len);
        tensors = tensors.saturating_add(count);
        limits
            .check(Ceiling::Tensors, tensors, "tensors in the folder's files")
            .map_err(|e| EngineError::load(file, e))?;
    }
    check_parameters(&cfg, bytes, &config_path)?;
    Ok((cfg, bytes))
}

/// The file at `path`, read whole up to the JSON ceiling.
fn read_bounded(path: &Path, limits: &ModelLimits) -> Result<Vec<u8>> {
    let limit = limits.get(Ceiling::JsonBytes);
    let file = File::open(path).map_err(|e| EngineError::io(path, e))?;
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| EngineError::io(path, e))?;
    limits
        .check(Ceiling::JsonBytes, bytes.len() as u64, "bytes")
        .map_err(|e| EngineError::load(path, e))?;
    Ok(bytes)
}

/// A safetensors file's length and tensor count, from its header: the 8-byte length must fit
/// the file and the JSON ceiling, and the JSON is counted without keeping it (the safetensors
/// crate then checks every tensor's offsets and shape against the file).
fn safetensors_header(path: &Path, limits: &ModelLimits) -> Result<(u64, u64)> {
    let fail = |reason: String| EngineError::load(path, reason);
    let mut file = File::open(path).map_err(|e| EngineError::io(path, e))?;
    let len = file.metadata().map_err(|e| EngineError::io(path, e))?.len();
    let mut head = [0u8; 8];
    file.read_exact(&mut head)
        .map_err(|_| fail(format!("{len} bytes, too short for a safetensors header")))?;
    let header = u64::from_le_bytes(head);
    if header > len - 8 {
        return Err(fail(format!(
            "a safetensors header of {header} bytes runs past the end of the file ({len} bytes)"
        )));
    }
    limits
        .check(Ceiling::JsonBytes, header, "safetensors header bytes")
        .map_err(|e| EngineError::load(path, e))?;
    let mut json = vec![0u8; header as usize];
    file.read_exact(&mut json)
        .map_err(|e| EngineError::io(path, e))?;
    let mut de = serde_json::Deserializer::from_slice(&json);
    let count = serde::Deserializer::deserialize_map(&mut de, CountEntries)
        .and_then(|n| de.end().map(|()| n))
        .map_err(|e| fail(format!("safetensors header: {e}")))?;
    // `__metadata__` is not a tensor, but one entry more is no matter.
    limits
        .check(Ceiling::Tensors, count, "tensors in the file")
        .map_err(|e| EngineError::load(path, e))?;
    Ok((len, count))
}

/// Counts a JSON object's entries, keeping none.
struct CountEntries;

impl<'de> Visitor<'de> for CountEntries {
    type Value = u64;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<u64, A::Error> {
        let mut n = 0;
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {
            n += 1;
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests;
