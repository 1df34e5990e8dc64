//! The workers as the router sees them: one gRPC channel per prefill and decode worker, what
//! each said about itself (`GetInfo`), its last load (`GetLoad`), and whether it is healthy;
//! and the pool that holds them (`pool`).
//!
//! One poll task per worker asks for info until it gets it (so the router can start before
//! its workers), then for load every `--health-interval-ms`. A failed poll marks the worker
//! unhealthy, and so does a request that sees it die; the next successful poll brings it back
//! (re-reading its info, since a restarted worker may have a new layout or shm file). Workers
//! speaking another protocol version, or in the wrong role, are refused for good; prefill and
//! decode workers whose KV layouts differ are never paired (`pair_incompatibility`).
//!
//! Workers found through DNS (`discovery`) come and go: one that leaves the pool is
//! `retire`d — its poll task stops, its metric series end (they are rendered from the pool
//! at each scrape), routing stops seeing it —
//! while requests already running on it keep their `Arc<Worker>` and end as they would.

mod elastic;
mod pool;

pub use pool::{WorkerPool, WorkerSource};

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tandem_auth::{AuthChannel, InternalAuth};
use tandem_proto::v1::decode_service_client::DecodeServiceClient;
use tandem_proto::v1::prefill_service_client::PrefillServiceClient;
use tandem_proto::v1::{LoadReport, Role, Transport, WorkerInfo};

use crate::metrics as m;
use crate::routing::{
    CostView, DecodeCandidate, PrefillCandidate, PrefixIndex, PromptNames, SinceReport,
};

/// Largest gRPC message the router accepts (a `tokenizer.json` can be several MiB).
const MAX_MESSAGE_BYTES: usize = 64 << 20;
/// Deadline of one `GetInfo` call (it may carry the tokenizer).
const INFO_TIMEOUT: Duration = Duration::from_secs(10);

/// Worker roles as the pool knows them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerRole {
    Prefill,
    Decode,
}

impl WorkerRole {
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
        }
    }

    fn proto(self) -> Role {
        match self {
            WorkerRole::Prefill => Role::Prefill,
            WorkerRole::Decode => Role::Decode,
        }
    }
}

#[derive(Debug, Default)]
struct WorkerState {
    info: Option<Arc<WorkerInfo>>,
    load: Option<LoadReport>,
    /// When `load` came.
    load_at: Option<std::time::Instant>,
    healthy: bool,
    /// Set when the worker can never be used (protocol version or role mismatch).
    refused: Option<String>,
    /// Set when the worker left the pool: it gets no new requests and reports no metrics.
    retired: bool,
    /// The last authentication problem logged for it (each distinct one is logged once).
    auth_problem: Option<String>,
}

impl WorkerState {
    fn routable(&self) -> bool {
        self.healthy
            && !self.retired
            && self.refused.is_none()
            && self.info.is_some()
            && !self.load.as_ref().is_some_and(|l| l.draining)
    }
}

/// One worker and the router's view of it.
#[derive(Debug)]
pub struct Worker {
    pub role: WorkerRole,
    /// Unique within the pool for the router's lifetime (a worker that leaves and comes back
    /// gets a new one); routing breaks ties by it, so older workers come first.
    pub id: usize,
    /// Its gRPC URL, configured or discovered (also its `worker` metric label).
    pub url: String,
    channel: AuthChannel,
    state: Mutex<WorkerState>,
    /// Dispatched by this router since the last load report (see `routing::policy`).
    pending_blocks: AtomicU32,
    pending_requests: AtomicU32,
    pending_tokens: AtomicU64,
    /// The prompts those tokens belong to.
    pending_prompts: AtomicU32,
    /// Requests whose stream on this (decode) worker ended since the last load report.
    ended_requests: AtomicU32,
    /// Load reports applied: a prompt that finished before the next report takes its tokens
    /// back out of `pending_tokens` only if no report cleared them meanwhile.
    reports: AtomicU64,
    /// Wakes the poll task early, after a request saw this worker fail or its planned
    /// threads changed.
    probe: tokio::sync::Notify,
    /// Compute threads the elastic planner gives it (0: no plan), sent with each load poll.
    planned_threads: AtomicU32,
    /// What its prefix cache holds, as far as this router knows.
    prefix: Mutex<PrefixIndex>,
}

