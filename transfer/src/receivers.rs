//! The decode worker's `nccl` receivers, one per prefill worker.
//!
//! A receiver thread spends its idle time blocked on the next message from its prefill
//! worker, with no time limit (idle is not a stall). When that worker's link breaks or the
//! worker restarts, it opens a new link, and the old thread would wait forever on a peer that
//! will never send again: a thread, a communicator and a scratch buffer leaked per
//! reconnection. So a new link for a prefill worker retires the old receiver: its link is
//! aborted, which ends the wait, and the thread exits. A receiver retired before its link is
//! up (still waiting for the peer to join) aborts the link itself as soon as it is.
//!
//! Generic over the abort so the bookkeeping is tested without NCCL.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// Ends a link from another thread.
pub trait AbortLink: Send + 'static {
    fn abort(&self);
}

enum State<A> {
    /// The thread is still joining its communicator.
    Joining,
    Live(A),
    /// Replaced by a newer receiver for the same prefill worker.
    Retired,
}

/// Where one receiver thread reports its link.
pub struct ReceiverSlot<A>(Arc<Mutex<State<A>>>);

impl<A> Clone for ReceiverSlot<A> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The states are replaced whole: a panic elsewhere cannot leave one half-written.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<A: AbortLink> ReceiverSlot<A> {
    /// Called by the receiver thread once its link is up. `false`: the receiver was replaced
    /// meanwhile, and the thread must drop its link (aborting it) and end.
    pub fn joined(&self, abort: A) -> bool {
        let mut state = lock(&self.0);
        match *state {
            State::Retired => false,
            _ => {
                *state = State::Live(abort);
                true
            }
        }
    }

    fn retire(&self) {
        let previous = std::mem::replace(&mut *lock(&self.0), State::Retired);
        if let State::Live(abort) = previous {
            // An abort may wait for an NCCL call in progress on the link: never block the
            // caller (an RPC handler) on it.
            let spawned = std::thread::Builder::new()
                .name("nccl-retire".into())
                .spawn(move || abort.abort());
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "could not start a thread to abort a replaced nccl link");
            }
        }
    }
}

/// Every prefill worker's current receiver.
pub struct Receivers<A> {
    by_prefill: Mutex<HashMap<String, ReceiverSlot<A>>>,
}

impl<A> Default for Receivers<A> {
    fn default() -> Self {
        Self {
            by_prefill: Mutex::new(HashMap::new()),
        }
    }
}

impl<A> std::fmt::Debug for Receivers<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receivers")
            .field("prefill_workers", &lock(&self.by_prefill).len())
            .finish()
    }
}

impl<A: AbortLink> Receivers<A> {
    /// A slot for a new receiver for `prefill`; that worker's previous receiver is retired.
    pub fn replace(&self, prefill: &str) -> ReceiverSlot<A> {
        let slot = ReceiverSlot(Arc::new(Mutex::new(State::Joining)));
        let previous = lock(&self.by_prefill).insert(prefill.to_string(), slot.clone());
        if let Some(previous) = previous {
            tracing::info!(%prefill, "a new nccl link replaces this prefill worker's old one");
            previous.retire();
        }
        slot
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    #[derive(Clone, Default)]
    struct Counted(Arc<AtomicUsize>);

    impl AbortLink for Counted {
        fn abort(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn eventually(what: &str, f: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !f() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_new_link_aborts_the_same_prefill_workers_old_one_only() {
        let receivers = Receivers::<Counted>::default();
        let (a1, b1) = (Counted::default(), Counted::default());
        assert!(receivers.replace("prefill-a").joined(a1.clone()));
        assert!(receivers.replace("prefill-b").joined(b1.clone()));
        let a2 = Counted::default();
        assert!(receivers.replace("prefill-a").joined(a2.clone()));
        eventually("the old link's abort", || a1.0.load(Ordering::SeqCst) == 1);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(a1.0.load(Ordering::SeqCst), 1, "aborted once");
        assert_eq!(a2.0.load(Ordering::SeqCst), 0, "the new link stays");
        assert_eq!(
            b1.0.load(Ordering::SeqCst),
            0,
            "another worker's link stays"
        );
    }

    #[test]
    fn a_receiver_replaced_while_joining_is_told_to_end() {
        let receivers = Receivers::<Counted>::default();
        let joining = receivers.replace("prefill-a");
        let newer = receivers.replace("prefill-a");
        // The old thread's link came up after it was replaced: it must not stay.
        assert!(!joining.joined(Counted::default()));
        assert!(newer.joined(Counted::default()));
    }
}
