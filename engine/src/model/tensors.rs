//! Tensors between a file and the panels: what `--weights` makes of each one (keep the file's
//! format, widen, or quantize), llama.cpp's Q/K row order undone, and projections fused.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};

use crate::backend::cpu::kernels::{Matrix, QuantKind, QuantPanels, WeightData, compute_mode};
use crate::config::WeightFormat;
use crate::error::{EngineError, Result};

/// A tensor's values as they will be stored.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum TensorData {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
    /// Row-major GGML blocks.
    Ggml(QuantKind, Vec<u8>),
}

/// One 2-D weight tensor, ready to pack.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Loaded {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub data: TensorData,
}

/// The dense type a file stores a tensor in (what `Native` keeps).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FileDtype {
    F32,
    F16,
    Bf16,
}

impl Loaded {
    /// From f32 values (the file held them as `file`), stored as `format` asks.
    pub fn from_values(
        name: &str,
        rows: usize,
        cols: usize,
        values: Vec<f32>,
        file: FileDtype,
        format: WeightFormat,
    ) -> Result<Self> {
        let dense = match format {
            WeightFormat::Native => file,
            WeightFormat::F32 => FileDtype::F32,
            WeightFormat::F16 => FileDtype::F16,
            WeightFormat::Bf16 => FileDtype::Bf16,
            WeightFormat::Quant(kind) => {
                return Self::quantize(name, rows, cols, values, kind);
            }
        };
        let data = match dense {
            FileDtype::F32 => TensorData::F32(values),
            FileDtype::F16 => TensorData::F16(values.iter().map(|&v| f16::from_f32(v)).collect()),
            FileDtype::Bf16 => {
                TensorData::Bf16(values.iter().map(|&v| bf16::from_f32(v)).collect())
            }
        };
        Ok(Self {
            name: name.to_string(),
            rows,
            cols,
            data,
        })
    }

