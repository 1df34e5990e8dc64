//! Attention of one layer on a device: the tensor-core kernel (`flash_attention` in
//! `kernels.cu`) where the device and the head size allow it, else the CUDA-core
//! `paged_attention`. This module owns the host side of the tensor-core path: cutting a batch
//! into query tiles, choosing how many context splits fill the device, and the partial-result
//! buffer the splits are merged from.

use super::launch::{Kernel, KernelArg, Launch, LaunchDevice, Scratch};
use crate::config::ModelConfig;
use crate::error::Result;

/// Query rows one CUDA block of `flash_attention` holds (`ATTN_ROWS` in kernels.cu).
const TILE_ROWS: usize = 64;
/// Keys per step of the kernel (`ATTN_KEYS`): context splits are multiples of it.
const TILE_KEYS: usize = 64;
/// Threads per block of both kernels (`ATTN_THREADS`).
const THREADS: u32 = 128;

/// Whether `flash_attention` runs this model here: head size 64 or 128 (its register tiles
/// are compiled for those), a GQA group that fits one tile, a device with bf16 `mma.sync`.
pub fn tensor_core_path<D: LaunchDevice>(dev: &D, cfg: &ModelConfig) -> bool {
    let group = cfg.num_attention_heads / cfg.num_key_value_heads.max(1);
    dev.bf16_mma()
        && matches!(cfg.head_dim, 64 | 128)
        && cfg
            .num_attention_heads
            .is_multiple_of(cfg.num_key_value_heads.max(1))
        && (1..=TILE_ROWS).contains(&group)
}

/// How one layer's attention is cut up: tiles of consecutive tokens of one sequence (`(first
/// row, tokens)` pairs, flattened), and the context split every tile is read in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub tiles: Vec<i32>,
    pub splits: usize,
    pub keys_per_split: usize,
}

impl Plan {
    /// `seqs`: each sequence's first row, token count and first position (its rows are
    /// consecutive, positions increasing by one). A launch aims at two blocks per
    /// multiprocessor: when tiles x KV heads fall short (decode of a few sequences), every
    /// tile's context is split, 64 keys at least per split.
    pub fn new(cfg: &ModelConfig, seqs: &[(usize, usize, usize)], multiprocessors: usize) -> Self {
        let group = cfg.num_attention_heads / cfg.num_key_value_heads;
        let per_tile = (TILE_ROWS / group).max(1);
        let mut tiles = Vec::new();
        let mut max_keys = 1;
        for &(first, count, start) in seqs {
            max_keys = max_keys.max(start + count);
            for offset in (0..count).step_by(per_tile) {
                tiles.push((first + offset) as i32);
                tiles.push(per_tile.min(count - offset) as i32);
            }
        }
        let blocks = tiles.len() / 2 * cfg.num_key_value_heads;
        let chunks = max_keys.div_ceil(TILE_KEYS);
        let target = 2 * multiprocessors.max(1);
        let wanted = if blocks >= target {
            1
        } else {
            target.div_ceil(blocks.max(1))
        };
        let keys_per_split = chunks.div_ceil(wanted.clamp(1, chunks)) * TILE_KEYS;
        Self {
            tiles,
            splits: max_keys.div_ceil(keys_per_split),
            keys_per_split,
        }
    }

    pub fn tile_count(&self) -> usize {
        self.tiles.len() / 2
    }
}

/// Device buffers of one step that the attention of every layer reads.
pub struct StepInputs<'a, D: LaunchDevice> {
    pub qkv: &'a D::F32,
    pub positions: &'a D::I32,
    pub token_seq: &'a D::I32,
    pub tables: &'a D::I32,
    pub max_blocks: i32,
    pub rows: usize,
    /// `Plan::tiles` on the device, when the tensor-core path runs.
    pub tiles: Option<(&'a D::I32, &'a Plan)>,
}

