//! The async side of the engine actor: [`EngineHandle`] (what request handlers call), the
//! commands it sends the engine thread, the events a sequence's handler receives, and the
//! load figures the thread publishes after every step.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tandem_engine::{
    Engine, EngineError, ReceivedKv, SampledToken, SamplingParams, SeqId, StepOutput, StopParams,
    compile_guide,
};
use tandem_kv::{SharedPool, prefix};
use tandem_proto::v1::{BlockEvents, LoadReport};
use tandem_text::{Guide, GuideFactory};
use tandem_transfer::{KvSender, PulledPrefix};
use tokio::sync::{mpsc as tmpsc, oneshot};

use crate::pacing::CostBoard;

/// What a sequence's handler receives.
pub enum SeqEvent {
    /// A generated token.
    Token(StepOutput),
    /// The prompt ran and every layer of its KV went to the sender: commit it.
    Prefilled {
        /// Choice 0's first token.
        output: StepOutput,
        /// The first tokens of choices 1.. (by choice) of an `n > 1` request.
        others: Vec<StepOutput>,
        sender: Box<dyn KvSender>,
        /// Time queued before the prompt's first chunk ran.
        queue_seconds: f64,
        /// Time from the first chunk to the first token.
        compute_seconds: f64,
    },
    /// The sequence failed in the engine; it is gone from the engine.
    Failed(String),
    /// Its KV could not be sent to the decode worker (a problem of the destination or the
    /// way there, not of this worker); the sequence is gone from the engine.
    TransferFailed(String),
}

impl std::fmt::Debug for SeqEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SeqEvent::Token(o) => f.debug_tuple("Token").field(o).finish(),
            SeqEvent::Prefilled { output, .. } => f
                .debug_struct("Prefilled")
                .field("output", output)
                .finish_non_exhaustive(),
            SeqEvent::Failed(m) => f.debug_tuple("Failed").field(m).finish(),
            SeqEvent::TransferFailed(m) => f.debug_tuple("TransferFailed").field(m).finish(),
        }
    }
}

/// Where a prefill's KV goes: the sender, and the first logical block the decode side wants
/// (its lease's block 0; the blocks before it are not shipped: the decode worker's prefix
/// cache holds them, or a sliding window has left them behind).
pub struct KvShipment {
    pub sender: Box<dyn KvSender>,
    pub first_block: usize,
    /// Blocks of that cached prefix this worker lacked and read from the decode worker: they
    /// join this engine's prefix cache just before the prompt is queued, so it computes only
    /// what follows them.
    pub pulled: Option<PulledPrefix>,
}

pub(super) enum Command {
    Add {
        prompt: Vec<u32>,
        sampling: SamplingParams,
        stop: StopParams,
        guide: Option<Guide>,
        kv: Option<KvShipment>,
        tpot_target: Option<Duration>,
        events: tmpsc::UnboundedSender<SeqEvent>,
        reply: oneshot::Sender<Result<SeqId, EngineError>>,
    },
    /// `Engine::add_prefilled` or `Engine::add_partly_prefilled`, as `part` says.
    AddPrefilled {
        prompt: Vec<u32>,
        part: PrefilledPart,
        kv: ReceivedKv,
        sampling: SamplingParams,
        stop: StopParams,
        guide: Option<Guide>,
        tpot_target: Option<Duration>,
        events: tmpsc::UnboundedSender<SeqEvent>,
        reply: oneshot::Sender<Result<SeqId, EngineError>>,
    },
}

impl Command {
    /// What the command brings the engine, counted in the load reports from the moment it
    /// is sent (see [`LoadSnapshot::inbox`]) as the engine counts it once taken: a prompt to
    /// compute is queued prompt work (its streams decode only once it is done); a prompt
    /// computed elsewhere whole decodes at once.
    fn inbox_share(&self) -> InboxShare {
        let (prompt, computed_elsewhere, n) = match self {
            Command::Add {
                prompt, sampling, ..
            } => (prompt, 0, sampling.n),
            Command::AddPrefilled {
                prompt,
                part,
                sampling,
                ..
            } => {
                let done = match part {
                    PrefilledPart::Whole(_) => prompt.len(),
                    PrefilledPart::Prefix(n) => (*n).min(prompt.len()),
                };
                (prompt, done, sampling.n)
            }
        };
        let prompt_tokens = (prompt.len() - computed_elsewhere) as u64;
        let streams = if prompt_tokens == 0 { n as u64 } else { 0 };
        InboxShare {
            prompt_tokens,
            prompts: u64::from(prompt_tokens > 0),
            streams,
            context_tokens: streams * prompt.len() as u64,
        }
    }
}

