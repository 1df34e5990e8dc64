//! The elastic thread planner (`--elastic-threads`): for a deployment whose workers share one
//! host's cores (`tandem up` on one machine, the prefill worker at idle priority), moves CPU
//! compute threads between the decode and prefill workers at their next parallel region.
//!
//! A decode worker keeps the fewest threads whose predicted step meets the TPOT target (with
//! the pacing headroom) for its streams and for those the prompts queued there become,
//! while a prefill worker has prompts queued, and gets them all back
//! when none has; the prefill workers share what the decode workers leave (at least one
//! each), or every core when the decode workers need them all (the prefill workers then run
//! only in the slack the decode workers lend between passes). Two workers whose teams both
//! span every core while the streams leave some free would contend in every parallel
//! region, the idle-priority one a straggler its own regions wait for. Workers
//! publish their step costs for their whole team (`tandem-worker`'s pacer), so a step at `d`
//! of `m` threads is predicted as `m / d` times the fitted cost: compute-bound work scales
//! so, a memory-bound step does better, and the planner errs towards more decode threads.
//! Each move is logged and counted (`tandem_router_compute_thread_moves_total`), and each
//! worker's planned threads exported (`tandem_router_compute_threads`).

use std::sync::Arc;
use std::time::Duration;

use tandem_cost::TPOT_HEADROOM;
use tokio_util::sync::CancellationToken;

use super::{Worker, WorkerPool, WorkerRole};
use crate::metrics as m;

/// How often the plan is remade from the latest reports and dispatches.
pub const PLAN_INTERVAL: Duration = Duration::from_millis(100);

/// What the planner knows of one worker.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ThreadView {
    /// Threads its team has (the most it can take part with).
    pub max_threads: u32,
    /// Decode workers: the predicted step on the whole team of the streams under way and
    /// of those its queued prompts become, in ms (`None`: no fitted cost yet).
    pub full_team_step_ms: Option<f64>,
    /// Decode workers: streams decoding and prompts queued there to become streams.
    /// Prefill workers: prompt tokens queued or computing.
    pub work: u64,
}

/// Threads for each decode worker and then each prefill worker, in the order given.
pub fn plan(decode: &[ThreadView], prefill: &[ThreadView], tpot_target_ms: f64) -> Vec<u32> {
    let cores = decode
        .iter()
        .chain(prefill)
        .map(|v| v.max_threads)
        .max()
        .unwrap_or(1)
        .max(1);
    let prompts_wait = prefill.iter().any(|p| p.work > 0);
    let budget_ms = tpot_target_ms * TPOT_HEADROOM;
    // What each decode worker needs to keep its streams within the target.
    let needs: Vec<u32> = decode
        .iter()
        .map(|d| {
            let max = d.max_threads.max(1);
            match d.full_team_step_ms {
                _ if d.work == 0 => 1,
                Some(step) if step.is_finite() && step > 0.0 => (1..=max)
                    .find(|&n| step * f64::from(max) / f64::from(n) <= budget_ms)
                    .unwrap_or(max),
                _ => max,
            }
        })
        .collect();
    // A decode worker with no streams keeps one thread, which then idles: it takes no core.
    let decode_used: u32 = decode
        .iter()
        .zip(&needs)
        .filter(|(d, _)| d.work > 0)
        .map(|(_, &n)| n)
        .sum();
    let busy_prefill = prefill.iter().filter(|p| p.work > 0).count().max(1) as u32;
    // When the streams' passes take every core, the prefill workers compute only in the
    // slack the decode workers lend between passes, when every core is free: a team of one
    // would leave the others idle through each lent period (on 2 cores, a quarter of the
    // machine at 16 streams). No team straddles a core the streams run on then, so none
    // waits on a straggler.
    let free_cores = if decode_used >= cores {
        cores
    } else {
        cores - decode_used
    };
    let prefill_share = (free_cores / busy_prefill).max(1);
    let mut out: Vec<u32> = decode
        .iter()
        .zip(&needs)
        .map(|(d, &need)| {
            if prompts_wait {
                need
            } else {
                d.max_threads.max(1)
            }
        })
        .collect();
    out.extend(
        prefill
            .iter()
            .map(|p| prefill_share.min(p.max_threads.max(1))),
    );
    out
}

