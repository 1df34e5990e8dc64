//! Step pacing: what the engine thread learns from its own passes and what it does with it.
//! Every pass is timed and fitted into a cost model (`tandem_cost`), published for the load
//! report (the router predicts with it); and when streams with a TPOT target are decoding,
//! the prompt chunks that join their passes are sized so that every stream's time per token
//! stays within its target on average (`tandem_cost::Pacing`): the decode worker lends its
//! streams' slack to prompts instead of stalling them (Sarathi-Serve's stall-free batching).
//! Each stream's standing is kept here, by its clock since it was first seen decoding. With
//! `lend_slack`, a pass of decode rows alone is followed by the rest of the streams' period
//! idle while some other thread of the host waits for a CPU (an idle-priority prefill worker
//! on the same cores), which then computes in it.
//!
//! The fit is kept in milliseconds of the whole compute team: a pass run while the router's
//! elastic planner lets only some of the threads take part is scaled by their share (as if
//! compute-bound), so the model a router reads, and the chunk sizes here, do not change
//! meaning when threads move.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tandem_cost::{Coefficients, CostFit, Pacing, Standing};
use tandem_engine::{Engine, SeqId};
use tandem_proto::v1::StepCost;

/// What the engine thread publishes after each pass for the load report.
#[derive(Debug, Default)]
pub struct CostBoard(Mutex<StepCost>);

impl CostBoard {
    /// The latest figures.
    pub fn report(&self) -> StepCost {
        self.0.lock().map(|g| *g).unwrap_or_default()
    }

    fn publish(&self, cost: StepCost) {
        if let Ok(mut g) = self.0.lock() {
            *g = cost;
        }
    }
}

/// The engine thread's fit, its pacing and the allowance it last set.
#[derive(Debug, Default)]
pub struct Pacer {
    /// Idle out the rest of the streams' period after a pass of decode rows alone.
    lend_slack: bool,
    fit: CostFit,
    coefficients: Coefficients,
    pacing: Pacing,
    allowance: Option<usize>,
    /// Whether the last pass decoded streams with a target.
    paced: bool,
    /// When each stream decoding here was first seen, and what it had generated then.
    clocks: HashMap<SeqId, StreamClock>,
    /// When the current window of CPU stall time began, and the stall time then (see
    /// [`cpu_stall_us`]).
    stall_window: Option<(Instant, u64)>,
    /// What the last window said: someone else wants the CPU.
    someone_waits: bool,
    /// The least lead of the streams with a target on their aims, and on the targets
    /// themselves, as of the last pass.
    streams_lead_ms: f64,
    streams_target_lead_ms: f64,
}

/// Where a stream's standing is measured from.
#[derive(Debug, Clone, Copy)]
struct StreamClock {
    since: Instant,
    generated: usize,
}

/// The longest TPOT target a worker paces to, whatever a request asks: a lending worker
/// idles up to 0.9 of it after each pass.
pub const MAX_TPOT_TARGET: Duration = Duration::from_secs(10);

/// The longest a start-up calibration adds work for (a large model on a small CPU stops
/// early, with what it has fitted so far).
const CALIBRATION_BUDGET: Duration = Duration::from_secs(20);

/// What a calibration pass weighs in the fit against a real one: alone they price every
/// shape; beside a few real passes those set the level (a prefill worker at idle priority
/// computes far slower beside a busy decode worker than it calibrated alone).
const CALIBRATION_WEIGHT: f64 = 0.05;

/// The shortest window over which CPU stall time is judged (the kernel's figures move in
/// scheduler ticks).
const STALL_WINDOW: Duration = Duration::from_millis(20);
/// The share of a window that other threads must have waited for a CPU to be lent slack.
const STALL_SHARE: f64 = 0.05;

impl Pacer {
    pub fn new(lend_slack: bool) -> Self {
        Self {
            lend_slack,
            someone_waits: true,
            ..Self::default()
        }
    }

