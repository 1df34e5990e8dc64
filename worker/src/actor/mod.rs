//! The engine actor: one thread owns the [`Engine`] and runs its steps; request handlers talk
//! to it through an [`EngineHandle`] (commands in, per-sequence events out).
//!
//! Shaped after TGI's queue actor: commands on a channel, the state owned by the loop. A
//! sequence lives as long as its event channel: when the handler that reads it goes away
//! (client cancelled, RPC dropped), the actor aborts the sequence before the next step and
//! its blocks go back to the pool. A prefill sequence may carry a [`KvSender`]: the actor
//! hands it every layer's blocks from inside the forward pass, and gives it back with the
//! first token (of every choice, for `n > 1`) so the handler can commit. A request of `n`
//! choices has one entry and one event channel; its events name their choice.

mod handle;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use tandem_engine::ChunkInfo;
use tandem_engine::{Engine, SeqId, StepOutput};
use tandem_kv::KvCache;
use tokio::sync::mpsc as tmpsc;

use crate::pacing::Pacer;
use tandem_transfer::{KvSender, PulledPrefix};

use handle::Command;
pub use handle::{EngineHandle, KvShipment, LoadSnapshot, PrefilledPart, SeqEvent};

struct Entry {
    events: tmpsc::UnboundedSender<SeqEvent>,
    /// Choices still generating (the entry goes with the last).
    open: usize,
    /// A prefill request's first tokens so far (all arrive in the step that samples them).
    firsts: Vec<StepOutput>,
    kv: Option<Box<dyn KvSender>>,
    /// The first logical block the decode side reads (a sliding-window model's earlier blocks
    /// are not shipped); the lease numbers its blocks from there.
    kv_first: usize,
    kv_error: Option<String>,
    added: Instant,
    first_run: Option<Instant>,
    /// The step in which its first chunk ran: that step also ships the prompt's blocks
    /// before the chunk (a prefix the engine found cached and did not compute).
    first_step: Option<u64>,
    /// The stream's TPOT target (decode-side sequences), which paces prompt chunks.
    tpot_target: Option<Duration>,
}

impl Entry {
    fn new(
        events: tmpsc::UnboundedSender<SeqEvent>,
        open: usize,
        kv: Option<Box<dyn KvSender>>,
        kv_first: usize,
        tpot_target: Option<Duration>,
    ) -> Self {
        Self {
            events,
            open,
            firsts: Vec::new(),
            kv,
            kv_first,
            kv_error: None,
            added: Instant::now(),
            first_run: None,
            first_step: None,
            tpot_target,
        }
    }
}

/// How the engine thread runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineThreadOptions {
    /// Pace decode passes to the streams' TPOT targets, idle in between (see `pacing`).
    pub lend_slack: bool,
    /// Prompt tokens of made-up work to fit the cost model to before the first request
    /// (`Pacer::calibrate`; 0: none, the model learns from requests alone).
    pub calibration_tokens: usize,
}

/// Starts the engine thread. It ends when every handle is dropped. Requests sent while it
/// calibrates wait for it (a worker serves once [`EngineHandle::calibrated`]).
pub fn spawn_engine(engine: Engine, options: EngineThreadOptions) -> std::io::Result<EngineHandle> {
    let (tx, rx) = mpsc::channel();
    let load = Arc::new(LoadSnapshot::default());
    let (calibrated_tx, calibrated) = tokio::sync::watch::channel(false);
    let handle = EngineHandle {
        tx,
        prefix_salt: engine.prefix_salt(),
        imports_prefix_kv: engine.imports_prefix_kv(),
        pool: engine.shared_pool(),
        load: load.clone(),
        guides: engine.guides(),
        on_cpu: engine.config().device == tandem_engine::Device::Cpu,
        calibrated,
    };
    std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || run(engine, rx, &load, options, &calibrated_tx))?;
    Ok(handle)
}

