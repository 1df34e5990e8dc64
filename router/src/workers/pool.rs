//! The worker pool: which workers exist per role, where each came from (listed as a URL,
//! found through a DNS entry, or both), their poll tasks, and the model learned from them.
//!
//! Membership changes only through `set_source_urls` (discovery's answer for one DNS entry);
//! a worker stays while any source names it, so a URL that is both listed and discovered is
//! one worker, and it leaves only when the last source drops it. Routing reads snapshots of
//! the membership and never holds its lock across an await.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use tandem_auth::InternalAuth;
use tandem_proto::v1::{InfoRequest, LoadRequest, Transport, WorkerInfo};
use tokio_util::sync::CancellationToken;

use super::{INFO_TIMEOUT, Worker, WorkerRole, info_refusal, pair_incompatibility};
use crate::discovery::{DnsName, WorkerEntry};
use crate::metrics as m;
use crate::model::ServedModel;
use crate::routing::{DecodeCandidate, PrefillCandidate, PromptNames};

/// Where a worker of the pool comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum WorkerSource {
    /// Listed as a URL: stays for the router's lifetime.
    Listed,
    /// Found by resolving the pool's DNS entry with this number.
    Dns(usize),
}

#[derive(Debug)]
struct Member {
    worker: Arc<Worker>,
    sources: BTreeSet<WorkerSource>,
    /// Stops the worker's poll task when it leaves; None until polling starts.
    stop: Option<CancellationToken>,
}

#[derive(Debug, Clone)]
struct Polling {
    interval: Duration,
    shutdown: CancellationToken,
}

#[derive(Debug, Default)]
struct Members {
    decode: Vec<Member>,
    prefill: Vec<Member>,
    /// Set once health polling starts; workers that join later get a poll task at once.
    polling: Option<Polling>,
}

impl Members {
    fn of(&mut self, role: WorkerRole) -> &mut Vec<Member> {
        match role {
            WorkerRole::Decode => &mut self.decode,
            WorkerRole::Prefill => &mut self.prefill,
        }
    }
}

/// All workers, and the model learned from them.
#[derive(Debug)]
pub struct WorkerPool {
    members: RwLock<Members>,
    next_id: AtomicUsize,
    /// The DNS entries of both roles, numbered as their `WorkerSource::Dns`.
    dns: Vec<(WorkerRole, WorkerSource, DnsName)>,
    prefill_configured: bool,
    transport: Transport,
    served_model_name: Option<String>,
    model: OnceLock<Arc<ServedModel>>,
    /// The credentials every worker call carries, and that workers' info must prove.
    auth: InternalAuth,
}

impl WorkerPool {
    /// A pool of the listed workers; DNS entries are remembered for `discovery` and start
    /// with no workers.
    pub fn new(
        prefill_entries: &[String],
        decode_entries: &[String],
        transport: Transport,
        served_model_name: Option<String>,
        auth: InternalAuth,
    ) -> Result<Self, String> {
        let mut pool = Self {
            members: RwLock::default(),
            next_id: AtomicUsize::new(0),
            dns: Vec::new(),
            prefill_configured: !prefill_entries.is_empty(),
            transport,
            served_model_name,
            model: OnceLock::new(),
            auth,
        };
        let roles = [
            (WorkerRole::Decode, decode_entries),
            (WorkerRole::Prefill, prefill_entries),
        ];
        for (role, entries) in roles {
            for raw in entries {
                let entry = WorkerEntry::parse(raw)
                    .map_err(|e| format!("{} worker entry {e}", role.as_str()))?;
                match entry {
                    WorkerEntry::Url(url) => pool.add_listed(role, &url)?,
                    WorkerEntry::Dns(name) => {
                        let source = WorkerSource::Dns(pool.dns.len());
                        pool.dns.push((role, source, name));
                    }
                }
            }
        }
        pool.publish_counts();
        Ok(pool)
    }

