//! The transport factory: [`connect`] checks a destination (layout, lease size, the decode
//! worker's identity) and opens the sender of the transport the router chose; plus the
//! transport facts other crates need ([`kv_location`], [`transport_name`]).

use tandem_kv::{KvLayout, KvLocation};
use tandem_proto::v1::{KvDestination, Transport};

use crate::error::TransferError;
use crate::grpc::GrpcSender;
use crate::lease::LeaseToken;
use crate::peers::{Opening, Peers};
use crate::sender::KvSender;
use crate::shm::ShmSender;
use crate::tcp::TcpSender;

/// Opens a transfer to `dest` for a prompt of `num_tokens` tokens whose blocks from
/// `first_block` on are shipped (0 unless a sliding window leaves earlier ones unread; the
/// lease's blocks are numbered from there). Refuses a destination whose layout differs from
/// ours, or whose decode worker cannot prove it belongs to the deployment, before any byte
/// moves.
pub async fn connect(
    peers: &Peers,
    dest: &KvDestination,
    layout: &KvLayout,
    request_id: &str,
    num_tokens: usize,
    first_block: usize,
) -> Result<Box<dyn KvSender>, TransferError> {
    let ours = layout.hash();
    if dest.kv_layout_hash != ours {
        return Err(TransferError::LayoutMismatch(format!(
            "destination expects layout {}, this worker has {ours}",
            dest.kv_layout_hash
        )));
    }
    let needed = tandem_kv::blocks_for(num_tokens).saturating_sub(first_block);
    if needed == 0 || dest.block_ids.len() != needed {
        return Err(TransferError::Protocol(format!(
            "lease has {} blocks, the prompt needs {needed}",
            dest.block_ids.len()
        )));
    }
    let lease = LeaseToken::from_wire(&dest.lease).map_err(|_| {
        TransferError::Protocol("a KV destination needs its lease's 16-byte capability".into())
    })?;
    let transport = Transport::try_from(dest.transport).unwrap_or(Transport::Unspecified);
    if transport == Transport::Unspecified {
        return Err(TransferError::Protocol("no transport chosen".into()));
    }
    let decode = peers.verified_decode(dest).await?;
    if decode.info.kv_layout_hash != ours {
        return Err(TransferError::LayoutMismatch(format!(
            "the decode worker has layout {}, this worker {ours}",
            decode.info.kv_layout_hash
        )));
    }
    let op = Opening {
        peers,
        decode: &decode,
        dest: dest.clone(),
        lease,
        layout,
        request_id,
        num_tokens,
    };
    Ok(match transport {
        Transport::Grpc => Box::new(GrpcSender::start(op).await?),
        Transport::Tcp => Box::new(TcpSender::start(op).await?),
        Transport::Shm => Box::new(ShmSender::new(op)?),
        #[cfg(feature = "cuda")]
        Transport::CudaIpc => Box::new(crate::cuda_ipc::CudaIpcSender::new(op)?),
        #[cfg(feature = "nccl")]
        Transport::Nccl => Box::new(crate::nccl::NcclSender::start(op).await?),
        #[cfg(not(feature = "cuda"))]
        Transport::CudaIpc => return Err(not_built("cuda-ipc", "cuda")),
        #[cfg(not(feature = "nccl"))]
        Transport::Nccl => return Err(not_built("nccl", "nccl")),
        Transport::Unspecified => {
            return Err(TransferError::Protocol("no transport chosen".into()));
        }
    })
}

/// Where a transport leaves the KV on the decode side: the device transports write the GPU
/// pool directly, the others the host cache (which a GPU engine then uploads).
pub fn kv_location(t: Transport) -> KvLocation {
    match t {
        Transport::CudaIpc | Transport::Nccl => KvLocation::Device,
        Transport::Grpc | Transport::Tcp | Transport::Shm | Transport::Unspecified => {
            KvLocation::Host
        }
    }
}

/// The name used in metrics and flags.
pub fn transport_name(t: Transport) -> &'static str {
    match t {
        Transport::Grpc => "grpc",
        Transport::Tcp => "tcp",
        Transport::Shm => "shm",
        Transport::CudaIpc => "cuda-ipc",
        Transport::Nccl => "nccl",
        Transport::Unspecified => "none",
    }
}

/// The refusal of a device transport this build does not have.
// `nccl` implies `cuda`: with it, every device transport is built.
#[cfg(not(feature = "nccl"))]
fn not_built(transport: &str, feature: &str) -> TransferError {
    TransferError::Connect(format!(
        "{transport} needs a worker built with the `{feature}` feature and running on a GPU"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_transports_leave_the_kv_in_the_device_pool() {
        for t in [Transport::CudaIpc, Transport::Nccl] {
            assert_eq!(kv_location(t), KvLocation::Device, "{t:?}");
        }
        for t in [Transport::Grpc, Transport::Tcp, Transport::Shm] {
            assert_eq!(kv_location(t), KvLocation::Host, "{t:?}");
        }
    }
}