impl Worker {
    fn new(role: WorkerRole, id: usize, url: &str, auth: &InternalAuth) -> Result<Self, String> {
        let endpoint = auth
            .endpoint(url)
            .map_err(|e| format!("{} worker: {e}", role.as_str()))?
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true)
            // Notice a silently vanished peer (no RST) on an otherwise idle connection.
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(5))
            .keep_alive_while_idle(true);
        Ok(Self {
            role,
            id,
            url: url.to_string(),
            channel: auth.channel(endpoint.connect_lazy()),
            state: Mutex::new(WorkerState::default()),
            pending_blocks: AtomicU32::new(0),
            pending_requests: AtomicU32::new(0),
            pending_tokens: AtomicU64::new(0),
            pending_prompts: AtomicU32::new(0),
            ended_requests: AtomicU32::new(0),
            reports: AtomicU64::new(0),
            prefix: Mutex::new(PrefixIndex::default()),
            probe: tokio::sync::Notify::new(),
            planned_threads: AtomicU32::new(0),
        })
    }

    fn state(&self) -> MutexGuard<'_, WorkerState> {
        // The state is plain data updated in one step; a panic elsewhere cannot leave it
        // half-written, so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn decode_client(&self) -> DecodeServiceClient<AuthChannel> {
        DecodeServiceClient::new(self.channel.clone()).max_decoding_message_size(MAX_MESSAGE_BYTES)
    }

    pub fn prefill_client(&self) -> PrefillServiceClient<AuthChannel> {
        PrefillServiceClient::new(self.channel.clone()).max_decoding_message_size(MAX_MESSAGE_BYTES)
    }

    /// Its last load report.
    pub fn load_report(&self) -> Option<LoadReport> {
        self.state().load.clone()
    }

    /// The compute threads the planner gives it from now on; returns the previous plan.
    pub fn set_planned_threads(&self, n: u32) -> u32 {
        self.planned_threads.swap(n, Ordering::Relaxed)
    }

    /// The compute threads the planner gives it (0: no plan).
    pub fn planned_threads(&self) -> u32 {
        self.planned_threads.load(Ordering::Relaxed)
    }

    /// What the worker said about itself, once it answered.
    pub fn info(&self) -> Option<Arc<WorkerInfo>> {
        self.state().info.clone()
    }

    /// Healthy, answered GetInfo, not refused, not draining, still in the pool.
    pub fn is_routable(&self) -> bool {
        self.state().routable()
    }

    pub fn is_healthy(&self) -> bool {
        self.state().healthy
    }

    /// Whether the worker has left the pool.
    pub fn is_retired(&self) -> bool {
        self.state().retired
    }

    /// Records a request sent to this (decode) worker and the KV blocks it will hold, until
    /// the next load report accounts for them.
    pub fn note_dispatch(&self, blocks: u32) {
        self.pending_blocks.fetch_add(blocks, Ordering::Relaxed);
        self.pending_requests.fetch_add(1, Ordering::Relaxed);
    }

    /// Records that a request's stream on this (decode) worker ended, however it ended,
    /// until the next load report accounts for it.
    pub fn note_ended(&self) {
        self.ended_requests.fetch_add(1, Ordering::Relaxed);
    }

    /// Records prompt tokens sent to this prefill worker, until the prompt is done or the next
    /// load report accounts for them, whichever comes first: a prompt that finished between
    /// two reports must not make the worker look busy to the next request (kv-aware routing
    /// would send that one away from the cache that holds its prefix).
    pub fn note_prefill(&self, tokens: u64) -> PendingPrompt<'_> {
        let report = {
            let _s = self.state();
            self.pending_tokens.fetch_add(tokens, Ordering::Relaxed);
            self.pending_prompts.fetch_add(1, Ordering::Relaxed);
            self.reports.load(Ordering::Relaxed)
        };
        PendingPrompt {
            worker: self,
            tokens,
            report,
        }
    }

    /// Records a prompt of `tokens` tokens sent to this (decode) worker to compute itself
    /// (an aggregated request, or a split prompt's tail), until the next load report accounts
    /// for it: queued prompt work, and a stream only once it is done.
    pub fn note_prompt_tokens(&self, tokens: u64) {
        self.pending_tokens.fetch_add(tokens, Ordering::Relaxed);
        self.pending_prompts.fetch_add(1, Ordering::Relaxed);
    }

    /// Its costs and work as SLO placement sees them (see `routing::placement`); `None`
    /// until it has reported a fitted cost model.
    pub fn cost_view(&self) -> Option<CostView> {
        let s = self.state();
        let load = s.load.as_ref()?;
        let prompts = self.pending_prompts.load(Ordering::Relaxed);
        let since = match self.role {
            // Of the requests sent since, those that brought a prompt to compute are queued
            // prompts; the others (computed elsewhere) decode at once.
            WorkerRole::Decode => SinceReport {
                streams: i64::from(self.pending_requests.load(Ordering::Relaxed))
                    - i64::from(prompts)
                    - i64::from(self.ended_requests.load(Ordering::Relaxed)),
                prompt_tokens: self.pending_tokens.load(Ordering::Relaxed),
                prompts: u64::from(prompts),
            },
            WorkerRole::Prefill => SinceReport {
                streams: 0,
                prompt_tokens: self.pending_tokens.load(Ordering::Relaxed),
                prompts: u64::from(prompts),
            },
        };
        let age_ms = s.load_at.map_or(0.0, |at| at.elapsed().as_secs_f64() * 1e3);
        CostView::from_report(load, since, self.role == WorkerRole::Decode).map(|v| v.aged(age_ms))
    }

    /// After a request saw this worker fail: a failure of the connection or the process
    /// marks it unhealthy at once; any failure makes its poll task check it now, so a dead
    /// worker is routed around within milliseconds while one that failed a single request
    /// keeps serving the others.
    pub fn report_failure(&self, status: &tonic::Status) {
        if status_means_worker_down(status) {
            self.mark_unhealthy("a request failed on it");
        }
        self.probe.notify_one();
    }

    /// Asks the poll task to check the worker now (a request saw something wrong with it
    /// that the worker's own answers did not say).
    pub fn probe_now(&self) {
        self.probe.notify_one();
    }

    /// After a broken exchange (events out of order, a stream ended early).
    pub fn report_protocol_error(&self, what: &str) {
        self.mark_unhealthy(what);
        self.probe.notify_one();
    }

    /// Logs an authentication problem with this worker at error level, once until it changes.
    pub(crate) fn auth_problem(&self, why: &str) {
        let mut s = self.state();
        if s.auth_problem.as_deref() != Some(why) {
            tracing::error!(worker = %self.url, role = self.role.as_str(), "worker not used: {why}");
            s.auth_problem = Some(why.to_string());
        }
    }

    pub(crate) fn clear_auth_problem(&self) {
        self.state().auth_problem = None;
    }

    /// Marks the worker unhealthy after a failed call; `why` is logged, not shown to clients.
    pub fn mark_unhealthy(&self, why: &str) {
        let was = std::mem::replace(&mut self.state().healthy, false);
        if was {
            tracing::warn!(worker = %self.url, role = self.role.as_str(), reason = why, "worker marked unhealthy");
        }
    }

    /// This worker's per-worker metric samples; `None` once it left the pool.
    pub(crate) fn metric_samples(&self) -> Option<m::WorkerSamples> {
        let s = self.state();
        if s.retired {
            return None;
        }
        let load = s.load.as_ref();
        Some(m::WorkerSamples {
            worker: self.url.clone(),
            role: self.role.as_str(),
            healthy: s.routable(),
            kv_blocks: load.map(|l| (l.total_blocks, l.total_blocks.saturating_sub(l.free_blocks))),
            queued_prefill_tokens: load
                .filter(|_| self.role == WorkerRole::Prefill)
                .map(|l| l.queued_prefill_tokens),
            prefix: load.map(|l| {
                (
                    l.prefix_query_tokens,
                    l.prefix_hit_tokens,
                    l.prefix_evictions,
                    l.cached_blocks,
                )
            }),
        })
    }

    /// The cursor of the block events to ask its next load report for, and the block a
    /// snapshot under way goes on from.
    pub(crate) fn prefix_cursor(&self) -> (u64, u32) {
        let index = self.prefix_index();
        (index.cursor(), index.snapshot_block())
    }

    fn prefix_index(&self) -> MutexGuard<'_, PrefixIndex> {
        // Every update is one call: a panic elsewhere cannot leave it half-done.
        self.prefix.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The salt of its block names (from its layout hash), once its info is known.
    fn prefix_salt(&self) -> Option<tandem_kv::BlockHash> {
        self.info()
            .map(|i| tandem_kv::prefix::salt(&i.kv_layout_hash))
    }

    /// Blocks of `prompt` (from the first on) its prefix cache holds, as far as we know.
    pub fn cached_blocks(&self, prompt: &mut PromptNames) -> usize {
        match self.prefix_salt() {
            Some(salt) => self.prefix_index().overlap(prompt.under(salt)),
            None => 0,
        }
    }

    /// Notes that `prompt` was sent here: its blocks count as cached until the worker's own
    /// reports take over.
    pub fn note_prompt(&self, prompt: &mut PromptNames) {
        if let Some(salt) = self.prefix_salt() {
            let names = prompt.under(salt);
            self.prefix_index()
                .note_dispatched(names, std::time::Instant::now());
        }
    }

    fn set_load(&self, load: LoadReport) {
        let applied = self.prefix_index().apply(
            &load.instance_id,
            load.total_blocks,
            load.block_events.as_ref(),
            std::time::Instant::now(),
        );
        if let Err(e) = applied {
            tracing::warn!(worker = %self.url, error = %e, "block events ignored");
        }
        let was = {
            let mut s = self.state();
            if s.retired {
                return;
            }
            self.pending_blocks.store(0, Ordering::Relaxed);
            self.pending_requests.store(0, Ordering::Relaxed);
            self.pending_tokens.store(0, Ordering::Relaxed);
            self.pending_prompts.store(0, Ordering::Relaxed);
            self.ended_requests.store(0, Ordering::Relaxed);
            self.reports.fetch_add(1, Ordering::Relaxed);
            s.load = Some(load);
            s.load_at = Some(std::time::Instant::now());
            std::mem::replace(&mut s.healthy, true)
        };
        if !was {
            tracing::info!(worker = %self.url, role = self.role.as_str(), "worker healthy");
        }
    }

    /// Takes the worker out of service for good: no new requests, and no metric series (a
    /// poll already under way when it left cannot bring them back: `set_load` skips it).
    fn retire(&self) {
        let mut s = self.state();
        s.retired = true;
        s.healthy = false;
    }

    fn decode_candidate(&self, prompt: &mut PromptNames) -> Option<DecodeCandidate> {
        let load = {
            let s = self.state();
            if !s.routable() {
                return None;
            }
            s.load.clone().unwrap_or_default()
        };
        Some(DecodeCandidate {
            id: self.id,
            free_blocks: load.free_blocks,
            running: load.running.saturating_add(load.waiting),
            pending_blocks: self.pending_blocks.load(Ordering::Relaxed),
            pending_requests: self.pending_requests.load(Ordering::Relaxed),
            cached_blocks: u32::try_from(self.cached_blocks(prompt)).unwrap_or(u32::MAX),
            cache_fill: load.cached_blocks,
        })
    }

    fn prefill_candidate(&self, prompt: &mut PromptNames) -> Option<PrefillCandidate> {
        let load = {
            let s = self.state();
            if !s.routable() {
                return None;
            }
            s.load.clone().unwrap_or_default()
        };
        Some(PrefillCandidate {
            id: self.id,
            queued_prefill_tokens: load.queued_prefill_tokens,
            pending_tokens: self.pending_tokens.load(Ordering::Relaxed),
            cached_tokens: (self.cached_blocks(prompt) * tandem_kv::BLOCK_SIZE) as u64,
            cache_fill: load.cached_blocks,
        })
    }
}

