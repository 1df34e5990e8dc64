//! Admission control: at most `--max-concurrent-requests` requests run, at most
//! `--max-queued-requests` more wait for a slot, and anything beyond is refused at once with
//! 429 (TGI and the SGLang router do the same; vLLM's unbounded queue is the anti-example).
//! A refused request costs one atomic operation, so overload cannot slow admitted requests.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

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
    pub fn new(max_running: usize, max_queued: usize) -> Self {
        Self {
            running: Arc::new(Semaphore::new(max_running)),
            capacity: max_running.saturating_add(max_queued),
            admitted: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Takes a place or fails with `Overloaded` at once; then waits for a running slot.
    /// Cancel-safe: dropping the future gives the place back.
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
            Arc::clone(&self.running)
                .acquire_owned()
                .await
                .map_err(|_| ApiError::Internal)?
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
        let a = Arc::new(Admission::new(1, 1));
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
    async fn cancelled_waiter_gives_its_place_back() {
        let a = Admission::new(1, 1);
        let _first = a.admit().await.unwrap();
        let r = tokio::time::timeout(Duration::from_millis(20), a.admit()).await;
        assert!(r.is_err(), "should still be waiting");
        // The timed-out waiter released its place, so one more may queue.
        let r = tokio::time::timeout(Duration::from_millis(20), a.admit()).await;
        assert!(r.is_err(), "queued, not refused");
    }
}
