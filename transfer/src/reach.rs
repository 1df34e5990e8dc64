//! How a prefill worker reaches decode workers: its deployment credentials, one lazily
//! connected gRPC channel per endpoint, and the one folder it may map decode workers' shared
//! files from. Every transport opens its connections through a [`Reach`]; it knows none of
//! them, nor who a decode worker is (that is [`crate::verify`]'s).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use tandem_auth::{AuthChannel, InternalAuth};
use tandem_proto::v1::decode_service_client::DecodeServiceClient;
use tonic::transport::Channel;

use crate::error::TransferError;

/// HTTP/2 flow-control windows for KV streams (client and server side).
pub const GRPC_STREAM_WINDOW: u32 = 8 << 20;
pub const GRPC_CONNECTION_WINDOW: u32 = 32 << 20;

/// A prefill worker's credentials, gRPC channels and shared-memory folder.
#[derive(Debug)]
pub(crate) struct Reach {
    auth: InternalAuth,
    /// Where decode workers' shared pools and owner-tag files may be (`shm`, `cuda-ipc`).
    shm_dir: Option<PathBuf>,
    channels: Mutex<HashMap<String, Channel>>,
}

impl Reach {
    pub(crate) fn new(auth: InternalAuth, shm_dir: Option<PathBuf>) -> Self {
        Self {
            auth,
            shm_dir,
            channels: Mutex::default(),
        }
    }

    pub(crate) fn auth(&self) -> &InternalAuth {
        &self.auth
    }

    /// The only folder a decode worker's shared files are opened from.
    pub(crate) fn shm_dir(&self) -> Result<&Path, TransferError> {
        self.shm_dir.as_deref().ok_or_else(|| {
            TransferError::Connect("this prefill worker has no shared-memory folder".into())
        })
    }

    /// A gRPC channel to `endpoint`, shared by every request to it (connects lazily and
    /// reconnects on its own).
    pub(crate) fn channel(&self, endpoint: &str) -> Result<Channel, TransferError> {
        let mut channels = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = channels.get(endpoint) {
            return Ok(c.clone());
        }
        let channel = self
            .auth
            .endpoint(endpoint)
            .map_err(|e| TransferError::Connect(format!("bad endpoint {endpoint}: {e}")))?
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(5))
            // KV moves in megabyte messages: HTTP/2's default 64 KiB windows would stall
            // every stream on flow-control round trips.
            .initial_stream_window_size(GRPC_STREAM_WINDOW)
            .initial_connection_window_size(GRPC_CONNECTION_WINDOW)
            .connect_lazy();
        channels.insert(endpoint.to_string(), channel.clone());
        Ok(channel)
    }

    /// A client of the decode worker at `endpoint` whose calls carry our tokens.
    pub(crate) fn decode_client(
        &self,
        endpoint: &str,
    ) -> Result<DecodeServiceClient<AuthChannel>, TransferError> {
        Ok(DecodeServiceClient::new(
            self.auth.channel(self.channel(endpoint)?),
        ))
    }

    /// Drops the channel to `endpoint` (its decode worker failed; it may have restarted).
    pub(crate) fn forget(&self, endpoint: &str) {
        self.channels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(endpoint);
    }
}