/// Work sent to the engine thread (see [`Command::inbox_share`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InboxShare {
    /// Prompt tokens to compute here, and the prompts they belong to.
    pub prompt_tokens: u64,
    pub prompts: u64,
    /// Streams that decode from their first pass here, and their contexts summed.
    pub streams: u64,
    pub context_tokens: u64,
}

/// How much of a prompt another worker computed (see [`EngineHandle::add_prefilled`]).
#[derive(Debug, Clone)]
pub enum PrefilledPart {
    /// All of it, with each choice's first token sampled there.
    Whole(Vec<SampledToken>),
    /// Its first this many tokens (whole blocks): the rest runs here.
    Prefix(usize),
}

/// Load figures the actor publishes after every step, read without a round trip.
#[derive(Debug, Default)]
pub struct LoadSnapshot {
    pub running: AtomicU64,
    pub waiting: AtomicU64,
    pub queued_prefill_tokens: AtomicU64,
    pub queued_prompts: AtomicU64,
    /// When the pass under way began, in microseconds after `epoch` (0: between passes).
    pub pass_started_us: AtomicU64,
    pub epoch: EpochInstant,
    pub steps: AtomicU64,
    pub preemptions: AtomicU64,
    /// The prefix cache: prompt tokens looked up, and found.
    pub prefix_query_tokens: AtomicU64,
    pub prefix_hit_tokens: AtomicU64,
    /// What a pass costs here and the decode work under way (see `pacing`).
    pub cost: CostBoard,
    /// Work sent to the engine thread that it has not taken yet. The figures above are
    /// published between passes, and the thread takes commands only then: without these, a
    /// prompt sent during a prefill worker's ten-second pass would be missing from every
    /// report until the pass ended, and the router (which forgets what it sent once a report
    /// comes) would price that worker's queue as if it were not there.
    inbox_prompt_tokens: AtomicU64,
    inbox_prompts: AtomicU64,
    inbox_streams: AtomicU64,
    inbox_context_tokens: AtomicU64,
}

impl LoadSnapshot {
    fn enter_inbox(&self, share: InboxShare) {
        self.inbox_prompt_tokens
            .fetch_add(share.prompt_tokens, Ordering::Relaxed);
        self.inbox_prompts
            .fetch_add(share.prompts, Ordering::Relaxed);
        self.inbox_streams
            .fetch_add(share.streams, Ordering::Relaxed);
        self.inbox_context_tokens
            .fetch_add(share.context_tokens, Ordering::Relaxed);
    }

    fn leave_inbox(&self, share: InboxShare) {
        // Each share leaves once, after it entered (a send happens before its receipt).
        self.inbox_prompt_tokens
            .fetch_sub(share.prompt_tokens, Ordering::Relaxed);
        self.inbox_prompts
            .fetch_sub(share.prompts, Ordering::Relaxed);
        self.inbox_streams
            .fetch_sub(share.streams, Ordering::Relaxed);
        self.inbox_context_tokens
            .fetch_sub(share.context_tokens, Ordering::Relaxed);
    }

    /// The work sent to the engine thread and not yet taken by it.
    pub fn inbox(&self) -> InboxShare {
        InboxShare {
            prompt_tokens: self.inbox_prompt_tokens.load(Ordering::Relaxed),
            prompts: self.inbox_prompts.load(Ordering::Relaxed),
            streams: self.inbox_streams.load(Ordering::Relaxed),
            context_tokens: self.inbox_context_tokens.load(Ordering::Relaxed),
        }
    }
}

/// Takes `cmd` off the engine thread's inbox: its share leaves the load reports' inbox
/// counts (the engine's own figures take it over from the next publish on).
pub(super) fn take_from_inbox(load: &LoadSnapshot, cmd: &Command) {
    load.leave_inbox(cmd.inbox_share());
}

/// The instant a worker's pass times are counted from (its load snapshot's creation).
#[derive(Debug, Clone, Copy)]
pub struct EpochInstant(pub Instant);

impl Default for EpochInstant {
    fn default() -> Self {
        Self(Instant::now())
    }
}