fn run(
    mut engine: Engine,
    rx: mpsc::Receiver<Command>,
    load: &LoadSnapshot,
    options: EngineThreadOptions,
    calibrated: &tokio::sync::watch::Sender<bool>,
) {
    let mut entries: HashMap<SeqId, Entry> = HashMap::new();
    let mut pacer = Pacer::new(options.lend_slack);
    pacer.calibrate(&mut engine, options.calibration_tokens, &load.cost);
    calibrated.send_replace(true);
    loop {
        // Block while idle; otherwise take whatever arrived since the last step.
        if !engine.has_work() {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(cmd) => handle_command(&mut engine, &mut entries, load, cmd),
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        while let Ok(cmd) = rx.try_recv() {
            handle_command(&mut engine, &mut entries, load, cmd);
        }
        // Cancelled requests leave before the step, so their blocks are free for it.
        let cancelled: Vec<SeqId> = entries
            .iter()
            .filter(|(_, e)| e.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in cancelled {
            engine.abort(id);
            entries.remove(&id);
            tracing::debug!(seq = id, "request went away; aborted");
        }
        // Published before the pass as well as after it: the commands just taken left the
        // inbox count, and a pass may take seconds.
        publish(&engine, load);
        pacer.publish(&engine, &load.cost);
        if !engine.has_work() {
            continue;
        }
        let tightest = entries
            .keys()
            .filter_map(|&request| tpot_target(&entries, request))
            .min();
        pacer.before_pass(
            &mut engine,
            &|request| tpot_target(&entries, request),
            tightest,
        );
        let now = Instant::now();
        // A GPU engine stages prompt KV on the host only for senders that read host bytes.
        let device_kv = engine.device_kv();
        engine.set_host_kv_export(
            entries
                .values()
                .any(|e| e.kv.as_ref().is_some_and(|kv| !kv.reads_device())),
        );
        let step = engine.stats().steps;
        let started = Instant::now();
        load.pass_under_way(true);
        let result =
            engine.step_with(&mut |layer: usize, cache: &KvCache, chunks: &[ChunkInfo]| {
                for chunk in chunks {
                    let Some(entry) = entries.get_mut(&chunk.id) else {
                        continue;
                    };
                    entry.first_run.get_or_insert(now);
                    // A cancelled request stops writing at once (its lease may already be gone).
                    if entry.events.is_closed() || entry.kv_error.is_some() {
                        continue;
                    }
                    let Some(kv) = entry.kv.as_mut() else {
                        continue;
                    };
                    // Logical blocks the decode side reads, numbered as its lease numbers them:
                    // this chunk's, and with the first chunk every block before it (a cached
                    // prefix the engine did not compute).
                    let first = entry.kv_first;
                    let blocks = chunk.logical_blocks();
                    let from = if *entry.first_step.get_or_insert(step) == step {
                        0
                    } else {
                        blocks.start
                    };
                    let shipped = (from..blocks.end)
                        .filter(|&lb| lb >= first)
                        .map(|lb| ((lb - first) as u32, chunk.blocks[lb]));
                    if kv.reads_device() {
                        let sent = match &device_kv {
                            Some(src) => {
                                let pairs: Vec<(u32, u32)> = shipped.collect();
                                kv.send_device_layer(layer, src, &pairs)
                            }
                            None => Err(tandem_transfer::TransferError::Protocol(
                                "this transport copies device memory; the engine runs on the CPU"
                                    .into(),
                            )),
                        };
                        if let Err(e) = sent {
                            entry.kv_error = Some(e.to_string());
                        }
                        continue;
                    }
                    let mut pieces = Vec::with_capacity(chunk.logical_blocks().len());
                    for (lb, block) in shipped {
                        match cache.block_layer_bytes(layer, block) {
                            Ok(bytes) => pieces.push((lb, bytes)),
                            Err(e) => {
                                entry.kv_error = Some(e.to_string());
                                break;
                            }
                        }
                    }
                    if entry.kv_error.is_none()
                        && let Err(e) = kv.send_layer(layer, &pieces)
                    {
                        entry.kv_error = Some(e.to_string());
                    }
                }
            });
        load.pass_under_way(false);
        let lent = if engine.stats().steps > step {
            pacer.after_pass(
                &engine,
                started.elapsed(),
                &|request| tpot_target(&entries, request),
                &load.cost,
            )
        } else {
            None
        };
        match result {
            Ok(outputs) => {
                for out in outputs {
                    deliver(&mut engine, &mut entries, out);
                }
            }
            Err(e) => {
                // A failed forward pass fails every sequence in flight rather than the worker.
                tracing::error!(error = %e, "forward pass failed");
                for (id, entry) in entries.drain() {
                    engine.abort(id);
                    let _ = entry
                        .events
                        .send(SeqEvent::Failed(format!("engine error: {e}")));
                }
            }
        }
        let failed: Vec<SeqId> = entries
            .iter()
            .filter(|(_, e)| e.kv_error.is_some())
            .map(|(&id, _)| id)
            .collect();
        for id in failed {
            engine.abort(id);
            if let Some(entry) = entries.remove(&id) {
                let reason = entry.kv_error.unwrap_or_default();
                tracing::warn!(seq = id, %reason, "KV transfer failed");
                let _ = entry.events.send(SeqEvent::TransferFailed(format!(
                    "KV transfer failed: {reason}"
                )));
            }
        }
        publish(&engine, load);
        // The rest of the streams' period is lent to whoever shares these cores; a new
        // request ends it early.
        if let Some(idle) = lent {
            match rx.recv_timeout(idle) {
                Ok(cmd) => handle_command(&mut engine, &mut entries, load, cmd),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
    }
}

fn handle_command(
    engine: &mut Engine,
    entries: &mut HashMap<SeqId, Entry>,
    load: &LoadSnapshot,
    cmd: Command,
) {
    handle::take_from_inbox(load, &cmd);
    match cmd {
        Command::Add {
            prompt,
            sampling,
            stop,
            guide,
            kv,
            tpot_target,
            events,
            reply,
        } => {
            let window_first = engine.model().config().first_needed_block(prompt.len());
            let (kv, kv_first) = match kv {
                Some(s) => {
                    if let Some(pulled) = s.pulled {
                        import_pulled(engine, &prompt, &pulled);
                    }
                    (Some(s.sender), s.first_block.max(window_first))
                }
                None => (None, window_first),
            };
            let open = sampling.n;
            // A device engine's host cache holds only the blocks a pass brings down: a
            // transport that sends host bytes could not send a cached prefix, so such a
            // prompt is computed whole (device transports copy from the device pool).
            let host_copy_of_device_kv = !engine.host_cache_is_kv()
                && kv.as_ref().is_some_and(|sender| !sender.reads_device());
            let result = engine.add_request_guided(prompt, sampling, stop, guide);
            if let Ok(id) = result {
                if host_copy_of_device_kv {
                    engine.compute_whole_prompt(id);
                }
                entries.insert(id, Entry::new(events, open, kv, kv_first, tpot_target));
            }
            let _ = reply.send(result);
        }
        Command::AddPrefilled {
            prompt,
            part,
            kv,
            sampling,
            stop,
            guide,
            tpot_target,
            events,
            reply,
        } => {
            // Choices still running need an entry: with the whole prompt, those whose first
            // token (streamed by the caller already) did not finish them; else every one.
            let admitted = match part {
                PrefilledPart::Whole(firsts) => engine
                    .add_prefilled(prompt, firsts, kv, sampling, stop, guide)
                    .map(|(id, firsts)| (id, firsts.iter().filter(|o| o.finish.is_none()).count())),
                PrefilledPart::Prefix(computed) => {
                    let open = sampling.n;
                    engine
                        .add_partly_prefilled(prompt, computed, kv, sampling, stop, guide)
                        .map(|id| (id, open))
                }
            };
            let result = admitted.map(|(id, open)| {
                if open > 0 {
                    entries.insert(id, Entry::new(events, open, None, 0, tpot_target));
                }
                id
            });
            let _ = reply.send(result);
        }
    }
}

/// Puts a pulled prefix into the cache (in the same command as the prompt it serves, so no
/// step runs between them). A failure costs only compute: the prompt then runs those blocks.
fn import_pulled(engine: &mut Engine, prompt: &[u32], pulled: &PulledPrefix) {
    match engine.import_cached_prefix(prompt, pulled.first, &pulled.data) {
        Ok(n) if n < pulled.blocks => {
            tracing::debug!(
                pulled = pulled.blocks,
                imported = n,
                "part of the pulled prefix was cached already or found no room"
            )
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "the pulled prefix could not join the cache"),
    }
}

fn deliver(engine: &mut Engine, entries: &mut HashMap<SeqId, Entry>, out: StepOutput) {
    let id = out.request;
    let finished = out.finish.is_some();
    let Some(entry) = entries.get_mut(&id) else {
        return;
    };
    if entry.kv_error.is_some() {
        // Its KV did not all go out: the step's failure sweep reports it, never a commit.
        return;
    }
    let event = if entry.kv.is_some() {
        // A prefill request: its first tokens (one per choice, all from this step) complete
        // the prompt; the sender commits them.
        entry.firsts.push(out);
        if entry.firsts.len() < entry.open {
            return;
        }
        let now = Instant::now();
        let first_run = entry.first_run.unwrap_or(now);
        // Whatever did not end at its first token stops here (the decode side goes on).
        engine.abort(id);
        entries.remove(&id).and_then(|mut e| {
            let sender = e.kv.take()?;
            e.firsts.sort_by_key(|o| o.choice);
            let mut firsts = e.firsts.into_iter();
            let output = firsts.next()?;
            Some((
                e.events,
                SeqEvent::Prefilled {
                    output,
                    others: firsts.collect(),
                    sender,
                    queue_seconds: first_run.duration_since(e.added).as_secs_f64(),
                    compute_seconds: now.duration_since(first_run).as_secs_f64(),
                },
            ))
        })
    } else {
        let ev = SeqEvent::Token(out);
        if finished {
            entry.open = entry.open.saturating_sub(1);
        }
        if entry.open == 0 {
            entries.remove(&id).map(|e| (e.events, ev))
        } else {
            Some((entry.events.clone(), ev))
        }
    };
    if let Some((events, ev)) = event {
        // A closed channel is handled before the next step.
        let _ = events.send(ev);
    }
}

/// The TPOT target of a request decoding here (a prefill-side sequence has none to keep).
fn tpot_target(entries: &HashMap<SeqId, Entry>, request: SeqId) -> Option<Duration> {
    entries
        .get(&request)
        .filter(|e| e.kv.is_none())
        .and_then(|e| e.tpot_target)
}

fn publish(engine: &Engine, load: &LoadSnapshot) {
    load.running
        .store(engine.num_running() as u64, Ordering::Relaxed);
    load.waiting
        .store(engine.num_waiting() as u64, Ordering::Relaxed);
    load.queued_prefill_tokens
        .store(engine.pending_prefill_tokens() as u64, Ordering::Relaxed);
    load.queued_prompts
        .store(engine.pending_prefill_prompts() as u64, Ordering::Relaxed);
    load.steps.store(engine.stats().steps, Ordering::Relaxed);
    load.preemptions
        .store(engine.stats().preemptions, Ordering::Relaxed);
    load.prefix_query_tokens
        .store(engine.stats().prefix_query_tokens, Ordering::Relaxed);
    load.prefix_hit_tokens
        .store(engine.stats().prefix_hit_tokens, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_engine::config::{ModelConfig, WeightFormat};
    use tandem_engine::model::dummy_model;
    use tandem_engine::{EngineConfig, Model, SamplingParams, StopParams};
    use tandem_kv::DeviceKv;
    use tandem_text::TextTokenizer;
    use tandem_transfer::{FirstToken, SendFuture, TransferError};

    /// A sender that only takes device memory (as `cuda-ipc` does).
    struct DeviceOnly;

    impl KvSender for DeviceOnly {
        fn send_layer(&mut self, _: usize, _: &[(u32, &[u8])]) -> Result<(), TransferError> {
            panic!("a device sender must never be handed host bytes");
        }
        fn reads_device(&self) -> bool {
            true
        }
        fn send_device_layer(
            &mut self,
            _: usize,
            _: &DeviceKv,
            _: &[(u32, u32)],
        ) -> Result<(), TransferError> {
            panic!("a CPU engine has no device pool to send from");
        }
        fn commit(self: Box<Self>, _: FirstToken) -> SendFuture {
            Box::pin(async { Err(TransferError::Protocol("not reached".into())) })
        }
    }

    #[tokio::test]
    async fn a_device_transfer_on_a_cpu_engine_fails_its_request_and_frees_its_blocks() {
        let model: Arc<Model> = Arc::new(
            dummy_model(
                ModelConfig::preset("tiny").unwrap(),
                WeightFormat::F32,
                0,
                "tiny",
            )
            .unwrap(),
        );
        let config = EngineConfig {
            kv_budget_bytes: 32 * model.kv_layout().block_bytes(),
            ..Default::default()
        };
        let engine = Engine::new(model, TextTokenizer::byte_level(), config).unwrap();
        let handle = spawn_engine(engine, EngineThreadOptions::default()).unwrap();
        let (events, mut rx) = tmpsc::unbounded_channel();
        let stop = StopParams {
            max_tokens: 1,
            ..Default::default()
        };
        handle
            .add(
                vec![5; 40],
                SamplingParams::greedy(),
                stop,
                Some(KvShipment {
                    sender: Box::new(DeviceOnly),
                    first_block: 0,
                    pulled: None,
                }),
                None,
                events,
            )
            .await
            .unwrap();
        let event = tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await
            .unwrap()
            .unwrap();
        match event {
            SeqEvent::TransferFailed(why) => assert!(why.contains("runs on the CPU"), "{why}"),
            other => panic!("expected a failure, got {other:?}"),
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while handle.pool().free_count() != handle.pool().total() {
            assert!(Instant::now() < deadline, "blocks were not freed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