    /// From a GGUF tensor of shape `rows × cols`.
    pub fn from_qtensor(
        name: &str,
        rows: usize,
        cols: usize,
        qt: &QTensor,
        format: WeightFormat,
    ) -> Result<Self> {
        let dtype = qt.dtype();
        let keep = match (format, QuantKind::from_ggml(dtype)) {
            (WeightFormat::Native, Some(kind)) => Some(kind),
            (WeightFormat::Quant(want), Some(kind)) if want == kind => Some(kind),
            _ => None,
        };
        if let Some(kind) = keep {
            let bytes = qt.data()?.into_owned();
            return Ok(Self {
                name: name.to_string(),
                rows,
                cols,
                data: TensorData::Ggml(kind, bytes),
            });
        }
        let file = match dtype {
            GgmlDType::F32 => FileDtype::F32,
            GgmlDType::F16 => FileDtype::F16,
            GgmlDType::BF16 => FileDtype::Bf16,
            other if format == WeightFormat::Native => {
                return Err(EngineError::Unsupported(format!(
                    "{name} is {other:?}: native weights run q8_0, q4_0, q4_1, q4_k, q5_k, q6_k, \
                     f16, bf16 and f32; load with --weights f32, bf16 or one of those formats \
                     to convert it"
                )));
            }
            _ => FileDtype::F32,
        };
        let values = qt
            .dequantize(&Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        Self::from_values(name, rows, cols, values, file, format)
    }

    /// From a safetensors tensor.
    pub fn from_tensor(name: &str, t: &Tensor, format: WeightFormat) -> Result<Self> {
        let (rows, cols) = match t.dims() {
            [r, c] => (*r, *c),
            other => {
                return Err(EngineError::Config(format!(
                    "{name}: shape {other:?}, expected a matrix"
                )));
            }
        };
        let file = match t.dtype() {
            DType::F16 => FileDtype::F16,
            DType::BF16 => FileDtype::Bf16,
            _ => FileDtype::F32,
        };
        let values = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Self::from_values(name, rows, cols, values, file, format)
    }

    fn quantize(
        name: &str,
        rows: usize,
        cols: usize,
        values: Vec<f32>,
        kind: QuantKind,
    ) -> Result<Self> {
        QuantPanels::ggml_size(kind, rows, cols)
            .map_err(|e| EngineError::Config(format!("{name}: {e}")))?;
        let t = Tensor::from_vec(values, (rows, cols), &Device::Cpu)?;
        let bytes = QTensor::quantize(&t, kind.to_ggml())?.data()?.into_owned();
        Ok(Self {
            name: name.to_string(),
            rows,
            cols,
            data: TensorData::Ggml(kind, bytes),
        })
    }

    /// Undoes llama.cpp's interleaved-RoPE row order for `heads` heads: `(heads, rows/heads/2,
    /// 2, ·)` → swap axes 1 and 2, the HF rotate-half order. Rows move whole, so this works on
    /// GGML blocks as on values.
    pub fn unpermute_rows(mut self, heads: usize) -> Self {
        let rows = self.rows;
        self.data = match self.data {
            TensorData::F32(v) => TensorData::F32(unpermute(&v, rows, heads)),
            TensorData::F16(v) => TensorData::F16(unpermute(&v, rows, heads)),
            TensorData::Bf16(v) => TensorData::Bf16(unpermute(&v, rows, heads)),
            TensorData::Ggml(k, v) => TensorData::Ggml(k, unpermute(&v, rows, heads)),
        };
        self
    }
}

/// Rows of `w` (`rows` equal rows of any width) in HF order; see [`Loaded::unpermute_rows`].
pub(crate) fn unpermute<T: Copy>(w: &[T], rows: usize, heads: usize) -> Vec<T> {
    let width = w.len() / rows.max(1);
    let per_head = rows / heads;
    let half = per_head / 2;
    let mut out = w.to_vec();
    for h in 0..heads {
        for i in 0..half {
            for pair in 0..2 {
                let src = h * per_head + i * 2 + pair;
                let dst = h * per_head + pair * half + i;
                out[dst * width..(dst + 1) * width]
                    .copy_from_slice(&w[src * width..(src + 1) * width]);
            }
        }
    }
    out
}

/// Stacks tensors of one width by rows into one matrix; neighbours in the same format share
/// one block of storage.
pub(crate) fn fuse(tensors: Vec<Loaded>) -> Result<Matrix> {
    let mut groups: Vec<Loaded> = Vec::new();
    for t in tensors {
        if let Some(last) = groups.last_mut()
            && last.cols == t.cols
        {
            let merged = append(&mut last.data, t.data);
            match merged {
                None => {
                    last.rows += t.rows;
                    last.name = format!("{}+{}", last.name, t.name);
                }
                Some(data) => groups.push(Loaded { data, ..t }),
            }
            continue;
        }
        groups.push(t);
    }
    let names: Vec<String> = groups.iter().map(|g| g.name.clone()).collect();
    let matrices = groups
        .into_iter()
        .map(into_matrix)
        .collect::<Result<Vec<_>>>()?;
    Matrix::stack(matrices).ok_or_else(|| {
        EngineError::Config(format!("{}: tensors of different widths", names.join(", ")))
    })
}

/// Packs one tensor.
pub(crate) fn into_matrix(t: Loaded) -> Result<Matrix> {
    let (rows, cols) = (t.rows, t.cols);
    let dense = |data: WeightData| {
        if data.len() != rows * cols {
            return Err(EngineError::Config(format!(
                "{}: {} values for a {rows}x{cols} matrix",
                t.name,
                data.len()
            )));
        }
        Ok(Matrix::new(rows, cols, data))
    };
    match t.data {
        TensorData::F32(v) => dense(WeightData::F32(v)),
        TensorData::F16(v) => dense(WeightData::F16(v)),
        TensorData::Bf16(v) => dense(WeightData::Bf16(v)),
        TensorData::Ggml(kind, bytes) => {
            // Packed for the process's compute mode (`exact` or `fast`: see `compute`).
            let arrangement = compute_mode().arrangement();
            QuantPanels::from_ggml_in(arrangement, kind, rows, cols, &bytes)
        }
        .map(Matrix::quantized)
        .map_err(|e| EngineError::Config(format!("{}: {e}", t.name))),
    }
}

/// Appends `b` to `a` if both are in one format; otherwise hands `b` back.
fn append(a: &mut TensorData, b: TensorData) -> Option<TensorData> {
    match (a, b) {
        (TensorData::F32(a), TensorData::F32(b)) => a.extend(b),
        (TensorData::F16(a), TensorData::F16(b)) => a.extend(b),
        (TensorData::Bf16(a), TensorData::Bf16(b)) => a.extend(b),
        (TensorData::Ggml(ka, a), TensorData::Ggml(kb, b)) if *ka == kb => a.extend(b),
        (_, b) => return Some(b),
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_moves_interleaved_pairs_to_halves() {
        // One head of 4 rows, 1 column: llama.cpp order [r0, r2, r1, r3] → HF [r0, r1, r2, r3].
        assert_eq!(
            unpermute(&[0.0, 2.0, 1.0, 3.0], 4, 1),
            vec![0.0, 1.0, 2.0, 3.0]
        );
        // Two heads keep their own rows; rows of several elements (or bytes) move whole.
        assert_eq!(
            unpermute(
                &[0u8, 0, 2, 2, 1, 1, 3, 3, 10, 10, 12, 12, 11, 11, 13, 13],
                8,
                2
            ),
            vec![0, 0, 1, 1, 2, 2, 3, 3, 10, 10, 11, 11, 12, 12, 13, 13]
        );
    }

    fn tensor(name: &str, rows: usize, format: WeightFormat) -> Loaded {
        let values = (0..rows * 256)
            .map(|i| ((i * 7919) % 200) as f32 / 100.0 - 1.0)
            .collect();
        Loaded::from_values(name, rows, 256, values, FileDtype::F32, format).unwrap()
    }

    #[test]
    fn fusing_merges_neighbours_of_one_format() {
        let q4 = WeightFormat::Quant(QuantKind::Q4K);
        let q6 = WeightFormat::Quant(QuantKind::Q6K);
        let m = fuse(vec![
            tensor("q", 32, q4),
            tensor("k", 16, q4),
            tensor("v", 16, q6),
        ])
        .unwrap();
        assert_eq!((m.rows, m.cols), (64, 256));
        assert_eq!(m.formats(), ["q4_k", "q6_k"]);
        let m = fuse(vec![
            tensor("gate", 8, WeightFormat::F32),
            tensor("up", 8, WeightFormat::F32),
        ])
        .unwrap();
        assert_eq!(m.formats(), ["f32"]);
        assert!(
            fuse(vec![
                tensor("a", 1, WeightFormat::F32),
                Loaded {
                    cols: 3,
                    rows: 1,
                    name: "b".into(),
                    data: TensorData::F32(vec![0.0; 3])
                }
            ])
            .is_err()
        );
    }

    #[test]
    fn formats_the_file_cannot_hold_are_refused_by_name() {
        let err = Loaded::from_values(
            "blk.0.attn_q.weight",
            4,
            64,
            vec![0.0; 256],
            FileDtype::F32,
            WeightFormat::Quant(QuantKind::Q4K),
        )
        .unwrap_err();
        assert!(err.to_string().contains("blk.0.attn_q.weight"), "{err}");
        assert!(err.to_string().contains("multiple of 256"), "{err}");
    }
}
