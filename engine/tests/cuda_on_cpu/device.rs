//! [`EmulatedDevice`]: a `LaunchDevice` and `StagingDevice` whose buffers are bytes on the
//! host and whose every kernel launch is one run of the CUDA-on-CPU harness, so the engine's
//! device code (`device_forward`, `device_staging`) runs unchanged in the tests. GEMMs apply
//! cuBLAS's column-major definition to the exact arguments the CUDA device passes.

use half::bf16;
use tandem_engine::blas_layout::{linear_call, reference_gemm};
use tandem_engine::device_forward::{AttnShape, BatchBuffers, Launch, LaunchDevice};
use tandem_engine::device_staging::StagingDevice;
use tandem_engine::{EngineError, Result};

use super::{Arg, bf16_bytes, bf16s, f32_bytes, f32s, i32_bytes, try_launch};

/// Device buffers are plain bytes on the host; every launch is one harness run.
pub struct EmulatedDevice;

pub type Bytes = Vec<u8>;

impl EmulatedDevice {
    /// Runs `kernel`, then copies the buffers it may write (`writes`: their positions among
    /// the buffer arguments) back into `outs`, in order.
    fn run(
        &self,
        kernel: &str,
        at: Launch,
        args: &[Arg],
        outs: &mut [(&mut Bytes, usize)],
    ) -> Result<()> {
        let bufs = match try_launch(kernel, at.blocks, at.threads, args) {
            Some(Ok(bufs)) => bufs,
            Some(Err(e)) => return Err(EngineError::Unsupported(format!("{kernel}: {e}"))),
            None => return Err(EngineError::Unsupported("no C++ compiler".into())),
        };
        for (out, index) in outs.iter_mut() {
            **out = bufs[*index].clone();
        }
        Ok(())
    }
}

impl LaunchDevice for EmulatedDevice {
    type F32 = Bytes;
    type Bf16 = Bytes;
    type I32 = Bytes;
    type U32 = Bytes;

