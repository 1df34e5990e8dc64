//! The transports this build has, each named once ([`Registry::new`]): the one place a new
//! transport joins. A prefill worker's [`crate::Peers`] holds a registry for its whole life and
//! looks transports up by the wire value the router chose; it never names one itself.
//! A device transport this build leaves out is still listed, as a stub that refuses with the
//! feature it needs.

use tandem_proto::v1::Transport;

use crate::grpc::GrpcTransport;
use crate::shm::ShmTransport;
use crate::tcp::TcpTransport;
use crate::transport::{KvTransport, transport_name};
use crate::verify::VerifiedDecode;

/// Every transport of this build, one instance each.
pub(crate) struct Registry(Vec<Box<dyn KvTransport>>);

impl Registry {
    /// One entry per transport, gated by the feature that builds it.
    pub(crate) fn new() -> Self {
        let mut all: Vec<Box<dyn KvTransport>> = vec![
            Box::new(GrpcTransport),
            Box::new(TcpTransport),
            Box::new(ShmTransport::default()),
        ];
        #[cfg(feature = "cuda")]
        all.push(Box::new(crate::cuda_ipc::CudaIpcTransport::default()));
        #[cfg(not(feature = "cuda"))]
        all.push(Box::new(NotBuilt {
            kind: Transport::CudaIpc,
            feature: "cuda",
        }));
        #[cfg(feature = "nccl")]
        all.push(Box::new(crate::nccl::NcclTransport::default()));
        #[cfg(not(feature = "nccl"))]
        all.push(Box::new(NotBuilt {
            kind: Transport::Nccl,
            feature: "nccl",
        }));
        Self(all)
    }

    /// The transport the router chose by `kind`.
    pub(crate) fn get(&self, kind: Transport) -> Option<&dyn KvTransport> {
        self.0.iter().find(|t| t.kind() == kind).map(|t| &**t)
    }

    /// Tells every transport to drop what it keeps for `decode`.
    pub(crate) fn forget(&self, decode: &VerifiedDecode) {
        for t in &self.0 {
            t.forget(decode);
        }
    }
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|t| transport_name(t.kind())))
            .finish()
    }
}

/// A device transport this build does not have: refused once the decode worker is verified.
// `nccl` implies `cuda`: with it, every device transport is built.
#[cfg(not(feature = "nccl"))]
struct NotBuilt {
    kind: Transport,
    /// The feature that builds it.
    feature: &'static str,
}

#[cfg(not(feature = "nccl"))]
impl KvTransport for NotBuilt {
    fn kind(&self) -> Transport {
        self.kind
    }

    fn open<'a>(&'a self, _: crate::transport::Opening<'a>) -> crate::transport::OpenFuture<'a> {
        let refused = crate::error::TransferError::Connect(format!(
            "{} needs a worker built with the `{}` feature and running on a GPU",
            transport_name(self.kind),
            self.feature
        ));
        Box::pin(std::future::ready(Err(refused)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_chosen_transport_is_registered_once() {
        let registry = Registry::new();
        for kind in [
            Transport::Grpc,
            Transport::Tcp,
            Transport::Shm,
            Transport::CudaIpc,
            Transport::Nccl,
        ] {
            let n = registry.0.iter().filter(|t| t.kind() == kind).count();
            assert_eq!(n, 1, "{kind:?}");
        }
        assert!(registry.get(Transport::Unspecified).is_none());
    }
}
