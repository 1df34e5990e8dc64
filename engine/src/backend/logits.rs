//! [`Logits`]: what a forward pass gives the sampler, one row per position that asked, in one
//! buffer. A row per allocation cost a device engine at batch 128 (65 MB of logits a step
//! with a 128k vocabulary) fresh memory, page faults and a copy every step; one buffer that
//! the engine hands back after sampling ([`crate::backend::ComputeBackend::recycle_logits`])
//! is filled in place the next step.

use crate::error::{EngineError, Result};

/// Rows of `width` logits, in the order the batch asked for them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Logits {
    data: Vec<f32>,
    width: usize,
}

impl Logits {
    /// `data` as rows of `width` (its length a multiple of `width`).
    pub fn new(data: Vec<f32>, width: usize) -> Result<Self> {
        if width == 0 && !data.is_empty() || width > 0 && !data.len().is_multiple_of(width) {
            return Err(EngineError::Unsupported(format!(
                "{} logits are not rows of {width}",
                data.len()
            )));
        }
        Ok(Self { data, width })
    }

    /// Rows of one width each (as the CPU model returns them).
    pub fn from_rows(rows: Vec<Vec<f32>>) -> Result<Self> {
        let width = rows.first().map_or(0, Vec::len);
        if rows.iter().any(|r| r.len() != width) {
            return Err(EngineError::Unsupported(
                "logits rows of different widths".into(),
            ));
        }
        Self::new(rows.concat(), width)
    }

    /// How many rows.
    pub fn len(&self) -> usize {
        self.data.len().checked_div(self.width).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The vocabulary size (0 when empty).
    pub fn width(&self) -> usize {
        self.width
    }

    pub fn row(&self, i: usize) -> Option<&[f32]> {
        let w = self.width;
        self.data.get(i * w..(i + 1) * w).filter(|_| w > 0)
    }

    pub fn iter(&self) -> std::slice::ChunksExact<'_, f32> {
        self.data.chunks_exact(self.width.max(1))
    }

    /// Rows the sampler may change in place (temperature, penalties, masks).
    pub fn iter_mut(&mut self) -> std::slice::ChunksExactMut<'_, f32> {
        self.data.chunks_exact_mut(self.width.max(1))
    }

    /// The buffer, for the next pass to fill.
    pub fn into_buffer(self) -> Vec<f32> {
        self.data
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_in_one_buffer() {
        let l =
            Logits::from_rows(vec![vec![1.0, 2.0], vec![3.0, 4.0], vec![5.0, 6.0]]).expect("rows");
        assert_eq!((l.len(), l.width()), (3, 2));
        assert_eq!(l.row(1), Some(&[3.0, 4.0][..]));
        assert_eq!(l.row(3), None);
        let rows: Vec<&[f32]> = l.iter().collect();
        assert_eq!(rows, vec![&[1.0, 2.0][..], &[3.0, 4.0], &[5.0, 6.0]]);
        let mut l = l;
        l.iter_mut().for_each(|r| r[0] = 0.0);
        assert_eq!(l.into_buffer(), vec![0.0, 2.0, 0.0, 4.0, 0.0, 6.0]);
    }

    #[test]
    fn empty_and_ragged_logits() {
        let empty = Logits::from_rows(Vec::new()).expect("empty");
        assert!(empty.is_empty() && empty.iter().next().is_none());
        assert_eq!(empty.row(0), None);
        assert!(Logits::from_rows(vec![vec![1.0], vec![1.0, 2.0]]).is_err());
        assert!(Logits::new(vec![1.0; 5], 2).is_err());
        assert!(Logits::new(vec![1.0], 0).is_err());
    }
}