    fn add_listed(&mut self, role: WorkerRole, url: &str) -> Result<(), String> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let members = self.members.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = members.of(role).iter_mut().find(|m| m.worker.url == url) {
            m.sources.insert(WorkerSource::Listed);
            return Ok(());
        }
        let worker = Arc::new(Worker::new(role, id, url, &self.auth)?);
        members.of(role).push(Member {
            worker,
            sources: BTreeSet::from([WorkerSource::Listed]),
            stop: None,
        });
        Ok(())
    }

    fn read(&self) -> RwLockReadGuard<'_, Members> {
        // Membership is changed in single steps under the lock; a panic elsewhere cannot
        // leave it half-written.
        self.members.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Members> {
        self.members.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The per-worker metric samples of every worker in the pool now, prefill first.
    pub fn worker_samples(&self) -> Vec<m::WorkerSamples> {
        [WorkerRole::Prefill, WorkerRole::Decode]
            .into_iter()
            .flat_map(|role| self.workers(role))
            .filter_map(|w| w.metric_samples())
            .collect()
    }

    /// The workers of `role` now, oldest first.
    pub fn workers(&self, role: WorkerRole) -> Vec<Arc<Worker>> {
        let members = self.read();
        let list = match role {
            WorkerRole::Decode => &members.decode,
            WorkerRole::Prefill => &members.prefill,
        };
        list.iter().map(|m| Arc::clone(&m.worker)).collect()
    }

    /// The worker of `role` with this id, if it is still in the pool.
    pub fn worker(&self, role: WorkerRole, id: usize) -> Option<Arc<Worker>> {
        self.workers(role).into_iter().find(|w| w.id == id)
    }

    /// The DNS entries to resolve, with the source each one's workers are recorded under.
    pub fn dns_entries(&self) -> Vec<(WorkerRole, WorkerSource, DnsName)> {
        self.dns.clone()
    }

    /// Whether some decode workers are found through DNS (and so may appear at any time).
    pub fn discovers_decode_workers(&self) -> bool {
        self.dns
            .iter()
            .any(|(role, ..)| *role == WorkerRole::Decode)
    }

    /// Whether any prefill entry was configured. Without one every request runs aggregated
    /// by design; with one, even a DNS name that has no workers yet, a request that finds
    /// no prefill worker is a fallback.
    pub fn prefill_configured(&self) -> bool {
        self.prefill_configured
    }

    /// The served model, once a decode worker has handed over its tokenizer.
    pub fn model(&self) -> Option<Arc<ServedModel>> {
        self.model.get().cloned()
    }

    /// Serves `model` without a worker having handed it over (the `http_bodies` fuzz target,
    /// whose pool has no worker). `false` when the pool serves a model already.
    pub(crate) fn adopt_model(&self, model: ServedModel) -> bool {
        self.model.set(Arc::new(model)).is_ok()
    }

    /// The KV transport requests ask for.
    pub fn transport(&self) -> Transport {
        self.transport
    }

    /// Routable (decode, prefill) workers.
    pub fn healthy_counts(&self) -> (usize, usize) {
        let members = self.read();
        let count = |ms: &[Member]| ms.iter().filter(|m| m.worker.is_routable()).count();
        (count(&members.decode), count(&members.prefill))
    }

    /// (decode, prefill) workers in the pool, healthy or not.
    pub fn worker_counts(&self) -> (usize, usize) {
        let members = self.read();
        (members.decode.len(), members.prefill.len())
    }

    fn publish_counts(&self) {
        let (decode, prefill) = self.worker_counts();
        metrics::gauge!(m::DISCOVERED_WORKERS, "role" => WorkerRole::Decode.as_str())
            .set(decode as f64);
        metrics::gauge!(m::DISCOVERED_WORKERS, "role" => WorkerRole::Prefill.as_str())
            .set(prefill as f64);
    }

    /// Routable decode workers, minus `exclude` (ids).
    pub fn decode_candidates(
        &self,
        exclude: &[usize],
        prompt: &mut PromptNames,
    ) -> Vec<DecodeCandidate> {
        self.workers(WorkerRole::Decode)
            .iter()
            .filter(|w| !exclude.contains(&w.id))
            .filter_map(|w| w.decode_candidate(prompt))
            .collect()
    }

    /// Routable prefill workers that can send KV to `decode`.
    pub fn prefill_candidates_for(
        &self,
        decode: &Worker,
        prompt: &mut PromptNames,
    ) -> Vec<PrefillCandidate> {
        let Some(decode_info) = decode.info() else {
            return Vec::new();
        };
        self.workers(WorkerRole::Prefill)
            .iter()
            .filter(|p| {
                p.info().is_some_and(|pi| {
                    pair_incompatibility(&pi, &decode_info, self.transport).is_none()
                })
            })
            .filter_map(|p| p.prefill_candidate(prompt))
            .collect()
    }

    /// Makes `urls` the workers `source` names for `role`: the new ones join (and are
    /// polled like listed workers), the ones no source names any more leave.
    pub fn set_source_urls(
        self: &Arc<Self>,
        role: WorkerRole,
        source: WorkerSource,
        urls: &BTreeSet<String>,
    ) {
        let mut joined = Vec::new();
        let mut left = Vec::new();
        {
            let mut members = self.write();
            let polling = members.polling.clone();
            let list = members.of(role);
            for m in list.iter_mut() {
                if urls.contains(&m.worker.url) {
                    m.sources.insert(source);
                } else {
                    m.sources.remove(&source);
                }
            }
            list.retain(|m| {
                if !m.sources.is_empty() {
                    return true;
                }
                m.worker.retire();
                if let Some(stop) = &m.stop {
                    stop.cancel();
                }
                left.push(m.worker.url.clone());
                false
            });
            for url in urls {
                if list.iter().any(|m| &m.worker.url == url) {
                    continue;
                }
                let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                let worker = match Worker::new(role, id, url, &self.auth) {
                    Ok(w) => Arc::new(w),
                    Err(e) => {
                        tracing::error!(
                            role = role.as_str(),
                            "cannot add a discovered worker: {e}"
                        );
                        continue;
                    }
                };
                let stop = polling
                    .as_ref()
                    .map(|p| self.spawn_poll(Arc::clone(&worker), p));
                list.push(Member {
                    worker,
                    sources: BTreeSet::from([source]),
                    stop,
                });
                joined.push(url.clone());
            }
        }
        if joined.is_empty() && left.is_empty() {
            return;
        }
        for url in &joined {
            tracing::info!(worker = %url, role = role.as_str(), "worker joined the pool");
        }
        for url in &left {
            tracing::info!(worker = %url, role = role.as_str(), "worker left the pool; it gets no new requests");
        }
        self.publish_counts();
    }

    /// Starts one poll task per worker, now and for every worker that joins later; they
    /// stop when `shutdown` is cancelled or their worker leaves.
    pub fn spawn_health_tasks(self: &Arc<Self>, interval: Duration, shutdown: &CancellationToken) {
        let polling = Polling {
            interval,
            shutdown: shutdown.clone(),
        };
        let mut members = self.write();
        members.polling = Some(polling.clone());
        let Members {
            decode, prefill, ..
        } = &mut *members;
        for m in decode.iter_mut().chain(prefill.iter_mut()) {
            if m.stop.is_none() {
                m.stop = Some(self.spawn_poll(Arc::clone(&m.worker), &polling));
            }
        }
    }

    fn spawn_poll(self: &Arc<Self>, worker: Arc<Worker>, polling: &Polling) -> CancellationToken {
        let stop = polling.shutdown.child_token();
        let pool = Arc::clone(self);
        let interval = polling.interval;
        let cancelled = stop.clone();
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = cancelled.cancelled() => break,
                    _ = ticker.tick() => {}
                    _ = worker.probe.notified() => {}
                }
                tokio::select! {
                    _ = cancelled.cancelled() => break,
                    _ = pool.poll(&worker, interval) => {}
                }
            }
        });
        stop
    }

    /// Stores a worker's info after checking it; logs every refusal and layout mismatch.
    fn accept_info(&self, worker: &Worker, info: WorkerInfo) {
        if let Some(why) = info_refusal(&info, worker.role) {
            let mut s = worker.state();
            if s.refused.is_none() {
                tracing::error!(worker = %worker.url, role = worker.role.as_str(), "worker refused: {why}; it will not be used");
            }
            s.refused = Some(why);
            s.healthy = false;
            return;
        }
        if worker.role == WorkerRole::Decode
            && info.tokenizer.is_some()
            && self.model.get().is_none()
        {
            match ServedModel::from_worker_info(&info, self.served_model_name.as_deref()) {
                Ok(model) => {
                    tracing::info!(worker = %worker.url, model = %model.name, context_length = model.context_length, "serving model");
                    let _ = self.model.set(Arc::new(model));
                }
                Err(e) => {
                    tracing::error!(worker = %worker.url, "cannot use the worker's tokenizer: {e}")
                }
            }
        }
        // Tokenizers are large: keep the info without it.
        let info = Arc::new(WorkerInfo {
            tokenizer: None,
            ..info
        });
        let counterparts = match worker.role {
            WorkerRole::Decode => self.workers(WorkerRole::Prefill),
            WorkerRole::Prefill => self.workers(WorkerRole::Decode),
        };
        for other in &counterparts {
            let Some(other_info) = other.info() else {
                continue;
            };
            let (p, d) = match worker.role {
                WorkerRole::Decode => (&other_info, &info),
                WorkerRole::Prefill => (&info, &other_info),
            };
            if let Some(why) = pair_incompatibility(p, d, self.transport) {
                let (pu, du) = match worker.role {
                    WorkerRole::Decode => (&other.url, &worker.url),
                    WorkerRole::Prefill => (&worker.url, &other.url),
                };
                tracing::error!(prefill = %pu, decode = %du, "workers will not be paired: {why}");
            }
        }
        worker.state().info = Some(info);
    }

    /// One health round for `worker`: info if needed, then load.
    async fn poll(&self, worker: &Worker, interval: Duration) {
        let (needs_info, refused) = {
            let s = worker.state();
            (s.info.is_none() || !s.healthy, s.refused.is_some())
        };
        if refused {
            return;
        }
        if needs_info {
            let include_tokenizer = worker.role == WorkerRole::Decode && self.model.get().is_none();
            let challenge = match tandem_auth::challenge() {
                Ok(c) => c,
                Err(e) => return worker.mark_unhealthy(&e.to_string()),
            };
            let request = InfoRequest {
                include_tokenizer,
                challenge: challenge.to_vec(),
            };
            let answer = match worker.role {
                WorkerRole::Decode => {
                    let mut c = worker.decode_client();
                    tokio::time::timeout(INFO_TIMEOUT, c.get_info(request)).await
                }
                WorkerRole::Prefill => {
                    let mut c = worker.prefill_client();
                    tokio::time::timeout(INFO_TIMEOUT, c.get_info(request)).await
                }
            };
            match answer {
                Ok(Ok(info)) => {
                    let info = info.into_inner();
                    if self.auth.verify_worker_info(&challenge, &info).is_err() {
                        worker.auth_problem(
                            "it did not prove that it holds the deployment's internal secret \
                             (its GetInfo proof does not match): it gets no requests",
                        );
                        return worker.mark_unhealthy("its identity proof does not match");
                    }
                    worker.clear_auth_problem();
                    self.accept_info(worker, info);
                }
                Ok(Err(status)) if status.code() == tonic::Code::Unauthenticated => {
                    worker.auth_problem(&format!(
                        "it refused the router's credentials ({}); give the router the \
                         deployment's internal secret (TANDEM_INTERNAL_SECRET)",
                        status.message()
                    ));
                    return worker.mark_unhealthy("it refused the router's credentials");
                }
                Ok(Err(status)) => {
                    tracing::debug!(worker = %worker.url, %status, "GetInfo failed");
                    return worker.mark_unhealthy("GetInfo failed");
                }
                Err(_) => return worker.mark_unhealthy("GetInfo timed out"),
            }
            if worker.state().refused.is_some() {
                return;
            }
        }
        // Long enough for a busy worker, short enough that a dead one is noticed within about
        // two intervals.
        let load_timeout = (interval * 2).clamp(Duration::from_millis(250), Duration::from_secs(5));
        let (cursor, snapshot_from_block) = worker.prefix_cursor();
        let load_request = LoadRequest {
            block_events_after: Some(cursor),
            snapshot_from_block,
            compute_threads: worker.planned_threads(),
        };
        let answer = match worker.role {
            WorkerRole::Decode => {
                let mut c = worker.decode_client();
                tokio::time::timeout(load_timeout, c.get_load(load_request)).await
            }
            WorkerRole::Prefill => {
                let mut c = worker.prefill_client();
                tokio::time::timeout(load_timeout, c.get_load(load_request)).await
            }
        };
        match answer {
            Ok(Ok(load)) => {
                let load = load.into_inner();
                // Restarted at the same address since we read its info: that info (its
                // shared pool, its ports) is stale. Read it again before routing to it.
                let restarted = worker.info().is_some_and(|i| {
                    !load.instance_id.is_empty() && i.instance_id != load.instance_id
                });
                if restarted {
                    tracing::info!(worker = %worker.url, role = worker.role.as_str(), "worker restarted; reading its info again");
                    worker.state().info = None;
                    worker.probe.notify_one();
                    return;
                }
                worker.set_load(load);
            }
            Ok(Err(status)) => {
                tracing::debug!(worker = %worker.url, %status, "GetLoad failed");
                worker.mark_unhealthy("GetLoad failed");
            }
            Err(_) => worker.mark_unhealthy("GetLoad timed out"),
        }
    }
}

