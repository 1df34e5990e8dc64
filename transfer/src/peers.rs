//! What a prefill worker keeps across requests to reach decode workers ([`Peers`]): how it
//! reaches them (credentials, gRPC channels, its shared-memory folder: [`crate::reach`]),
//! the decode workers it verified ([`VerifiedDecode`]), and the registry of transports,
//! each of which keeps its own per-worker state. This module names no transport.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use tandem_auth::{AuthChannel, InternalAuth};
use tandem_proto::v1::decode_service_client::DecodeServiceClient;
use tandem_proto::v1::{KvDestination, Transport};
use tonic::transport::Channel;

use crate::error::TransferError;
use crate::reach::Reach;
use crate::registry::Registry;
use crate::transport::KvTransport;
use crate::verify::{VerifiedDecode, verify};

/// Connections, verified decode workers and transports a prefill worker keeps across requests.
#[derive(Debug)]
pub struct Peers {
    reach: Reach,
    /// Verified decode workers by gRPC endpoint.
    decode: Mutex<HashMap<String, Arc<VerifiedDecode>>>,
    transports: Registry,
}

impl Peers {
    /// Peers reached with `auth`'s credentials; shared pools are mapped only from `shm_dir`.
    pub fn new(auth: InternalAuth, shm_dir: Option<PathBuf>) -> Self {
        Self {
            reach: Reach::new(auth, shm_dir),
            decode: Mutex::default(),
            transports: Registry::new(),
        }
    }

    pub fn auth(&self) -> &InternalAuth {
        self.reach.auth()
    }

    /// A gRPC channel to `endpoint`, shared by every request to it (connects lazily and
    /// reconnects on its own).
    pub fn channel(&self, endpoint: &str) -> Result<Channel, TransferError> {
        self.reach.channel(endpoint)
    }

    /// A client of the decode worker at `endpoint` whose calls carry our tokens.
    pub fn decode_client(
        &self,
        endpoint: &str,
    ) -> Result<DecodeServiceClient<AuthChannel>, TransferError> {
        self.reach.decode_client(endpoint)
    }

    pub(crate) fn reach(&self) -> &Reach {
        &self.reach
    }

    /// This build's transport for the wire value `kind`.
    pub(crate) fn transport(&self, kind: Transport) -> Option<&dyn KvTransport> {
        self.transports.get(kind)
    }

    /// The decode worker `dest` names, verified: it answered our challenge with a proof of
    /// the deployment secret (once per endpoint and worker instance).
    pub async fn verified_decode(
        &self,
        dest: &KvDestination,
    ) -> Result<Arc<VerifiedDecode>, TransferError> {
        let endpoint = dest.decode_endpoint.as_str();
        let cached = self
            .decode
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(endpoint)
            .cloned();
        if let Some(d) = cached
            && (dest.decode_instance.is_empty() || d.info.instance_id == dest.decode_instance)
        {
            return Ok(d);
        }
        let verified = Arc::new(verify(&self.reach, dest).await?);
        self.decode
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(endpoint.to_string(), verified.clone());
        Ok(verified)
    }

    /// Drops what is cached for a decode worker that failed (it may have restarted): its
    /// channel, its verification, and whatever each transport keeps for it.
    pub fn forget(&self, dest: &KvDestination) {
        self.reach.forget(&dest.decode_endpoint);
        let known = self
            .decode
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&dest.decode_endpoint);
        if let Some(known) = known {
            self.transports.forget(&known);
        }
    }
}