impl LoadSnapshot {
    /// Marks a pass as under way from now (`true`) or over (`false`).
    pub fn pass_under_way(&self, under_way: bool) {
        let us = if under_way {
            // At least 1: 0 means between passes.
            (self.epoch.0.elapsed().as_micros() as u64).max(1)
        } else {
            0
        };
        self.pass_started_us.store(us, Ordering::Relaxed);
    }

    /// How long the pass under way has run (0 between passes).
    pub fn pass_elapsed_ms(&self) -> f64 {
        match self.pass_started_us.load(Ordering::Relaxed) {
            0 => 0.0,
            started => {
                let now = self.epoch.0.elapsed().as_micros() as u64;
                now.saturating_sub(started) as f64 / 1e3
            }
        }
    }
}

/// A cheap, cloneable way to reach the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    pub(super) tx: mpsc::Sender<Command>,
    /// The salt of the engine's block names (`None`: no prefix caching).
    pub(super) prefix_salt: Option<tandem_kv::BlockHash>,
    /// See `Engine::imports_prefix_kv`.
    pub(super) imports_prefix_kv: bool,
    pub(super) pool: SharedPool,
    pub(super) load: Arc<LoadSnapshot>,
    pub(super) guides: GuideFactory,
    /// The engine computes on the CPU: its compute threads can be told how many take part.
    pub(super) on_cpu: bool,
    /// Becomes true when the engine thread has calibrated and takes requests.
    pub(super) calibrated: tokio::sync::watch::Receiver<bool>,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle").finish_non_exhaustive()
    }
}

fn gone() -> EngineError {
    EngineError::Unsupported("the engine thread has stopped".into())
}

impl EngineHandle {
    /// Sends `cmd` to the engine thread, counted in the load reports until it takes it.
    fn send(&self, cmd: Command) -> Result<(), EngineError> {
        let share = cmd.inbox_share();
        self.load.enter_inbox(share);
        self.tx.send(cmd).map_err(|_| {
            self.load.leave_inbox(share);
            gone()
        })
    }

    /// Compiles a request's grammar on the blocking pool (milliseconds of work that must not
    /// hold up the engine's thread or an async worker).
    pub async fn compile_guide(
        &self,
        sampling: &SamplingParams,
    ) -> Result<Option<Guide>, EngineError> {
        let Some(spec) = sampling.guide.clone() else {
            return Ok(None);
        };
        let guides = self.guides.clone();
        tokio::task::spawn_blocking(move || compile_guide(&guides, &spec).map(Some))
            .await
            .map_err(|e| EngineError::Unsupported(format!("compiling a grammar: {e}")))?
    }

    /// Queues a whole request (aggregated), or a prompt whose KV goes to `kv` (prefill).
    /// `tpot_target`: the stream's TPOT target, which paces the prompt chunks beside it.
    pub async fn add(
        &self,
        prompt: Vec<u32>,
        sampling: SamplingParams,
        stop: StopParams,
        kv: Option<KvShipment>,
        tpot_target: Option<Duration>,
        events: tmpsc::UnboundedSender<SeqEvent>,
    ) -> Result<SeqId, EngineError> {
        let guide = self.compile_guide(&sampling).await?;
        let (reply, rx) = oneshot::channel();
        self.send(Command::Add {
            prompt,
            sampling,
            stop,
            guide,
            kv,
            tpot_target,
            events,
            reply,
        })?;
        rx.await.map_err(|_| gone())?
    }

    /// Admits a request whose prompt KV (all of it, or its first part: `part`) is already
    /// in `kv`'s blocks. With the whole prompt come each choice's first tokens, which the
    /// caller streamed already, so events start with the second tokens; with a first part,
    /// the rest of the prompt runs here and events start with the first tokens. `guide`: the
    /// request's grammar from [`EngineHandle::compile_guide`], not yet advanced.
    #[allow(clippy::too_many_arguments)]
    pub async fn add_prefilled(
        &self,
        prompt: Vec<u32>,
        part: PrefilledPart,
        kv: ReceivedKv,
        sampling: SamplingParams,
        stop: StopParams,
        guide: Option<Guide>,
        tpot_target: Option<Duration>,
        events: tmpsc::UnboundedSender<SeqEvent>,
    ) -> Result<SeqId, EngineError> {
        let (reply, rx) = oneshot::channel();
        let command = Command::AddPrefilled {
            prompt,
            part,
            kv,
            sampling,
            stop,
            guide,
            tpot_target,
            events,
            reply,
        };
        self.send(command)?;
        rx.await.map_err(|_| gone())?
    }