/// Prompt tokens a prefill worker has been sent and not yet finished (see
/// [`Worker::note_prefill`]); dropping it (the prefill answered, failed or was abandoned)
/// takes them back out of the worker's pending count, unless a load report already did.
#[must_use = "dropping it at once forgets the prompt at once"]
pub struct PendingPrompt<'w> {
    worker: &'w Worker,
    tokens: u64,
    report: u64,
}

impl Drop for PendingPrompt<'_> {
    fn drop(&mut self) {
        let w = self.worker;
        let _s = w.state();
        if w.reports.load(Ordering::Relaxed) == self.report {
            let _ = w
                .pending_tokens
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| {
                    Some(t.saturating_sub(self.tokens))
                });
            let _ = w
                .pending_prompts
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                    Some(n.saturating_sub(1))
                });
        }
    }
}

/// Why a prefill worker cannot send KV to a decode worker, or `None` if it can.
pub fn pair_incompatibility(
    prefill: &WorkerInfo,
    decode: &WorkerInfo,
    transport: Transport,
) -> Option<String> {
    if prefill.kv_layout_hash != decode.kv_layout_hash {
        return Some(format!(
            "KV layouts differ (prefill {:?} vs decode {:?})",
            prefill.kv_layout_hash, decode.kv_layout_hash
        ));
    }
    let t = transport as i32;
    if !prefill.transports.is_empty() && !prefill.transports.contains(&t) {
        return Some(format!(
            "the prefill worker cannot send over {}",
            transport.as_str_name()
        ));
    }
    if !decode.transports.is_empty() && !decode.transports.contains(&t) {
        return Some(format!(
            "the decode worker cannot receive over {}",
            transport.as_str_name()
        ));
    }
    None
}

