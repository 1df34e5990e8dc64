//! How a decode worker runs beyond the engine's sizing ([`DecodeConfig`]), and why it could
//! not start or serve ([`DecodeError`]).

use std::path::PathBuf;
use std::time::Duration;

use tandem_auth::InternalAuth;
use tandem_kv::shm::default_shm_dir;
use tandem_transfer::TcpLimits;

/// Why the worker could not start or serve.
pub type DecodeError = tandem_worker::WorkerError;

/// How this worker runs, beyond the engine's sizing.
#[derive(Debug, Clone)]
pub struct DecodeConfig {
    pub worker_id: String,
    /// Host peers reach the KV TCP port at ("" = the address they used for gRPC).
    pub advertise_host: String,
    /// Put the KV pool in a shared-memory file in this folder (the `shm` transport).
    pub shm_dir: Option<PathBuf>,
    /// Lease time without progress when the request names none.
    pub default_lease_ttl: Duration,
    /// How long blocks of a lease that ended early wait before reuse (a remote writer may
    /// still be finishing one block copy).
    pub quarantine: Duration,
    /// How long shutdown waits for running requests.
    pub drain_timeout: Duration,
    /// The longest a reservation may wait for KV without progress, whatever the caller asks.
    pub max_lease_ttl: Duration,
    /// The longest a reservation may stay open, renewals included.
    pub max_lease_lifetime: Duration,
    /// Share of the KV pool one caller (one address) may hold in reservations awaiting
    /// their KV, in (0, 1].
    pub caller_lease_share: f64,
    /// How long a disaggregated request waits for room to reserve its blocks (in the pool
    /// and in its caller's share) before it is refused as busy; zero refuses at once.
    pub reserve_wait: Duration,
    /// Bounds of the raw TCP KV listener.
    pub kv_tcp: TcpLimits,
    /// Pace decode passes to the streams' TPOT targets and leave the rest idle (see
    /// `tandem_worker::pacing`).
    pub lend_slack: bool,
    /// Prompt tokens of made-up work the cost model is fitted to at start-up (0: none; see
    /// `tandem_worker::pacing`).
    pub calibration_tokens: usize,
    /// Who may call: call tokens, the info proof, the KV hello.
    pub auth: InternalAuth,
}

impl Default for DecodeConfig {
    fn default() -> Self {
        Self {
            worker_id: "decode".into(),
            advertise_host: String::new(),
            shm_dir: default_shm_dir(),
            default_lease_ttl: Duration::from_secs(30),
            quarantine: Duration::from_millis(200),
            drain_timeout: Duration::from_secs(30),
            max_lease_ttl: Duration::from_secs(60),
            max_lease_lifetime: Duration::from_secs(600),
            caller_lease_share: 0.9,
            reserve_wait: Duration::from_secs(120),
            kv_tcp: TcpLimits::default(),
            lend_slack: false,
            calibration_tokens: 0,
            auth: InternalAuth::none(),
        }
    }
}
