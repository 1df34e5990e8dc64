//! `KvCache::write_tokens` (a prefill chunk's tokens spread over threads by block) leaves the
//! cache exactly as `write_token` one at a time does, in every dtype, and refuses a bad token
//! before writing any.

use tandem_kv::{KvCache, KvDtype, KvLayout, TokenKv};

fn layout(dtype: KvDtype) -> KvLayout {
    KvLayout {
        num_layers: 2,
        num_kv_heads: 3,
        head_dim: 8,
        block_size: 16,
        dtype,
        model_fingerprint: "write-tokens".into(),
    }
}

/// Runs the tasks on scoped threads, last first, so the order differs from a loop's.
fn threads(tasks: usize, task: &(dyn Fn(usize) + Sync)) {
    std::thread::scope(|s| {
        for i in (0..tasks).rev() {
            s.spawn(move || task(i));
        }
    });
}

fn rows(n: usize, width: usize, seed: f32) -> Vec<f32> {
    (0..n * width)
        .map(|i| (i as f32 * 0.37 + seed).sin() * 3.0)
        .collect()
}

#[test]
fn many_tokens_land_where_one_at_a_time_puts_them() {
    for dtype in [KvDtype::F32, KvDtype::Bf16, KvDtype::F16] {
        let l = layout(dtype);
        let width = l.num_kv_heads * l.head_dim;
        let budget = 10 * l.block_bytes();
        let mut serial = KvCache::with_budget(l.clone(), budget).unwrap();
        let mut parallel = KvCache::with_budget(l.clone(), budget).unwrap();
        // Two sequences: 40 tokens over blocks 5, 2, 7 (ending mid-block), 9 in block 3.
        let places: Vec<(u32, usize)> = (0..40)
            .map(|p| ([5, 2, 7][p / 16], p % 16))
            .chain((0..9).map(|p| (3, p + 4)))
            .collect();
        let (k, v) = (
            rows(places.len(), width, 0.5),
            rows(places.len(), width, 1.5),
        );
        let tokens: Vec<TokenKv> = places
            .iter()
            .enumerate()
            .map(|(i, &(block, slot))| TokenKv {
                block,
                slot,
                k: &k[i * width..(i + 1) * width],
                v: &v[i * width..(i + 1) * width],
            })
            .collect();
        for t in &tokens {
            serial.write_token(1, t.block, t.slot, t.k, t.v).unwrap();
        }
        parallel.write_tokens(1, &tokens, &threads).unwrap();
        for &(block, slot) in &places {
            assert_eq!(
                serial.read_token(1, block, slot).unwrap(),
                parallel.read_token(1, block, slot).unwrap(),
                "{dtype:?} block {block} slot {slot}"
            );
        }
        // The other layer is untouched.
        let (k0, v0) = parallel.read_token(0, 5, 0).unwrap();
        assert!(k0.iter().chain(&v0).all(|&x| x == 0.0));
    }
}

#[test]
fn a_bad_token_is_refused_before_anything_is_written() {
    let l = layout(KvDtype::F32);
    let width = l.num_kv_heads * l.head_dim;
    let mut cache = KvCache::with_budget(l.clone(), 4 * l.block_bytes()).unwrap();
    let row = vec![1.0f32; width];
    let good = TokenKv {
        block: 0,
        slot: 0,
        k: &row,
        v: &row,
    };
    for bad in [
        TokenKv { slot: 16, ..good },
        TokenKv { block: 4, ..good },
        TokenKv {
            k: &row[1..],
            ..good
        },
    ] {
        assert!(cache.write_tokens(0, &[good, bad], &threads).is_err());
        let (k, _) = cache.read_token(0, 0, 0).unwrap();
        assert!(
            k.iter().all(|&x| x == 0.0),
            "nothing written before the refusal"
        );
    }
    assert!(
        cache.write_tokens(2, &[good], &threads).is_err(),
        "layer past the end"
    );
}