    /// Fits the cost model to a few made-up passes before any request (see
    /// `tandem_engine::Engine::calibrate`), so that the first load report already prices
    /// prompts and decode steps; `prompt_tokens` 0 skips it. A failure is logged and leaves
    /// the fit to the real passes.
    pub fn calibrate(&mut self, engine: &mut Engine, prompt_tokens: usize, board: &CostBoard) {
        if prompt_tokens == 0 {
            return;
        }
        let share = team_share();
        let fit = &mut self.fit;
        let run = engine.calibrate(prompt_tokens, CALIBRATION_BUDGET, &mut |shape, elapsed| {
            fit.observe_weighted(
                shape,
                elapsed.as_secs_f64() * 1e3 * share,
                CALIBRATION_WEIGHT,
            );
        });
        self.coefficients = self.fit.coefficients();
        match run {
            Ok(run) => {
                let c = self.coefficients;
                tracing::info!(
                    passes = run.passes,
                    prompt_tokens = run.prompt_tokens,
                    seconds = run.elapsed.as_secs_f64(),
                    base_ms = c.base_ms,
                    per_row_ms = c.per_row_ms,
                    per_token_ms = c.per_token_ms,
                    per_mpair_ms = c.per_mpair_ms,
                    "cost model calibrated"
                );
            }
            Err(e) => {
                tracing::warn!(error = %e, "calibration failed; the cost model learns from requests")
            }
        }
        self.publish(engine, board);
    }

    /// Before a pass: caps the prompt tokens beside decode rows so that every stream with a
    /// target (`target_of` its request) stays within it (see `tandem_cost::Pacing`); with
    /// no such stream, a pass of prompts alone to `tandem_cost::LONGEST_PASS_TARGETS` of the
    /// `tightest` target of the requests here (a new stream's prompt may arrive meanwhile);
    /// lifts the cap when no request has a target or the fit cannot price a prompt token.
    pub fn before_pass(
        &mut self,
        engine: &mut Engine,
        target_of: &dyn Fn(SeqId) -> Option<Duration>,
        tightest: Option<Duration>,
    ) {
        let standings = self.standings(engine, target_of, Instant::now());
        self.paced = !standings.is_empty();
        self.streams_lead_ms = tandem_cost::least_lead_ms(&standings).unwrap_or(0.0);
        self.streams_target_lead_ms = tandem_cost::least_target_lead_ms(&standings).unwrap_or(0.0);
        let (decode, prompt_at) = engine.decode_load();
        let share = team_share();
        // The fit prices the whole team's milliseconds; the standings are wall time.
        let streams_ms = self.coefficients.step_ms(&decode) / share;
        let budget = tandem_cost::pass_budget(&standings, streams_ms);
        let knows_prompts = self.fit.prompt_tokens_seen() >= tandem_cost::MIN_PROMPT_TOKENS_SEEN;
        let pending: Vec<u64> = match (knows_prompts, budget) {
            (true, Some(_)) => engine
                .pending_prompts()
                .into_iter()
                .map(|tokens| tokens as u64)
                .collect(),
            _ => Vec::new(),
        };
        let waiting = tandem_cost::Waiting {
            start: prompt_at,
            pending: &pending,
            max: engine.config().max_batch_tokens as u64,
            granule: tandem_kv::BLOCK_SIZE as u64,
        };
        let tokens = match budget {
            _ if !knows_prompts => None,
            None => tightest.map(|target| {
                let target_ms = target.as_secs_f64() * 1e3 * share;
                tandem_cost::lone_pass_allowance(&self.coefficients, target_ms, &waiting)
            }),
            Some(budget) => Some(self.pacing.allowance(
                &self.coefficients,
                decode,
                tandem_cost::PassBudget {
                    paced_ms: budget.paced_ms * share,
                    limit_ms: budget.limit_ms * share,
                },
                &waiting,
            )),
        };
        let allowance = tokens.map(|t| usize::try_from(t).unwrap_or(usize::MAX));
        if allowance != self.allowance {
            tracing::trace!(?allowance, ?budget, "prompt allowance beside decode rows");
            self.allowance = allowance;
            engine.set_prompt_allowance(allowance);
        }
    }

    /// The standings of the streams the next pass decodes that have a target, at `now`;
    /// starts the clocks of new streams and forgets those gone.
    fn standings(
        &mut self,
        engine: &Engine,
        target_of: &dyn Fn(SeqId) -> Option<Duration>,
        now: Instant,
    ) -> Vec<Standing> {
        let streams = engine.decode_streams();
        let decoding: HashSet<SeqId> = streams.iter().map(|stream| stream.id).collect();
        self.clocks.retain(|id, _| decoding.contains(id));
        streams
            .iter()
            .filter_map(|stream| {
                let clock = *self.clocks.entry(stream.id).or_insert(StreamClock {
                    since: now,
                    generated: stream.generated,
                });
                let target = target_of(stream.request)?;
                Some(Standing {
                    target_ms: target.as_secs_f64() * 1e3,
                    tokens: stream.generated.saturating_sub(clock.generated) as u64,
                    elapsed_ms: now.saturating_duration_since(clock.since).as_secs_f64() * 1e3,
                    remaining: stream.remaining as u64,
                })
            })
            .collect()
    }

