//! The decode worker's state, shared by its service (`service`) and the requests it runs
//! (`generate`).

use std::collections::HashMap;
use std::sync::Arc;

use tandem_kv::DeviceKv;
use tandem_transfer::LeaseTable;
use tandem_worker::WorkerCore;

use crate::config::DecodeConfig;

/// What the worker's requests share.
pub(crate) struct Inner {
    /// The engine, model, tokenizer, info and credentials, as every worker holds them.
    pub core: Arc<WorkerCore>,
    pub leases: Arc<LeaseTable>,
    pub config: DecodeConfig,
    /// The engine's device KV pool, on a GPU (nccl receives into it).
    pub device_kv: Option<DeviceKv>,
    /// Per calling address, the turn to reserve blocks: requests that must wait for room
    /// wait in arrival order, and only the first of them tries again (see `generate`). One
    /// entry per address that ever reserved: the internal plane's authenticated routers.
    pub reserve_turns: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// One nccl receiver per prefill worker; a new link replaces (aborts) the old one.
    #[cfg(feature = "nccl")]
    pub nccl_receivers: tandem_transfer::NcclReceivers,
}