    fn upload_f32(&self, host: &[f32]) -> Result<Bytes> {
        Ok(f32_bytes(host))
    }
    fn upload_bf16(&self, host: &[bf16]) -> Result<Bytes> {
        Ok(bf16_bytes(host))
    }
    fn upload_i32(&self, host: &[i32]) -> Result<Bytes> {
        Ok(i32_bytes(host))
    }
    fn upload_u32(&self, host: &[u32]) -> Result<Bytes> {
        Ok(host.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
    fn zeros_f32(&self, n: usize) -> Result<Bytes> {
        Ok(vec![0; n * 4])
    }
    fn zeros_bf16(&self, n: usize) -> Result<Bytes> {
        Ok(vec![0; n * 2])
    }
    fn download_f32(&self, buf: &Bytes) -> Result<Vec<f32>> {
        Ok(f32s(buf))
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn embed_rows(
        &self,
        at: Launch,
        table: &Bytes,
        tokens: &Bytes,
        out: &mut Bytes,
        rows: i32,
        hidden: i32,
    ) -> Result<()> {
        let args = [
            Arg::Buf(table.clone()),
            Arg::Buf(tokens.clone()),
            Arg::Buf(out.clone()),
            Arg::I32(rows),
            Arg::I32(hidden),
        ];
        self.run("embed_rows", at, &args, &mut [(out, 2)])
    }

    fn rms_norm_bf16(
        &self,
        at: Launch,
        x: &Bytes,
        weight: &Bytes,
        out: &mut Bytes,
        rows: i32,
        hidden: i32,
        eps: f32,
    ) -> Result<()> {
        let args = [
            Arg::Buf(x.clone()),
            Arg::Buf(weight.clone()),
            Arg::Buf(out.clone()),
            Arg::I32(rows),
            Arg::I32(hidden),
            Arg::F32(eps),
        ];
        self.run("rms_norm_bf16", at, &args, &mut [(out, 2)])
    }

    fn rope_qk(
        &self,
        at: Launch,
        qkv: &mut Bytes,
        positions: &Bytes,
        inv_freq: &Bytes,
        rows: i32,
        row_width: i32,
        q_heads: i32,
        kv_heads: i32,
        head_dim: i32,
    ) -> Result<()> {
        let args = [
            Arg::Buf(qkv.clone()),
            Arg::Buf(positions.clone()),
            Arg::Buf(inv_freq.clone()),
            Arg::I32(rows),
            Arg::I32(row_width),
            Arg::I32(q_heads),
            Arg::I32(kv_heads),
            Arg::I32(head_dim),
        ];
        self.run("rope_qk", at, &args, &mut [(qkv, 0)])
    }

    fn kv_write(
        &self,
        at: Launch,
        qkv: &Bytes,
        batch: &BatchBuffers<Self>,
        cache: &mut Bytes,
        layer_offset: i64,
        s: &AttnShape,
    ) -> Result<()> {
        let args = [
            Arg::Buf(qkv.clone()),
            Arg::Buf(batch.positions.clone()),
            Arg::Buf(batch.token_seq.clone()),
            Arg::Buf(batch.tables.clone()),
            Arg::I32(batch.max_blocks),
            Arg::Buf(cache.clone()),
            Arg::I64(layer_offset),
            Arg::I32(s.rows),
            Arg::I32(s.row_width),
            Arg::I32(s.q_width),
            Arg::I32(s.kv_heads),
            Arg::I32(s.head_dim),
        ];
        self.run("kv_write", at, &args, &mut [(cache, 4)])
    }

    fn paged_attention(
        &self,
        at: Launch,
        qkv: &Bytes,
        batch: &BatchBuffers<Self>,
        cache: &Bytes,
        layer_offset: i64,
        out: &mut Bytes,
        s: &AttnShape,
    ) -> Result<()> {
        let args = [
            Arg::Buf(qkv.clone()),
            Arg::Buf(batch.positions.clone()),
            Arg::Buf(batch.token_seq.clone()),
            Arg::Buf(batch.tables.clone()),
            Arg::I32(batch.max_blocks),
            Arg::Buf(cache.clone()),
            Arg::I64(layer_offset),
            Arg::Buf(out.clone()),
            Arg::I32(s.rows),
            Arg::I32(s.row_width),
            Arg::I32(s.q_heads),
            Arg::I32(s.kv_heads),
            Arg::I32(s.head_dim),
            Arg::F32(s.scale),
        ];
        self.run("paged_attention", at, &args, &mut [(out, 5)])
    }

    fn silu_mul_bf16(
        &self,
        at: Launch,
        gate_up: &Bytes,
        out: &mut Bytes,
        rows: i32,
        f: i32,
    ) -> Result<()> {
        let args = [
            Arg::Buf(gate_up.clone()),
            Arg::Buf(out.clone()),
            Arg::I32(rows),
            Arg::I32(f),
        ];
        self.run("silu_mul_bf16", at, &args, &mut [(out, 1)])
    }

    fn add_in_place(&self, at: Launch, x: &mut Bytes, y: &Bytes, n: i64) -> Result<()> {
        let args = [Arg::Buf(x.clone()), Arg::Buf(y.clone()), Arg::I64(n)];
        self.run("add_in_place", at, &args, &mut [(x, 0)])
    }

    fn gather_rows(
        &self,
        at: Launch,
        x: &Bytes,
        rows_idx: &Bytes,
        out: &mut Bytes,
        count: i32,
        width: i32,
    ) -> Result<()> {
        let args = [
            Arg::Buf(x.clone()),
            Arg::Buf(rows_idx.clone()),
            Arg::Buf(out.clone()),
            Arg::I32(count),
            Arg::I32(width),
        ];
        self.run("gather_rows", at, &args, &mut [(out, 2)])
    }

    fn gemm(
        &self,
        x: &Bytes,
        w: &Bytes,
        out: &mut Bytes,
        rows: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        let widen = |b: &Bytes| -> Vec<f32> { bf16s(b).iter().map(|v| v.to_f32()).collect() };
        let (x, w) = (widen(x), widen(w));
        assert!(
            x.len() >= rows * k && w.len() >= n * k,
            "gemm inputs too small"
        );
        let mut c = f32s(out);
        assert!(c.len() >= rows * n, "gemm output too small");
        // A = W, B = x, C = out: the CUDA device's cublasGemmEx arguments.
        reference_gemm(&linear_call(rows, n, k), &w, &x, &mut c);
        *out = f32_bytes(&c);
        Ok(())
    }
}

impl StagingDevice for EmulatedDevice {
    fn gather_kv_blocks(
        &self,
        at: Launch,
        cache: &Bytes,
        layer_offset: i64,
        ids: &Bytes,
        count: i32,
        block_elems: i32,
        out: &mut Bytes,
    ) -> Result<()> {
        let args = [
            Arg::Buf(cache.clone()),
            Arg::I64(layer_offset),
            Arg::Buf(ids.clone()),
            Arg::I32(count),
            Arg::I32(block_elems),
            Arg::Buf(out.clone()),
        ];
        self.run("gather_kv_blocks", at, &args, &mut [(out, 2)])
    }

    fn scatter_kv_blocks(
        &self,
        at: Launch,
        staged: &Bytes,
        ids: &Bytes,
        count: i32,
        block_elems: i32,
        cache: &mut Bytes,
        layer_offset: i64,
    ) -> Result<()> {
        let args = [
            Arg::Buf(staged.clone()),
            Arg::Buf(ids.clone()),
            Arg::I32(count),
            Arg::I32(block_elems),
            Arg::Buf(cache.clone()),
            Arg::I64(layer_offset),
        ];
        self.run("scatter_kv_blocks", at, &args, &mut [(cache, 2)])
    }

    fn download_bf16_into(&self, buf: &Bytes, host: &mut [bf16]) -> Result<()> {
        let values = bf16s(buf);
        if values.len() != host.len() {
            return Err(EngineError::InvalidKv("download length mismatch".into()));
        }
        host.copy_from_slice(&values);
        Ok(())
    }

    fn upload_bf16_into(&self, host: &[bf16], buf: &mut Bytes) -> Result<()> {
        if host.len() * 2 != buf.len() {
            return Err(EngineError::InvalidKv("upload length mismatch".into()));
        }
        *buf = bf16_bytes(host);
        Ok(())
    }
}
