//! When to restart a process that exited on its own: exponential backoff per process, reset
//! after a healthy run, and a cap on restarts per process within a sliding minute.
//!
//! Pure bookkeeping over caller-supplied [`Instant`]s, so the policy is tested without
//! sleeping; the launcher owns the timers and the processes. Past the cap the launcher gives
//! up: a process that keeps crashing points at something a restart will not fix (a bad flag,
//! a port taken, a model that does not load), and hiding that behind endless restarts would
//! only delay the operator.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// The window over which restarts are counted against [`RestartPolicy::max_per_minute`].
const WINDOW: Duration = Duration::from_secs(60);

/// How processes are restarted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestartPolicy {
    /// Restarts allowed per process within any minute; one more and the launcher gives up.
    /// Zero: never restart (the first unexpected exit stops the deployment).
    pub max_per_minute: u32,
    /// Delay before the first restart of a streak; each further restart doubles it.
    pub backoff_initial: Duration,
    /// The delay never exceeds this.
    pub backoff_max: Duration,
    /// A process that ran this long before exiting starts a new streak (its next restart
    /// waits `backoff_initial` again).
    pub healthy_after: Duration,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        Self {
            max_per_minute: 5,
            backoff_initial: Duration::from_millis(500),
            backoff_max: Duration::from_secs(10),
            healthy_after: Duration::from_secs(60),
        }
    }
}

impl RestartPolicy {
    /// The delay before restart number `streak` (0-based) of a streak: initial · 2^streak,
    /// capped.
    fn backoff(&self, streak: u32) -> Duration {
        let factor = 2u32.checked_pow(streak).unwrap_or(u32::MAX);
        self.backoff_initial
            .checked_mul(factor)
            .unwrap_or(self.backoff_max)
            .min(self.backoff_max)
    }
}

/// What to do about a process that just exited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Start it again after `delay`; `recent` restarts (this one included) fall in the last
    /// minute.
    Restart { delay: Duration, recent: u32 },
    /// The cap is reached: `recent` restarts already happened in the last minute.
    GiveUp { recent: u32 },
}

/// One process's restart history.
#[derive(Debug, Clone)]
pub struct RestartTracker {
    /// When the current incarnation was started.
    started: Instant,
    /// Restarts since the last healthy run.
    streak: u32,
    /// When each restart of the last minute was decided, oldest first.
    recent: VecDeque<Instant>,
}

impl RestartTracker {
    /// A process first started at `started`.
    pub fn new(started: Instant) -> Self {
        Self {
            started,
            streak: 0,
            recent: VecDeque::new(),
        }
    }

    /// The process exited at `now`: restart it (after how long), or give up.
    pub fn on_exit(&mut self, policy: &RestartPolicy, now: Instant) -> Verdict {
        if now.saturating_duration_since(self.started) >= policy.healthy_after {
            self.streak = 0;
        }
        while self
            .recent
            .front()
            .is_some_and(|&t| now.saturating_duration_since(t) >= WINDOW)
        {
            self.recent.pop_front();
        }
        let recent = u32::try_from(self.recent.len()).unwrap_or(u32::MAX);
        if recent >= policy.max_per_minute {
            return Verdict::GiveUp { recent };
        }
        let delay = policy.backoff(self.streak);
        self.streak = self.streak.saturating_add(1);
        self.recent.push_back(now);
        Verdict::Restart {
            delay,
            recent: recent + 1,
        }
    }

