//! How a prefill worker comes to trust a decode worker: `verify` asks for its `GetInfo` with a
//! fresh challenge and accepts only an answer that proves the deployment secret, from a decode
//! worker of our protocol (and of the lease's instance). The result, [`VerifiedDecode`], is the
//! only source of the addresses a transfer uses. Caching it is [`crate::Peers`]'s job; what
//! each transport keeps per decode worker is the transport's own.

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use tandem_proto::PROTOCOL_VERSION;
use tandem_proto::v1::{InfoRequest, KvDestination, Role, WorkerInfo};

use crate::error::TransferError;
use crate::reach::Reach;

/// How long a decode worker may take to answer the `GetInfo` that verifies it.
const VERIFY_TIMEOUT: Duration = Duration::from_secs(10);

/// A decode worker as a prefill worker knows it after an authenticated `GetInfo`: every
/// address a transfer uses comes from here, never from the caller of `Prefill`.
#[derive(Debug)]
pub struct VerifiedDecode {
    /// The gRPC endpoint it answered at.
    pub endpoint: String,
    /// Its answer, whose proof checked out.
    pub info: WorkerInfo,
    /// `host:port` of its KV TCP listener, if it has one: its advertised host, or the
    /// endpoint's.
    pub kv_tcp_addr: Option<String>,
    /// It refused to have its cached prefix read back (`PullKv`: its cache is on its GPU), so
    /// this worker no longer asks.
    pub refuses_pull: AtomicBool,
}

/// Asks the decode worker `dest` names for its info with a fresh challenge and checks the
/// answer: the proof of the deployment secret, the role and protocol, and (when the lease
/// names one) the worker instance.
pub(crate) async fn verify(
    reach: &Reach,
    dest: &KvDestination,
) -> Result<VerifiedDecode, TransferError> {
    let endpoint = dest.decode_endpoint.as_str();
    let challenge = tandem_auth::challenge().map_err(|e| TransferError::Protocol(e.to_string()))?;
    let mut client = reach.decode_client(endpoint)?;
    let request = InfoRequest {
        include_tokenizer: false,
        challenge: challenge.to_vec(),
    };
    let info = match tokio::time::timeout(VERIFY_TIMEOUT, client.get_info(request)).await {
        Err(_) => {
            return Err(TransferError::Connect(format!(
                "{endpoint} did not answer GetInfo within {} s",
                VERIFY_TIMEOUT.as_secs()
            )));
        }
        Ok(Err(status)) if status.code() == tonic::Code::Unauthenticated => {
            return Err(TransferError::Unauthenticated(format!(
                "{endpoint} refused this worker's credentials: {}",
                status.message()
            )));
        }
        Ok(Err(status)) => {
            return Err(TransferError::Connect(format!(
                "GetInfo at {endpoint}: {}",
                status.message()
            )));
        }
        Ok(Ok(info)) => info.into_inner(),
    };
    reach
        .auth()
        .verify_worker_info(&challenge, &info)
        .map_err(|_| {
            TransferError::Unauthenticated(format!(
                "{endpoint} did not prove that it is a decode worker of this deployment"
            ))
        })?;
    if info.role != Role::Decode as i32 || info.protocol_version != PROTOCOL_VERSION {
        return Err(TransferError::Unauthenticated(format!(
            "{endpoint} is not a decode worker speaking protocol {PROTOCOL_VERSION}"
        )));
    }
    if !dest.decode_instance.is_empty() && info.instance_id != dest.decode_instance {
        return Err(TransferError::Connect(format!(
            "the decode worker at {endpoint} restarted after the lease was granted"
        )));
    }
    let kv_tcp_addr = (info.kv_tcp_port != 0).then(|| {
        let host = if info.advertise_host.is_empty() {
            endpoint
                .parse::<tonic::codegen::http::Uri>()
                .ok()
                .and_then(|u| u.host().map(str::to_string))
                .unwrap_or_default()
        } else {
            info.advertise_host.clone()
        };
        format!("{host}:{}", info.kv_tcp_port)
    });
    Ok(VerifiedDecode {
        endpoint: endpoint.to_string(),
        info,
        kv_tcp_addr,
        refuses_pull: AtomicBool::default(),
    })
}