    /// The blocks of `prompt`'s longest cached prefix, held for the caller (see
    /// `Engine::hold_cached_prefix`); none when this engine does not cache prefixes.
    pub fn hold_cached_prefix(&self, prompt: &[u32]) -> Vec<u32> {
        match self.prefix_salt {
            Some(salt) => Engine::hold_cached_prefix(&self.pool, salt, prompt),
            None => Vec::new(),
        }
    }

    /// How many leading blocks of `prompt` the prefix cache holds now (0 without caching).
    pub fn cached_prefix_blocks(&self, prompt: &[u32]) -> usize {
        match self.prefix_salt {
            Some(salt) => Engine::cached_prefix_blocks(&self.pool, salt, prompt),
            None => 0,
        }
    }

    /// Whether pulled prefix KV can join this engine's cache (see `KvShipment::pulled`).
    pub fn imports_prefix_kv(&self) -> bool {
        self.imports_prefix_kv
    }

    /// The load report a worker answers `GetLoad` with: the engine's load and prefix cache,
    /// with the cache's block events after `block_events_after` (or a snapshot's page from
    /// block `snapshot_from_block`) when asked.
    pub fn load_report(
        &self,
        leases: u32,
        draining: bool,
        instance_id: &[u8],
        block_events_after: Option<u64>,
        snapshot_from_block: u32,
    ) -> LoadReport {
        let (prefix_query_tokens, prefix_hit_tokens, prefix_evictions, cached_blocks) =
            self.prefix_counts();
        let block_events = block_events_after
            .filter(|_| self.prefix_salt.is_some())
            .map(|cursor| {
                let page =
                    self.pool
                        .events_since(cursor, snapshot_from_block, prefix::NAMES_PER_REPORT);
                BlockEvents {
                    snapshot: page.snapshot,
                    stored: prefix::names_to_bytes(&page.stored),
                    removed: prefix::names_to_bytes(&page.removed),
                    next: page.next,
                    next_block: page.next_block,
                }
            });
        let (threads, team) = self.compute_threads().unwrap_or((0, 0));
        let inbox = self.load.inbox();
        let mut step_cost = self.load.cost.report();
        step_cost.pass_elapsed_ms = self.load.pass_elapsed_ms();
        step_cost.decode_rows = step_cost
            .decode_rows
            .saturating_add(u32::try_from(inbox.streams).unwrap_or(u32::MAX));
        step_cost.decode_context_tokens = step_cost
            .decode_context_tokens
            .saturating_add(inbox.context_tokens);
        LoadReport {
            prefix_query_tokens,
            prefix_hit_tokens,
            prefix_evictions,
            cached_blocks,
            total_blocks: self.pool.total() as u32,
            free_blocks: self.pool.free_count() as u32,
            running: self.load.running.load(Ordering::Relaxed) as u32,
            waiting: self.load.waiting.load(Ordering::Relaxed) as u32,
            queued_prefill_tokens: self
                .load
                .queued_prefill_tokens
                .load(Ordering::Relaxed)
                .saturating_add(inbox.prompt_tokens),
            queued_prompts: u32::try_from(
                self.load
                    .queued_prompts
                    .load(Ordering::Relaxed)
                    .saturating_add(inbox.prompts),
            )
            .unwrap_or(u32::MAX),
            leases,
            draining,
            instance_id: instance_id.to_vec(),
            block_events,
            step_cost: Some(step_cost),
            compute_threads: threads as u32,
            max_compute_threads: team as u32,
        }
    }

    /// A CPU engine's compute threads taking part now and the most it has; `None` on a GPU.
    pub fn compute_threads(&self) -> Option<(usize, usize)> {
        use tandem_engine::backend::cpu::kernels::team;
        self.on_cpu.then(|| (team::threads(), team::max_threads()))
    }

    /// Lets `n` compute threads of a CPU engine take part from its next parallel region on
    /// (the elastic thread planner's move; between regions a result does not depend on it).
    /// Returns the number before and after; `None` on a GPU or for `n == 0` (keep).
    pub fn set_compute_threads(&self, n: u32) -> Option<(usize, usize)> {
        use tandem_engine::backend::cpu::kernels::team;
        if !self.on_cpu || n == 0 {
            return None;
        }
        let before = team::threads();
        Some((before, team::set_active_threads(n as usize)))
    }