/// Why a worker's info makes it unusable, or `None`.
pub fn info_refusal(info: &WorkerInfo, role: WorkerRole) -> Option<String> {
    if info.protocol_version != tandem_proto::PROTOCOL_VERSION {
        return Some(format!(
            "it speaks protocol version {} and the router speaks {}",
            info.protocol_version,
            tandem_proto::PROTOCOL_VERSION
        ));
    }
    if info.role != role.proto() as i32 {
        return Some(format!(
            "it reports role {:?} but is configured as a {} worker",
            Role::try_from(info.role).unwrap_or(Role::Unspecified),
            role.as_str()
        ));
    }
    None
}

/// Whether a failed call means the worker (or the connection to it) is gone, rather than
/// this one request having failed: tonic reports refused and broken connections as
/// Unavailable, and a connection reset mid-stream as Unknown or Cancelled.
pub fn status_means_worker_down(status: &tonic::Status) -> bool {
    use tonic::Code::*;
    matches!(status.code(), Unavailable | Unknown | Cancelled)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(role: Role, hash: &str) -> WorkerInfo {
        WorkerInfo {
            role: role as i32,
            kv_layout_hash: hash.into(),
            protocol_version: tandem_proto::PROTOCOL_VERSION,
            ..Default::default()
        }
    }

    #[test]
    fn pairs_need_equal_layouts_and_the_transport() {
        let p = info(Role::Prefill, "abc");
        let d = info(Role::Decode, "abc");
        assert_eq!(pair_incompatibility(&p, &d, Transport::Shm), None);
        let other = info(Role::Decode, "xyz");
        assert!(pair_incompatibility(&p, &other, Transport::Shm).is_some());
        let mut tcp_only = info(Role::Decode, "abc");
        tcp_only.transports = vec![Transport::Tcp as i32];
        assert!(pair_incompatibility(&p, &tcp_only, Transport::Shm).is_some());
        assert_eq!(pair_incompatibility(&p, &tcp_only, Transport::Tcp), None);
    }

    #[tokio::test]
    async fn a_finished_prompt_leaves_the_pending_count_unless_a_report_cleared_it() {
        let auth = tandem_auth::InternalAuth::none();
        let w = Worker::new(WorkerRole::Prefill, 0, "http://127.0.0.1:1", &auth).unwrap();
        let pending = || w.pending_tokens.load(Ordering::Relaxed);
        let first = w.note_prefill(416);
        let second = w.note_prefill(32);
        assert_eq!(pending(), 448);
        assert_eq!(w.pending_prompts.load(Ordering::Relaxed), 2);
        drop(first);
        assert_eq!(pending(), 32, "done before the next report");
        assert_eq!(w.pending_prompts.load(Ordering::Relaxed), 1);
        // A report counts what is still queued itself: the older prompt's tokens are not
        // taken out of what came after it.
        w.set_load(LoadReport::default());
        let third = w.note_prefill(100);
        drop(second);
        assert_eq!(pending(), 100);
        drop(third);
        assert_eq!(pending(), 0);
    }

    #[tokio::test]
    async fn a_decode_workers_view_counts_streams_started_and_ended_since_its_report() {
        let auth = tandem_auth::InternalAuth::none();
        let w = Worker::new(WorkerRole::Decode, 0, "http://127.0.0.1:1", &auth).unwrap();
        let report = LoadReport {
            step_cost: Some(tandem_proto::v1::StepCost {
                base_ms: 2.0,
                per_row_ms: 1.0,
                passes: 10,
                decode_rows: 4,
                decode_context_tokens: 400,
                ..Default::default()
            }),
            ..Default::default()
        };
        w.set_load(report.clone());
        // Three requests sent since: two prefilled elsewhere, one with a 100-token prompt to
        // compute here; two of the reported streams ended.
        for _ in 0..3 {
            w.note_dispatch(1);
        }
        w.note_prompt_tokens(100);
        w.note_ended();
        w.note_ended();
        let v = w.cost_view().unwrap();
        assert_eq!((v.decode_rows, v.decode_context), (4, 400));
        assert_eq!(
            (v.prompt_rows, v.queued_prompts, v.queued_prompt_tokens),
            (1, 1, 100)
        );
        // The next report says it all itself.
        w.set_load(report);
        let v = w.cost_view().unwrap();
        assert_eq!(
            (v.decode_rows, v.prompt_rows, v.queued_prompt_tokens),
            (4, 0, 0)
        );
    }

    #[test]
    fn refuses_other_protocols_and_roles() {
        let d = info(Role::Decode, "h");
        assert_eq!(info_refusal(&d, WorkerRole::Decode), None);
        assert!(info_refusal(&d, WorkerRole::Prefill).is_some());
        let mut old = d.clone();
        old.protocol_version = tandem_proto::PROTOCOL_VERSION + 1;
        assert!(info_refusal(&old, WorkerRole::Decode).is_some());
    }
}
