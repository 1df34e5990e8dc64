//! The contract every transport plugs in through: [`KvTransport`] opens one request's
//! [`KvSender`] from an [`Opening`] and owns whatever the transport keeps per decode worker
//! across requests (mapped pools, opened IPC handles, NCCL communicators), which it drops
//! when [`KvTransport::forget`] is told the worker failed. The list of transports a build
//! has is [`crate::registry`]'s; nothing here names one, except the wire facts every build
//! answers for each [`Transport`] value ([`transport_name`], [`kv_location`]).

use std::pin::Pin;

use tandem_kv::{KvLayout, KvLocation};
use tandem_proto::v1::{KvDestination, Transport};

use crate::error::TransferError;
use crate::lease::LeaseToken;
use crate::reach::Reach;
use crate::sender::KvSender;
use crate::verify::VerifiedDecode;

/// Everything a transport needs to open one request's transfer: checked by
/// [`crate::connect()`] (layout, lease size, capability, the decode worker's identity) first.
pub(crate) struct Opening<'a> {
    /// Our credentials, channels and shared-memory folder.
    pub reach: &'a Reach,
    pub decode: &'a VerifiedDecode,
    pub dest: KvDestination,
    pub lease: LeaseToken,
    pub layout: &'a KvLayout,
    pub request_id: &'a str,
    pub num_tokens: usize,
}

/// The future [`KvTransport::open`] returns.
pub(crate) type OpenFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Box<dyn KvSender>, TransferError>> + Send + 'a>>;

/// One transport, as a prefill worker's [`crate::Peers`] holds it for its whole life.
pub(crate) trait KvTransport: Send + Sync {
    /// The wire value the router chooses this transport by.
    fn kind(&self) -> Transport;

    /// Opens the sender of one request's transfer.
    fn open<'a>(&'a self, op: Opening<'a>) -> OpenFuture<'a>;

    /// Drops what this transport keeps for `decode`: the worker failed and may have
    /// restarted.
    fn forget(&self, decode: &VerifiedDecode) {
        let _ = decode;
    }
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