    /// The block pool, for reservations that must not wait for a forward pass.
    pub fn pool(&self) -> &SharedPool {
        &self.pool
    }

    /// Waits until the engine thread has run its start-up calibration (at once without one,
    /// or when the thread has ended). A worker serves only after it, so that nobody waits
    /// behind made-up work and the first load report prices prompts.
    pub async fn calibrated(&self) {
        let mut rx = self.calibrated.clone();
        // An error means the thread ended: nothing to wait for.
        let _ = rx.wait_for(|done| *done).await;
    }

    /// [`EngineHandle::calibrated`], unless `shutdown` comes first: whether the worker may
    /// serve (false: it was stopped while calibrating, as `load_model_until` is while loading).
    pub async fn calibrated_until(
        &self,
        shutdown: &mut std::pin::Pin<Box<dyn Future<Output = ()> + Send>>,
    ) -> bool {
        tokio::select! {
            () = self.calibrated() => true,
            () = shutdown.as_mut() => {
                tracing::info!("stopped while calibrating");
                false
            }
        }
    }

    pub fn load(&self) -> &LoadSnapshot {
        &self.load
    }

    /// The prefix cache's counters for a load report: `(prompt tokens looked up, found,
    /// blocks evicted, blocks cached now)`.
    pub fn prefix_counts(&self) -> (u64, u64, u64, u32) {
        let (evictions, cached) = self.pool.cache_counts();
        (
            self.load.prefix_query_tokens.load(Ordering::Relaxed),
            self.load.prefix_hit_tokens.load(Ordering::Relaxed),
            evictions,
            u32::try_from(cached).unwrap_or(u32::MAX),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn channels() -> (
        tmpsc::UnboundedSender<SeqEvent>,
        oneshot::Sender<Result<SeqId, EngineError>>,
    ) {
        (tmpsc::unbounded_channel().0, oneshot::channel().0)
    }

    fn add(prompt: usize, n: usize) -> Command {
        let (events, reply) = channels();
        let sampling = SamplingParams {
            n,
            ..SamplingParams::greedy()
        };
        Command::Add {
            prompt: vec![7; prompt],
            sampling,
            stop: StopParams::default(),
            guide: None,
            kv: None,
            tpot_target: None,
            events,
            reply,
        }
    }

    fn prefilled(prompt: usize, part: PrefilledPart) -> Command {
        let (events, reply) = channels();
        Command::AddPrefilled {
            prompt: vec![7; prompt],
            part,
            kv: ReceivedKv::host(Vec::new()),
            sampling: SamplingParams::greedy(),
            stop: StopParams::default(),
            guide: None,
            tpot_target: None,
            events,
            reply,
        }
    }

    #[test]
    fn the_pass_under_way_reports_how_long_it_has_run() {
        let load = LoadSnapshot::default();
        assert_eq!(load.pass_elapsed_ms(), 0.0, "between passes");
        load.pass_under_way(true);
        std::thread::sleep(Duration::from_millis(20));
        let elapsed = load.pass_elapsed_ms();
        assert!((20.0..10_000.0).contains(&elapsed), "{elapsed}");
        load.pass_under_way(false);
        assert_eq!(load.pass_elapsed_ms(), 0.0);
    }

    #[test]
    fn commands_count_in_the_load_until_the_engine_takes_them() {
        let load = LoadSnapshot::default();
        // An aggregated request of two choices: a prompt to compute (its streams come after).
        let aggregated = add(100, 2);
        // A prompt computed elsewhere up to block 64: the rest is a prompt to compute.
        let split = prefilled(100, PrefilledPart::Prefix(64));
        // A prompt computed elsewhere whole: a stream of its context, at once.
        let whole = prefilled(100, PrefilledPart::Whole(Vec::new()));
        for cmd in [&aggregated, &split, &whole] {
            load.enter_inbox(cmd.inbox_share());
        }
        let expected = InboxShare {
            prompt_tokens: 100 + 36,
            prompts: 2,
            streams: 1,
            context_tokens: 100,
        };
        assert_eq!(load.inbox(), expected);
        for cmd in [&aggregated, &split, &whole] {
            take_from_inbox(&load, cmd);
        }
        assert_eq!(load.inbox(), InboxShare::default());
    }
}
