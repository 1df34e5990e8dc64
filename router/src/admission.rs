//! Admission control: at most `--max-concurrent-requests` requests run, at most
//! `--max-queued-requests` more wait for a slot, and anything beyond is refused at once with
//! 429 (TGI and the SGLang router do the same; vLLM's unbounded queue is the anti-example).
//! A refused request costs one atomic operation, so overload cannot slow admitted requests.
//! A request waits at most `--max-queue-wait-ms` for its slot, then gets 429 too: under
//! sustained overload the queue's wait stays bounded, and a client learns at once to retry
//! (elsewhere) instead of after its own timeout.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::ApiError;
use crate::metrics as m;

/// The running slots and the bound on waiting requests.
#[derive(Debug)]
pub struct Admission {
    running: Arc<Semaphore>,
    /// Running + waiting requests may not exceed this.
    capacity: usize,
    admitted: Arc<AtomicUsize>,
    /// The longest wait for a running slot (None: until the caller gives up).
    max_wait: Option<Duration>,
}

/// Held for the whole life of an admitted request; dropping it frees the slot.
#[derive(Debug)]
pub struct AdmissionTicket {
    _permit: OwnedSemaphorePermit,
    _slot: Slot,
}

/// One of `capacity` places, running or waiting.
#[derive(Debug)]
struct Slot {
    admitted: Arc<AtomicUsize>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.admitted.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Counts one gauge up while alive.
struct GaugeGuard(&'static str);

impl GaugeGuard {
    fn new(name: &'static str) -> Self {
        metrics::gauge!(name).increment(1.0);
        GaugeGuard(name)
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        metrics::gauge!(self.0).decrement(1.0);
    }
}

impl std::fmt::Debug for GaugeGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl Admission {
    pub fn new(max_running: usize, max_queued: usize, max_wait: Option<Duration>) -> Self {
        Self {
            running: Arc::new(Semaphore::new(max_running)),
            capacity: max_running.saturating_add(max_queued),
            admitted: Arc::new(AtomicUsize::new(0)),
            max_wait,
        }
    }

    /// Takes a place or fails with `Overloaded` at once; then waits for a running slot, at
    /// most `max_wait` (`QueueWait` after it). Records the wait. Cancel-safe: dropping the
    /// future gives the place back.
    pub async fn admit(&self) -> Result<InFlight, ApiError> {
        let reserved = self
            .admitted
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.capacity).then_some(n + 1)
            })
            .is_ok();
        if !reserved {
            return Err(ApiError::Overloaded);
        }
        let slot = Slot {
            admitted: Arc::clone(&self.admitted),
        };
        let permit = {
            let _waiting = GaugeGuard::new(m::QUEUE_DEPTH);
            let queued = Instant::now();
            let acquire = Arc::clone(&self.running).acquire_owned();
            let acquired = match self.max_wait {
                // The bound is hard: a slot that came only after it (a saturated machine
                // wakes the timer late) is given back, so no request starts later than this.
                Some(limit) => match tokio::time::timeout(limit, acquire).await {
                    Ok(r) if queued.elapsed() <= limit => r,
                    _ => {
                        metrics::histogram!(m::QUEUE_SECONDS, "outcome" => "refused")
                            .record(queued.elapsed());
                        return Err(ApiError::QueueWait {
                            ms: limit.as_millis(),
                        });
                    }
                },
                None => acquire.await,
            };
            metrics::histogram!(m::QUEUE_SECONDS, "outcome" => "admitted").record(queued.elapsed());
            acquired.map_err(|_| ApiError::Internal)?
        };
        Ok(InFlight {
            _ticket: AdmissionTicket {
                _permit: permit,
                _slot: slot,
            },
            _gauge: GaugeGuard::new(m::IN_FLIGHT),
        })
    }
}

/// An admitted, running request: keeps its slot and the in-flight gauge until dropped.
#[derive(Debug)]
pub struct InFlight {
    _ticket: AdmissionTicket,
    _gauge: GaugeGuard,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn refuses_beyond_running_plus_queued() {
        let a = Arc::new(Admission::new(1, 1, None));
        let first = a.admit().await.unwrap();
        // The second waits for the running slot.
        let a2 = Arc::clone(&a);
        let waiting = tokio::spawn(async move { a2.admit().await.map(|_| ()) });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(matches!(a.admit().await, Err(ApiError::Overloaded)));
        drop(first);
        tokio::time::timeout(Duration::from_secs(1), waiting)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        // Both places are free again.
        let _x = a.admit().await.unwrap();
    }

    #[tokio::test]
    async fn a_wait_past_the_bound_is_refused_and_frees_its_place() {
        let a = Admission::new(1, 1, Some(Duration::from_millis(30)));
        let _first = a.admit().await.unwrap();
        let r = tokio::time::timeout(Duration::from_secs(5), a.admit())
            .await
            .expect("the bounded wait must end by itself");
        assert!(matches!(r, Err(ApiError::QueueWait { ms: 30 })), "{r:?}");
        // Its place is free again: another may queue (and is refused in turn).
        let r = a.admit().await;
        assert!(matches!(r, Err(ApiError::QueueWait { .. })), "{r:?}");
    }

    #[tokio::test]
    async fn cancelled_waiter_gives_its_place_back() {
        let a = Admission::new(1, 1, None);
        let _first = a.admit().await.unwrap();
        let r = tokio::time::timeout(Duration::from_millis(20), a.admit()).await;
        assert!(r.is_err(), "should still be waiting");
        // The timed-out waiter released its place, so one more may queue.
        let r = tokio::time::timeout(Duration::from_millis(20), a.admit()).await;
        assert!(r.is_err(), "queued, not refused");
    }
}
