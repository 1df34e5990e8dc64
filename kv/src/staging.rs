//! Conversion of one block of one layer between the CPU cache's layout (f32; K transposed
//! per block, see [`KvLayout`]) and the GPU cache's (bf16; K and V both
//! `[kv_head][slot][head_dim]`). A GPU engine keeps the CPU cache as host staging: the
//! transports read and write that one, and the engine copies blocks to and from the device.

use half::bf16;

use super::KvLayout;
use crate::error::{KvError, Result};

fn check(layout: &KvLayout, host: usize, device: usize) -> Result<()> {
    let n = layout.block_layer_elems();
    if host != n || device != n {
        return Err(KvError::InvalidKv(format!(
            "a block layer holds {n} elements, got {host} (host) and {device} (device)"
        )));
    }
    Ok(())
}

/// Host block layer → device layout.
pub fn to_device_layout(layout: &KvLayout, host: &[f32], device: &mut [bf16]) -> Result<()> {
    check(layout, host.len(), device.len())?;
    let (bs, d, heads) = (layout.block_size, layout.head_dim, layout.num_kv_heads);
    let part = heads * bs * d;
    let (hk, hv) = host.split_at(part);
    let (dk, dv) = device.split_at_mut(part);
    for h in 0..heads {
        for i in 0..d {
            for slot in 0..bs {
                dk[(h * bs + slot) * d + i] = bf16::from_f32(hk[(h * d + i) * bs + slot]);
            }
        }
    }
    for (o, &v) in dv.iter_mut().zip(hv) {
        *o = bf16::from_f32(v);
    }
    Ok(())
}

/// Device block layer → host layout.
pub fn from_device_layout(layout: &KvLayout, device: &[bf16], host: &mut [f32]) -> Result<()> {
    check(layout, host.len(), device.len())?;
    let (bs, d, heads) = (layout.block_size, layout.head_dim, layout.num_kv_heads);
    let part = heads * bs * d;
    let (dk, dv) = device.split_at(part);
    let (hk, hv) = host.split_at_mut(part);
    for h in 0..heads {
        for i in 0..d {
            for slot in 0..bs {
                hk[(h * d + i) * bs + slot] = dk[(h * bs + slot) * d + i].to_f32();
            }
        }
    }
    for (o, &v) in hv.iter_mut().zip(dv) {
        *o = v.to_f32();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{KvCache, KvDtype};

    fn layout() -> KvLayout {
        KvLayout {
            dtype: KvDtype::F32,
            block_size: crate::BLOCK_SIZE,
            num_layers: 2,
            num_kv_heads: 3,
            head_dim: 8,
            model_fingerprint: "test".into(),
        }
    }

    /// A token written through the CPU cache lands where the GPU kernels read it
    /// (`[K|V][kv_head][slot][head_dim]`), and converting back restores the block exactly
    /// (values chosen to be exact in bf16).
    #[test]
    fn tokens_land_where_the_gpu_reads_them_and_round_trip() {
        let layout = layout();
        let mut cache = KvCache::with_budget(layout.clone(), 4 * layout.block_bytes()).unwrap();
        let (heads, d) = (layout.num_kv_heads, layout.head_dim);
        let slot = 5;
        let k: Vec<f32> = (0..heads * d).map(|i| i as f32).collect();
        let v: Vec<f32> = (0..heads * d).map(|i| -(i as f32) - 0.5).collect();
        cache.write_token(1, 2, slot, &k, &v).unwrap();
        let host = cache.block_layer(1, 2).unwrap().to_vec();
        let mut device = vec![bf16::ZERO; layout.block_layer_elems()];
        to_device_layout(&layout, &host, &mut device).unwrap();
        let part = heads * layout.block_size * d;
        for h in 0..heads {
            for i in 0..d {
                let at = (h * layout.block_size + slot) * d + i;
                assert_eq!(device[at].to_f32(), k[h * d + i]);
                assert_eq!(device[part + at].to_f32(), v[h * d + i]);
            }
        }
        let mut back = vec![f32::NAN; host.len()];
        from_device_layout(&layout, &device, &mut back).unwrap();
        assert_eq!(back, host);
    }

    #[test]
    fn wrong_sizes_are_errors() {
        let layout = layout();
        let mut device = vec![bf16::ZERO; 3];
        assert!(to_device_layout(&layout, &[0.0; 3], &mut device).is_err());
    }
}