impl ThreadView {
    /// The view of `worker` from its last report and what was sent to it since; `None`
    /// before it reported a CPU team.
    fn of(worker: &Worker) -> Option<Self> {
        let load = worker.load_report()?;
        if load.max_compute_threads == 0 {
            return None;
        }
        let cost = worker.cost_view();
        // The view prices the worker's current share of its team; back to the whole team.
        let share = match load.compute_threads {
            0 => 1.0,
            n => f64::from(n.min(load.max_compute_threads)) / f64::from(load.max_compute_threads),
        };
        let (full_team_step_ms, work) = match worker.role {
            // The streams to come, not only those decoding: when a wave of streams ends
            // and the next wave's prompts are queued here, the few rows left would let a
            // thread go just as the new wave needs it (on 2 cores, its prompts then trickled
            // in a granule a pass, past their TTFT).
            WorkerRole::Decode => (
                cost.as_ref()
                    .filter(|c| c.coefficients.is_fitted())
                    .map(|c| share * c.coefficients.step_ms(&c.streams_to_come())),
                cost.as_ref().map_or(u64::from(load.running), |c| {
                    c.decode_rows.saturating_add(c.prompt_rows)
                }),
            ),
            WorkerRole::Prefill => (
                None,
                cost.as_ref()
                    .map_or(load.queued_prefill_tokens, |c| c.queued_prompt_tokens),
            ),
        };
        Some(Self {
            max_threads: load.max_compute_threads,
            full_team_step_ms,
            work,
        })
    }
}