/// Queues one layer's attention: `out` (bf16, rows x q_width) from the roped Q in `qkv` and
/// the layer's keys and values in `cache` at `layer_offset`.
///
/// # Safety
/// The buffers must be sized for the batch that `inputs` describes (as `forward` does), with
/// every block table entry inside `cache`.
pub unsafe fn launch<D: LaunchDevice>(
    dev: &D,
    cfg: &ModelConfig,
    inputs: &StepInputs<'_, D>,
    cache: &D::Bf16,
    layer_offset: i64,
    out: &mut D::Bf16,
    partials: &mut Scratch<D>,
) -> Result<()> {
    use KernelArg::*;
    let row_width = (cfg.q_width() + 2 * cfg.kv_width()) as i32;
    let (q_heads, kv_heads, head_dim) = (
        cfg.num_attention_heads as i32,
        cfg.num_key_value_heads as i32,
        cfg.head_dim as i32,
    );
    let scale = 1.0 / (cfg.head_dim as f32).sqrt();
    let Some((tiles, plan)) = inputs.tiles else {
        // SAFETY: paged_attention's parameter list; one warp per (token, query head).
        return unsafe {
            dev.launch(
                Kernel::PagedAttention,
                Launch::covering(inputs.rows * cfg.num_attention_heads * 32, 128),
                &mut [
                    F32(inputs.qkv),
                    I32s(inputs.positions),
                    I32s(inputs.token_seq),
                    I32s(inputs.tables),
                    Int(inputs.max_blocks),
                    Bf16(cache),
                    Long(layer_offset),
                    Bf16Mut(out),
                    Int(inputs.rows as i32),
                    Int(row_width),
                    Int(q_heads),
                    Int(kv_heads),
                    Int(head_dim),
                    Float(scale),
                ],
            )
        };
    };
    let partial_len = if plan.splits > 1 {
        inputs.rows * cfg.num_attention_heads * plan.splits * (cfg.head_dim + 2)
    } else {
        1
    };
    let partial = partials.at_least(dev, partial_len)?;
    let blocks = plan.tile_count() * cfg.num_key_value_heads * plan.splits;
    // SAFETY: flash_attention's parameter list; `partial` holds rows x heads x splits x
    // (head_dim + 2) values when there is more than one split.
    unsafe {
        dev.launch(
            Kernel::FlashAttention,
            Launch {
                blocks: blocks as u32,
                threads: THREADS,
            },
            &mut [
                F32(inputs.qkv),
                I32s(inputs.positions),
                I32s(inputs.token_seq),
                I32s(inputs.tables),
                Int(inputs.max_blocks),
                Bf16(cache),
                Long(layer_offset),
                I32s(tiles),
                Int(plan.splits as i32),
                Int(plan.keys_per_split as i32),
                Bf16Mut(out),
                F32Mut(partial),
                Int(row_width),
                Int(q_heads),
                Int(kv_heads),
                Int(head_dim),
                Float(scale),
            ],
        )?;
    }
    if plan.splits > 1 {
        // SAFETY: attention_combine(float*, bf16*, int, int, int, int) over the same sizes.
        unsafe {
            dev.launch(
                Kernel::AttentionCombine,
                Launch::per_row(inputs.rows * cfg.num_attention_heads, THREADS),
                &mut [
                    F32(partial),
                    Bf16Mut(out),
                    Int(inputs.rows as i32),
                    Int(q_heads),
                    Int(head_dim),
                    Int(plan.splits as i32),
                ],
            )?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama() -> ModelConfig {
        ModelConfig::preset("llama-3.1-8b").expect("preset")
    }

    #[test]
    fn prompts_are_cut_into_tiles_of_one_sequence() {
        // 8B: 4 query heads per KV head, so 16 tokens a tile.
        let plan = Plan::new(&llama(), &[(0, 40, 0), (40, 1, 99)], 132);
        assert_eq!(plan.tiles, vec![0, 16, 16, 16, 32, 8, 40, 1]);
    }

    #[test]
    fn a_long_prompt_is_not_split_and_decode_of_one_sequence_is() {
        let cfg = llama();
        let prefill = Plan::new(&cfg, &[(0, 2048, 0)], 132);
        assert_eq!((prefill.splits, prefill.tile_count()), (1, 128));
        assert!(prefill.keys_per_split >= 2048);
        // One token at position 511: 512 keys, 8 KV heads; 264 blocks wanted, 8 chunks of 64.
        let decode = Plan::new(&cfg, &[(0, 1, 511)], 132);
        assert_eq!((decode.splits, decode.keys_per_split), (8, 64));
        // Position 4095: 4096 keys in 33 splits of 128 at most, all within the context.
        let long = Plan::new(&cfg, &[(0, 1, 4095)], 132);
        assert!(long.splits * long.keys_per_split >= 4096);
        assert!((long.splits - 1) * long.keys_per_split < 4096);
        assert_eq!(long.keys_per_split % TILE_KEYS, 0);
        // 128 sequences x 8 KV heads already fill the device.
        let seqs: Vec<_> = (0..128).map(|i| (i, 1, 511)).collect();
        assert_eq!(Plan::new(&cfg, &seqs, 132).splits, 1);
    }
}
