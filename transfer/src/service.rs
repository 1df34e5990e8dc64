//! The decode side's KV RPCs (`PushKv`, `CommitKv`, `RenewLease`) answered from a
//! [`LeaseTable`]: the decode worker's service delegates to [`kv_rpcs`], and
//! [`KvOnlyDecode`] serves them alone, to test and measure the transports without a model.

use std::pin::Pin;
use std::sync::Arc;

use tandem_proto::v1::decode_service_server::DecodeService;
use tandem_proto::v1::{
    GenerateEvent, GenerateRequest, InfoRequest, KvAck, KvCommit, KvMessage, LoadReport,
    LoadRequest, RenewLeaseRequest, RenewLeaseResponse, WorkerInfo,
};
use tonic::{Request, Response, Status, Streaming};

use crate::{LeaseTable, receive_push_kv};

/// The three KV RPCs over one lease table.
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

    pub fn commit_kv(
        table: &LeaseTable,
        req: Request<KvCommit>,
    ) -> Result<Response<KvAck>, Status> {
        let bytes = table.commit(&req.into_inner())?;
        Ok(Response::new(KvAck {
            bytes_received: bytes,
        }))
    }

    pub fn renew_lease(
        table: &LeaseTable,
        req: Request<RenewLeaseRequest>,
    ) -> Response<RenewLeaseResponse> {
        let open = table.renew(req.into_inner().lease_id);
        Response::new(RenewLeaseResponse { open })
    }
}

/// A decode service that only receives KV into a lease table (everything else is
/// `UNIMPLEMENTED`).
#[derive(Debug)]
pub struct KvOnlyDecode {
    pub table: Arc<LeaseTable>,
}

type Events = Pin<Box<dyn futures::Stream<Item = Result<GenerateEvent, Status>> + Send>>;

#[tonic::async_trait]
impl DecodeService for KvOnlyDecode {
    type GenerateStream = Events;

    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<WorkerInfo>, Status> {
        Err(Status::unimplemented("this service only receives KV"))
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
        kv_rpcs::commit_kv(&self.table, req)
    }

    async fn renew_lease(
        &self,
        req: Request<RenewLeaseRequest>,
    ) -> Result<Response<RenewLeaseResponse>, Status> {
        Ok(kv_rpcs::renew_lease(&self.table, req))
    }
}
