//! The decode side's KV RPCs (`PushKv`, `CommitKv`, `RenewLease`, `PullKv`) answered from a
//! [`LeaseTable`]: the decode worker's service delegates to [`kv_rpcs`], and
//! [`KvOnlyDecode`] serves them alone (with a signed `GetInfo`, so prefill workers verify it as
//! they verify a decode worker), to test and measure the transports without a model.
//! (`OpenNccl` belongs to the worker: it needs the device pool.)

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tandem_auth::InternalAuth;
use tandem_proto::v1::decode_service_server::DecodeService;
use tandem_proto::v1::{
    GenerateEvent, GenerateRequest, InfoRequest, KvAck, KvCommit, KvMessage, LoadReport,
    LoadRequest, OpenNcclRequest, OpenNcclResponse, PullKvRequest, RenewLeaseRequest,
    RenewLeaseResponse, Transport, WorkerInfo,
};
use tonic::{Request, Response, Status, Streaming};

use crate::{LeaseTable, receive_push_kv};

/// The KV RPCs over one lease table.
pub mod kv_rpcs {
    use super::*;

    pub async fn push_kv(
        table: &LeaseTable,
        req: Request<Streaming<KvMessage>>,
    ) -> Result<Response<KvAck>, Status> {
        let bytes = receive_push_kv(table, &mut req.into_inner()).await?;
        Ok(Response::new(KvAck {
            bytes_received: bytes,
        }))
    }

    /// How long a commit over a device transport waits for its last receive.
    pub const DEVICE_COMMIT_WAIT: Duration = Duration::from_secs(10);

    pub async fn commit_kv(
        table: &LeaseTable,
        req: Request<KvCommit>,
    ) -> Result<Response<KvAck>, Status> {
        let commit = req.into_inner();
        if commit.transport == Transport::Nccl as i32 {
            // The sender's stream finished its sends; our receiver may still be landing the
            // last layer. The commit checks completeness either way.
            table.wait_received(&commit.lease, DEVICE_COMMIT_WAIT).await;
        }
        let bytes = table.commit(&commit)?;
        Ok(Response::new(KvAck {
            bytes_received: bytes,
        }))
    }

    pub fn renew_lease(
        table: &LeaseTable,
        req: Request<RenewLeaseRequest>,
    ) -> Response<RenewLeaseResponse> {
        let open = table.renew(&req.into_inner().lease);
        Response::new(RenewLeaseResponse { open })
    }

    pub fn pull_kv(
        table: &Arc<LeaseTable>,
        req: Request<PullKvRequest>,
    ) -> Result<Response<crate::PullStream>, Status> {
        crate::pull::respond(table, req)
    }
}

/// A decode service that only receives KV into a lease table and describes itself (everything
/// else is `UNIMPLEMENTED`).
#[derive(Debug)]
pub struct KvOnlyDecode {
    pub table: Arc<LeaseTable>,
    /// What `GetInfo` answers (signed with `auth` for each caller's challenge).
    pub info: WorkerInfo,
    pub auth: InternalAuth,
}

type Events = Pin<Box<dyn futures::Stream<Item = Result<GenerateEvent, Status>> + Send>>;

#[tonic::async_trait]
impl DecodeService for KvOnlyDecode {
    type GenerateStream = Events;
    type PullKvStream = crate::PullStream;

    async fn get_info(&self, req: Request<InfoRequest>) -> Result<Response<WorkerInfo>, Status> {
        let mut info = self.info.clone();
        self.auth
            .sign_worker_info(&mut info, &req.into_inner().challenge);
        Ok(Response::new(info))
    }

    async fn get_load(&self, _: Request<LoadRequest>) -> Result<Response<LoadReport>, Status> {
        Err(Status::unimplemented("this service only receives KV"))
    }

    async fn generate(&self, _: Request<GenerateRequest>) -> Result<Response<Events>, Status> {
        Err(Status::unimplemented("this service only receives KV"))
    }

    async fn push_kv(&self, req: Request<Streaming<KvMessage>>) -> Result<Response<KvAck>, Status> {
        kv_rpcs::push_kv(&self.table, req).await
    }

    async fn commit_kv(&self, req: Request<KvCommit>) -> Result<Response<KvAck>, Status> {
        kv_rpcs::commit_kv(&self.table, req).await
    }

    async fn open_nccl(
        &self,
        _: Request<OpenNcclRequest>,
    ) -> Result<Response<OpenNcclResponse>, Status> {
        Err(Status::unimplemented("this service has no device pool"))
    }

    async fn renew_lease(
        &self,
        req: Request<RenewLeaseRequest>,
    ) -> Result<Response<RenewLeaseResponse>, Status> {
        Ok(kv_rpcs::renew_lease(&self.table, req))
    }

    async fn pull_kv(
        &self,
        req: Request<PullKvRequest>,
    ) -> Result<Response<Self::PullKvStream>, Status> {
        kv_rpcs::pull_kv(&self.table, req)
    }
}