    /// After a pass that took `elapsed`: fits it and publishes the model and the decode work
    /// now under way on `board`. Returns how long to stay idle when lending slack: the rest
    /// of the streams' period after a pass of decode rows alone with no prompt waiting here
    /// (a prompt here takes that time as a chunk instead), no more than any stream's lead.
    pub fn after_pass(
        &mut self,
        engine: &Engine,
        elapsed: Duration,
        target_of: &dyn Fn(SeqId) -> Option<Duration>,
        board: &CostBoard,
    ) -> Option<Duration> {
        let ms = elapsed.as_secs_f64() * 1e3;
        let share = team_share();
        let pass = engine.last_pass();
        tracing::trace!(
            ms,
            predicted_ms = self.coefficients.step_ms(&pass) / share,
            rows = pass.sampled_rows,
            prompt_tokens = pass.other_tokens,
            attention_mpairs = pass.attention_mpairs,
            "pass"
        );
        self.fit.observe(&pass, ms * share);
        self.coefficients = self.fit.coefficients();
        self.publish(engine, board);
        let lends = self.paced
            && self.lend_slack
            && pass.other_tokens == 0.0
            && engine.num_waiting() == 0
            && engine.pending_prefill_tokens() == 0
            && self.someone_waits();
        if !lends {
            return None;
        }
        let standings = self.standings(engine, target_of, Instant::now());
        let idle_ms = tandem_cost::idle_ms(&standings, ms);
        (idle_ms > 0.0).then(|| Duration::from_secs_f64(idle_ms / 1e3))
    }

    /// Whether other threads on this host want the CPU: over the last window of at least
    /// [`STALL_WINDOW`], runnable threads waited for a CPU at least [`STALL_SHARE`] of the
    /// time (a co-located idle-priority worker with work waits through every pass). Slack
    /// is lent only to someone who wants it, else the streams run as fast as they can.
    /// Without the kernel's pressure figures, always; before the first window, too.
    fn someone_waits(&mut self) -> bool {
        let Some(stall_us) = cpu_stall_us() else {
            return true;
        };
        let now = Instant::now();
        match self.stall_window {
            Some((since, _)) if now - since < STALL_WINDOW => {}
            Some((since, before_us)) => {
                let waited = stall_us.saturating_sub(before_us) as f64;
                let wall = (now - since).as_secs_f64() * 1e6;
                self.someone_waits = waited >= STALL_SHARE * wall;
                self.stall_window = Some((now, stall_us));
            }
            None => self.stall_window = Some((now, stall_us)),
        }
        self.someone_waits
    }

    /// Publishes the model and the decode work under way (also when idle: the rows left).
    pub fn publish(&self, engine: &Engine, board: &CostBoard) {
        let (decode, _) = engine.decode_load();
        let c = self.coefficients;
        board.publish(StepCost {
            base_ms: c.base_ms,
            per_row_ms: c.per_row_ms,
            per_token_ms: c.per_token_ms,
            per_mpair_ms: c.per_mpair_ms,
            passes: self.fit.passes(),
            prompt_tokens_seen: self.fit.prompt_tokens_seen(),
            decode_rows: decode.sampled_rows as u32,
            decode_context_tokens: (decode.attention_mpairs * 1e6).round() as u64,
            max_batch_tokens: u32::try_from(engine.config().max_batch_tokens).unwrap_or(u32::MAX),
            prompt_allowance: self
                .allowance
                .map_or(0, |a| u32::try_from(a).unwrap_or(u32::MAX)),
            // The load report fills it in (see `actor::LoadSnapshot`).
            pass_elapsed_ms: 0.0,
            lends_slack: self.lend_slack,
            streams_lead_ms: self.streams_lead_ms,
            streams_target_lead_ms: self.streams_target_lead_ms,
        });
    }
}

/// The share of the CPU engine's compute team taking part now (1 when all do, and on a GPU,
/// whose engine never shrinks it).
fn team_share() -> f64 {
    tandem_engine::backend::cpu::kernels::team::active_share()
}

/// Microseconds that some runnable thread of this host has waited for a CPU since boot (the
/// `some total` of Linux's pressure-stall information), or `None` where it cannot be read.
fn cpu_stall_us() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/pressure/cpu").ok()?;
    text.lines()
        .find(|l| l.starts_with("some "))?
        .split_whitespace()
        .find_map(|field| field.strip_prefix("total="))?
        .parse()
        .ok()
}