impl WorkerPool {
    /// Remakes the plan every [`PLAN_INTERVAL`] until `shutdown`; a worker whose threads
    /// change is polled at once, which carries the new number to it.
    pub fn spawn_thread_planner(
        self: &Arc<Self>,
        tpot_target_ms: f64,
        shutdown: &CancellationToken,
    ) {
        let pool = Arc::clone(self);
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(PLAN_INTERVAL);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = ticker.tick() => pool.plan_threads(tpot_target_ms),
                }
            }
        });
    }

    fn plan_threads(&self, tpot_target_ms: f64) {
        let views = |role| {
            self.workers(role)
                .into_iter()
                .filter(|w| w.is_routable())
                .filter_map(|w| ThreadView::of(&w).map(|v| (w, v)))
                .collect::<Vec<_>>()
        };
        let (decode, prefill) = (views(WorkerRole::Decode), views(WorkerRole::Prefill));
        if decode.is_empty() || prefill.is_empty() {
            return;
        }
        let dv: Vec<ThreadView> = decode.iter().map(|(_, v)| *v).collect();
        let pv: Vec<ThreadView> = prefill.iter().map(|(_, v)| *v).collect();
        let threads = plan(&dv, &pv, tpot_target_ms);
        for ((worker, view), n) in decode.iter().chain(&prefill).zip(threads) {
            let before = worker.set_planned_threads(n);
            metrics::gauge!(m::COMPUTE_THREADS, "worker" => worker.url.clone()).set(f64::from(n));
            if before != n {
                tracing::info!(
                    worker = %worker.url,
                    role = worker.role.as_str(),
                    from = before,
                    to = n,
                    work = view.work,
                    step_ms = view.full_team_step_ms,
                    "compute threads planned"
                );
                if before != 0 {
                    metrics::counter!(m::COMPUTE_THREAD_MOVES_TOTAL, "role" => worker.role.as_str())
                        .increment(1);
                }
                worker.probe.notify_one();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(step: f64, streams: u64) -> ThreadView {
        ThreadView {
            max_threads: 2,
            full_team_step_ms: Some(step),
            work: streams,
        }
    }

    fn prefill(queued: u64) -> ThreadView {
        ThreadView {
            max_threads: 2,
            full_team_step_ms: None,
            work: queued,
        }
    }

    #[test]
    fn a_queued_prompt_takes_the_cores_the_streams_can_spare() {
        // 20 ms on two threads is 40 on one: within 0.9 x 60.
        assert_eq!(plan(&[decode(20.0, 16)], &[prefill(2048)], 60.0), [1, 1]);
        // 30 ms on two is 60 on one: over 54, so the streams keep both, and the prompt
        // computes on both in the slack between their passes.
        assert_eq!(plan(&[decode(30.0, 16)], &[prefill(2048)], 60.0), [2, 2]);
        // Nothing decoding: the prompt gets every core (the decode worker's one thread idles).
        assert_eq!(plan(&[decode(30.0, 0)], &[prefill(2048)], 60.0), [1, 2]);
    }

    #[tokio::test]
    async fn a_decode_worker_plans_for_the_streams_its_queued_prompts_become() {
        let auth = tandem_auth::InternalAuth::none();
        let w = Worker::new(WorkerRole::Decode, 0, "http://127.0.0.1:1", &auth).unwrap();
        let report = |queued_prompts: u32| tandem_proto::v1::LoadReport {
            max_compute_threads: 2,
            compute_threads: 2,
            queued_prompts,
            queued_prefill_tokens: 16 * u64::from(queued_prompts),
            step_cost: Some(tandem_proto::v1::StepCost {
                base_ms: 2.0,
                per_row_ms: 3.0,
                passes: 10,
                decode_rows: 4,
                decode_context_tokens: 4 * 300,
                ..Default::default()
            }),
            ..Default::default()
        };
        // Four streams left of a wave: 14 ms on two threads, 28 on one, so a thread goes.
        w.set_load(report(0));
        let streams_only = ThreadView::of(&w).unwrap();
        assert_eq!(
            (streams_only.work, streams_only.full_team_step_ms),
            (4, Some(14.0))
        );
        assert_eq!(plan(&[streams_only], &[prefill(2048)], 60.0), [1, 1]);
        // With the next wave's twelve prompts queued there: sixteen streams soon, 50 ms on
        // two threads and 100 on one, so it keeps both.
        w.set_load(report(12));
        let wave = ThreadView::of(&w).unwrap();
        assert_eq!((wave.work, wave.full_team_step_ms), (16, Some(50.0)));
        assert_eq!(plan(&[wave], &[prefill(2048)], 60.0), [2, 2]);
    }

    #[test]
    fn with_no_prompt_queued_the_streams_get_every_core() {
        assert_eq!(plan(&[decode(20.0, 16)], &[prefill(0)], 60.0), [2, 1]);
        // Unfitted costs: all threads, the safe side for the streams.
        let unfitted = ThreadView {
            full_team_step_ms: None,
            ..decode(0.0, 4)
        };
        assert_eq!(plan(&[unfitted], &[prefill(100)], 60.0), [2, 2]);
    }

    #[test]
    fn larger_teams_split_by_need() {
        let d = ThreadView {
            max_threads: 8,
            full_team_step_ms: Some(10.0),
            work: 8,
        };
        let p = ThreadView {
            max_threads: 8,
            ..prefill(4096)
        };
        // 10 ms on 8 threads: 80 ms on one, 40 on two, 26.7 on three (<= 54 at two).
        assert_eq!(plan(&[d], &[p], 60.0), [2, 6]);
        // Two prefill workers with work share the six; an idle one is planned the share it
        // would start a prompt with.
        assert_eq!(plan(&[d], &[p, p], 60.0), [2, 3, 3]);
        assert_eq!(
            plan(&[d], &[p, ThreadView { work: 0, ..p }], 60.0),
            [2, 6, 6]
        );
    }
}