    /// The process was started again at `now` (also when the start itself failed: that
    /// counts as a run of zero length, which keeps the streak going).
    pub fn on_start(&mut self, now: Instant) {
        self.started = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn policy(max_per_minute: u32) -> RestartPolicy {
        RestartPolicy {
            max_per_minute,
            ..RestartPolicy::default()
        }
    }

    /// Exit at `t0 + at`, and if restarted, start again once the delay has passed.
    fn crash(tr: &mut RestartTracker, p: &RestartPolicy, t0: Instant, at: Duration) -> Verdict {
        let now = t0 + at;
        let v = tr.on_exit(p, now);
        if let Verdict::Restart { delay, .. } = v {
            tr.on_start(now + delay);
        }
        v
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let t0 = Instant::now();
        let p = policy(100);
        let mut tr = RestartTracker::new(t0);
        let mut delays = Vec::new();
        for i in 0..8 {
            match crash(&mut tr, &p, t0, ms(100 * i)) {
                Verdict::Restart { delay, .. } => delays.push(delay.as_millis()),
                v => panic!("gave up: {v:?}"),
            }
        }
        assert_eq!(
            delays,
            [500, 1000, 2000, 4000, 8000, 10_000, 10_000, 10_000]
        );
    }

    #[test]
    fn a_healthy_run_resets_the_backoff() {
        let t0 = Instant::now();
        let p = policy(100);
        let mut tr = RestartTracker::new(t0);
        assert_eq!(
            crash(&mut tr, &p, t0, ms(0)),
            Verdict::Restart {
                delay: ms(500),
                recent: 1
            }
        );
        // Restarted at 0.5 s, crashes 2 s later: the streak goes on.
        assert!(matches!(
            crash(&mut tr, &p, t0, ms(2500)),
            Verdict::Restart { delay, .. } if delay == ms(1000)
        ));
        // Restarted at 3.5 s, runs 60 s: healthy, so the next delay is the initial one again.
        assert!(matches!(
            crash(&mut tr, &p, t0, ms(63_500)),
            Verdict::Restart { delay, .. } if delay == ms(500)
        ));
        // 59.9 s is not quite healthy.
        let mut tr = RestartTracker::new(t0);
        crash(&mut tr, &p, t0, ms(0));
        assert!(matches!(
            crash(&mut tr, &p, t0, ms(500 + 59_900)),
            Verdict::Restart { delay, .. } if delay == ms(1000)
        ));
    }

    #[test]
    fn the_cap_counts_restarts_within_a_sliding_minute() {
        let t0 = Instant::now();
        let p = policy(2);
        let mut tr = RestartTracker::new(t0);
        assert!(matches!(
            crash(&mut tr, &p, t0, ms(0)),
            Verdict::Restart { recent: 1, .. }
        ));
        assert!(matches!(
            crash(&mut tr, &p, t0, ms(30_000)),
            Verdict::Restart { recent: 2, .. }
        ));
        // The restart at 0 s has left the window by 60 s; the one at 30 s has not.
        assert!(matches!(
            crash(&mut tr, &p, t0, ms(60_000)),
            Verdict::Restart { recent: 2, .. }
        ));
        assert_eq!(
            crash(&mut tr, &p, t0, ms(61_000)),
            Verdict::GiveUp { recent: 2 }
        );
    }

    #[test]
    fn one_per_minute_gives_up_at_the_second_crash() {
        let t0 = Instant::now();
        let p = policy(1);
        let mut tr = RestartTracker::new(t0);
        assert!(matches!(
            crash(&mut tr, &p, t0, ms(10_000)),
            Verdict::Restart { .. }
        ));
        assert_eq!(
            crash(&mut tr, &p, t0, ms(12_000)),
            Verdict::GiveUp { recent: 1 }
        );
    }

    #[test]
    fn zero_never_restarts() {
        let t0 = Instant::now();
        let mut tr = RestartTracker::new(t0);
        assert_eq!(
            tr.on_exit(&policy(0), t0 + ms(90_000)),
            Verdict::GiveUp { recent: 0 }
        );
    }

    #[test]
    fn backoff_does_not_overflow() {
        let p = RestartPolicy {
            backoff_initial: Duration::from_secs(u64::MAX / 2),
            backoff_max: Duration::from_secs(u64::MAX),
            ..policy(100)
        };
        assert_eq!(p.backoff(40), Duration::from_secs(u64::MAX));
        assert_eq!(policy(5).backoff(u32::MAX), Duration::from_secs(10));
    }
}