#[cfg(test)]
mod tests {
    use tandem_proto::v1::LoadReport;

    use super::*;

    /// The value of the series of `metric` for `worker`, from the pool's per-worker families.
    fn series(pool: &WorkerPool, metric: &str, worker: &str) -> Option<f64> {
        let text = m::render_worker_families(&pool.worker_samples());
        text.lines()
            .filter(|l| l.starts_with(&format!("{metric}{{")))
            .find(|l| l.contains(&format!("worker=\"{worker}\"")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }

    #[tokio::test]
    async fn a_worker_that_leaves_has_no_series_any_more() {
        let pool = Arc::new(
            WorkerPool::new(
                &[],
                &["dns://d.test:7201".into()],
                Transport::Tcp,
                None,
                InternalAuth::none(),
            )
            .unwrap(),
        );
        let url = "http://10.9.5.1:7201";
        pool.set_source_urls(
            WorkerRole::Decode,
            WorkerSource::Dns(0),
            &BTreeSet::from([url.to_string()]),
        );
        let worker = Arc::clone(&pool.workers(WorkerRole::Decode)[0]);
        // Before any load report: only its health, and it is not routable yet.
        assert_eq!(series(&pool, m::WORKER_HEALTHY, url), Some(0.0));
        assert_eq!(series(&pool, m::WORKER_KV_BLOCKS_TOTAL, url), None);
        let load = LoadReport {
            total_blocks: 64,
            free_blocks: 60,
            ..Default::default()
        };
        worker.set_load(load.clone());
        assert_eq!(series(&pool, m::WORKER_KV_BLOCKS_TOTAL, url), Some(64.0));
        assert_eq!(series(&pool, m::WORKER_KV_BLOCKS_IN_USE, url), Some(4.0));
        assert_eq!(
            series(&pool, m::WORKER_QUEUED_PREFILL_TOKENS, url),
            None,
            "a decode worker queues no prefill tokens"
        );

        pool.set_source_urls(WorkerRole::Decode, WorkerSource::Dns(0), &BTreeSet::new());
        assert_eq!(pool.worker_counts(), (0, 0));
        for metric in [
            m::WORKER_HEALTHY,
            m::WORKER_KV_BLOCKS_TOTAL,
            m::WORKER_KV_BLOCKS_IN_USE,
        ] {
            assert_eq!(
                series(&pool, metric, url),
                None,
                "{metric} outlived the worker"
            );
        }
        // A poll that was already under way when the worker left changes nothing.
        worker.set_load(load);
        worker.mark_unhealthy("late failure");
        assert_eq!(worker.metric_samples(), None);
        assert!(!worker.is_routable());
    }
}
