//! What the device transports (`cuda-ipc`, `nccl`) share on the sending side: a
//! [`DeviceSender`] that refuses host bytes, checks each layer against the engine's device
//! pool, counts the blocks each layer moved and commits over gRPC ([`InPlace`]). Each
//! transport supplies only how one layer's blocks move ([`DeviceCopy`]).

use tandem_kv::DeviceKv;

use crate::error::TransferError;
use crate::inplace::InPlace;
use crate::sender::{FirstToken, KvSender, SendFuture};
use crate::transport::transport_name;

/// How one device transport moves a layer's blocks.
pub(crate) trait DeviceCopy: Send {
    /// Moves `blocks` (`(logical block, physical block in src)` pairs) of `layer` from `src`
    /// into the lease `t` writes for; the layer and pool were checked. At the layout's last
    /// layer it waits for every copy: the decode worker may read the blocks once we commit.
    fn copy_layer(
        &mut self,
        t: &InPlace,
        layer: usize,
        src: &DeviceKv,
        blocks: &[(u32, u32)],
    ) -> Result<(), TransferError>;
}

/// A device transport's sender: the common checks and bookkeeping around its [`DeviceCopy`].
pub(crate) struct DeviceSender<C> {
    copy: C,
    transfer: InPlace,
}

impl<C: DeviceCopy> DeviceSender<C> {
    pub(crate) fn new(copy: C, transfer: InPlace) -> Self {
        Self { copy, transfer }
    }
}

impl<C: DeviceCopy> KvSender for DeviceSender<C> {
    fn send_layer(&mut self, _: usize, _: &[(u32, &[u8])]) -> Result<(), TransferError> {
        Err(TransferError::Protocol(format!(
            "{} copies from the device pool; this engine gave host bytes",
            transport_name(self.transfer.transport)
        )))
    }

    fn reads_device(&self) -> bool {
        true
    }

    fn send_device_layer(
        &mut self,
        layer: usize,
        src: &DeviceKv,
        blocks: &[(u32, u32)],
    ) -> Result<(), TransferError> {
        let t = &mut self.transfer;
        t.start();
        t.check_layer(layer)?;
        if src.num_layers() != t.layers {
            return Err(TransferError::LayoutMismatch(format!(
                "device pool of {} layers, layout of {}",
                src.num_layers(),
                t.layers
            )));
        }
        self.copy.copy_layer(t, layer, src, blocks)?;
        t.mark(
            layer,
            blocks.iter().map(|&(lb, _)| lb),
            src.block_layer_bytes(),
        );
        Ok(())
    }

    fn commit(self: Box<Self>, first: FirstToken) -> SendFuture {
        // No checksums (reading device memory back would cost more than the copy): the decode
        // worker checks the bytes counted (cuda-ipc) or the pieces its receiver landed (nccl).
        self.transfer.commit(first, Vec::new())
    }
}
