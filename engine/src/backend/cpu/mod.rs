//! The CPU backend: the batch-invariant kernels ([`kernels`]) running the model over the host
//! KV cache itself ([`Model::forward`], in `forward.rs`). Every output row is computed the
//! same way whatever the batch, so disaggregated greedy output equals aggregated output.

mod forward;
pub mod kernels;

use std::sync::Arc;

use tandem_kv::{KvCache, KvLocation};

use super::{Batch, ComputeBackend, Logits, OnLayer};
use crate::error::{EngineError, Result};
use crate::model::Model;

/// The model's forward pass on this machine's cores.
#[derive(Debug)]
pub struct CpuBackend {
    model: Arc<Model>,
}

impl CpuBackend {
    pub fn new(model: Arc<Model>) -> Self {
        Self { model }
    }
}

impl ComputeBackend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn host_cache_is_kv(&self) -> bool {
        true
    }

    fn frees_host_during_forward(&self) -> bool {
        // The forward pass runs on every core the worker was given.
        false
    }

    fn forward(
        &mut self,
        host: &mut KvCache,
        batch: &Batch<'_>,
        on_layer: &mut OnLayer<'_>,
    ) -> Result<Logits> {
        let rows = self.model.forward(host, batch.seqs, &mut |layer, cache| {
            on_layer(layer, cache, batch.chunks)
        })?;
        Logits::from_rows(rows)
    }

    fn copy_block(&mut self, host: &mut KvCache, src: u32, dst: u32) -> Result<()> {
        Ok(host.copy_block(src, dst)?)
    }

    fn import_blocks(
        &mut self,
        _host: &mut KvCache,
        _blocks: &[u32],
        location: KvLocation,
    ) -> Result<()> {
        match location {
            KvLocation::Host => Ok(()),
            KvLocation::Device => Err(EngineError::InvalidKv(
                "the KV arrived in device memory but this engine runs on the CPU".into(),
            )),
        }
    }
}
