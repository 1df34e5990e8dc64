//! Worker discovery: what a `--prefill`/`--decode` entry means (a fixed `http://HOST:PORT`,
//! or `dns://NAME:PORT`, every address of NAME being one worker; parsed in `entry`), the
//! resolver behind it (`Resolve`, the system's by default, a fake in tests), and the task
//! that re-resolves each name every `--dns-refresh-ms` and hands the result to the pool.
//!
//! This is how the router finds workers behind a Kubernetes headless Service, whose name
//! resolves to one A/AAAA record per ready pod. It does not talk to workers itself: joining
//! (GetInfo, compatibility, health polls) and leaving are the pool's (`workers`).
//!
//! A lookup that fails keeps the workers the name had before, so a DNS hiccup never empties
//! the pool; workers that are really gone fail their health polls and get no traffic. A
//! lookup that succeeds with fewer addresses removes the missing ones.

mod entry;

pub use entry::{DnsName, WorkerEntry};

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use crate::workers::{WorkerPool, WorkerRole, WorkerSource};

/// The worker URL of one resolved address.
pub fn worker_url(addr: SocketAddr) -> String {
    // Rebuilt from ip and port so that an IPv6 scope id, which has no place in a URL, is
    // dropped.
    format!("http://{}", SocketAddr::new(addr.ip(), addr.port()))
}

/// Why a name could not be resolved.
#[derive(Debug, thiserror::Error)]
#[error("cannot resolve {name}: {source}")]
pub struct ResolveError {
    pub name: String,
    #[source]
    pub source: std::io::Error,
}

/// Turns a name into addresses. The router uses [`SystemResolver`]; tests inject fakes.
pub trait Resolve: Send + Sync + std::fmt::Debug {
    /// Every address of `name`, each with `port`. An empty answer means the name currently
    /// has no workers; an error means nothing is known (the previous answer stands).
    fn resolve<'a>(
        &'a self,
        name: &'a str,
        port: u16,
    ) -> BoxFuture<'a, Result<Vec<SocketAddr>, ResolveError>>;
}

/// The operating system's resolver (`getaddrinfo` through tokio's `lookup_host`): A and
/// AAAA records, `/etc/hosts`, whatever `nsswitch.conf` says.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemResolver;

impl Resolve for SystemResolver {
    fn resolve<'a>(
        &'a self,
        name: &'a str,
        port: u16,
    ) -> BoxFuture<'a, Result<Vec<SocketAddr>, ResolveError>> {
        Box::pin(async move {
            tokio::net::lookup_host((name, port))
                .await
                .map(Iterator::collect)
                .map_err(|source| ResolveError {
                    name: name.to_string(),
                    source,
                })
        })
    }
}

/// Resolves `name` once: the worker URLs it stands for, sorted and deduplicated.
pub async fn resolve_urls(
    resolver: &dyn Resolve,
    name: &DnsName,
) -> Result<BTreeSet<String>, ResolveError> {
    let addrs = resolver.resolve(&name.name, name.port).await?;
    Ok(addrs
        .into_iter()
        .map(|a| worker_url(SocketAddr::new(a.ip(), name.port)))
        .collect())
}

/// Spawns one task per DNS entry of the pool that resolves its name now and then every
/// `refresh`, until `shutdown`.
pub fn spawn_discovery(
    pool: &Arc<WorkerPool>,
    resolver: Arc<dyn Resolve>,
    refresh: Duration,
    shutdown: &CancellationToken,
) {
    for (role, source, name) in pool.dns_entries() {
        let pool = Arc::clone(pool);
        let resolver = Arc::clone(&resolver);
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(refresh);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut failing = false;
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = ticker.tick() => {}
                }
                let answer = tokio::select! {
                    _ = shutdown.cancelled() => break,
                    answer = resolve_urls(resolver.as_ref(), &name) => answer,
                };
                failing = refresh_once(&pool, role, source, &name, answer, failing);
            }
        });
    }
}

/// Applies one lookup's answer to the pool; returns whether the name is failing now. The
/// first failure of a streak is a warning and the rest debug lines, so that a name that is
/// wrong for hours does not flood the log.
fn refresh_once(
    pool: &Arc<WorkerPool>,
    role: WorkerRole,
    source: WorkerSource,
    name: &DnsName,
    answer: Result<BTreeSet<String>, ResolveError>,
    was_failing: bool,
) -> bool {
    match answer {
        Ok(urls) => {
            if was_failing {
                tracing::info!(%name, role = role.as_str(), addresses = urls.len(), "name resolves again");
            }
            pool.set_source_urls(role, source, &urls);
            false
        }
        Err(e) if was_failing => {
            tracing::debug!(%name, role = role.as_str(), error = %e, "name still does not resolve");
            true
        }
        Err(e) => {
            tracing::warn!(%name, role = role.as_str(), error = %e, "name does not resolve; keeping its last known workers and retrying");
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Instant;

    use tandem_proto::v1::Transport;

    use super::*;

    /// A resolver answering from a table the test edits; counts lookups per name.
    #[derive(Debug, Default)]
    struct FakeResolver {
        answers: Mutex<HashMap<String, Result<Vec<&'static str>, String>>>,
        lookups: Mutex<HashMap<String, usize>>,
        total: AtomicUsize,
    }

    impl FakeResolver {
        fn answer(&self, name: &str, ips: &[&'static str]) {
            let mut answers = self.answers.lock().unwrap();
            answers.insert(name.into(), Ok(ips.to_vec()));
        }

        fn fail(&self, name: &str) {
            let mut answers = self.answers.lock().unwrap();
            answers.insert(name.into(), Err("SERVFAIL".into()));
        }

        fn lookups(&self, name: &str) -> usize {
            self.lookups.lock().unwrap().get(name).copied().unwrap_or(0)
        }
    }

    impl Resolve for FakeResolver {
        fn resolve<'a>(
            &'a self,
            name: &'a str,
            port: u16,
        ) -> BoxFuture<'a, Result<Vec<SocketAddr>, ResolveError>> {
            let answer = self.answers.lock().unwrap().get(name).cloned();
            *self.lookups.lock().unwrap().entry(name.into()).or_default() += 1;
            self.total.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                let failure = |why: String| ResolveError {
                    name: name.into(),
                    source: std::io::Error::other(why),
                };
                match answer {
                    Some(Ok(ips)) => Ok(ips
                        .iter()
                        .map(|ip| SocketAddr::new(ip.parse().unwrap(), port))
                        .collect()),
                    Some(Err(e)) => Err(failure(e)),
                    None => Err(failure("NXDOMAIN".into())),
                }
            })
        }
    }

    #[test]
    fn worker_urls_of_addresses() {
        assert_eq!(
            worker_url("10.1.2.3:7201".parse().unwrap()),
            "http://10.1.2.3:7201"
        );
        assert_eq!(
            worker_url("[fe80::1%3]:7201".parse().unwrap()),
            "http://[fe80::1]:7201"
        );
    }

    fn pool(decode: &[&str], prefill: &[&str]) -> Arc<WorkerPool> {
        let owned = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        Arc::new(
            WorkerPool::new(
                &owned(prefill),
                &owned(decode),
                Transport::Tcp,
                None,
                tandem_auth::InternalAuth::none(),
            )
            .unwrap(),
        )
    }

    fn urls(pool: &WorkerPool, role: WorkerRole) -> Vec<String> {
        let mut urls: Vec<String> = pool.workers(role).iter().map(|w| w.url.clone()).collect();
        urls.sort();
        urls
    }

    /// Waits (5 s at most) until `f` holds.
    async fn eventually(mut f: impl FnMut() -> bool) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if f() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        f()
    }

    /// Starts discovery every 10 ms with `resolver`; stops when the token drops.
    fn discover(
        pool: &Arc<WorkerPool>,
        resolver: &Arc<FakeResolver>,
    ) -> tokio_util::sync::DropGuard {
        let stop = CancellationToken::new();
        let resolver: Arc<dyn Resolve> = resolver.clone();
        spawn_discovery(pool, resolver, Duration::from_millis(10), &stop);
        stop.drop_guard()
    }

    #[tokio::test]
    async fn addresses_join_and_leave() {
        let pool = pool(&["dns://decode.test:7201"], &["dns://prefill.test:7101"]);
        assert_eq!(
            pool.worker_counts(),
            (0, 0),
            "a name starts with no workers"
        );
        assert!(pool.discovers_decode_workers());
        assert!(pool.prefill_configured());
        let resolver = Arc::new(FakeResolver::default());
        resolver.answer("decode.test", &["10.9.0.1", "10.9.0.2", "10.9.0.1"]);
        resolver.answer("prefill.test", &["10.9.0.7"]);
        let _stop = discover(&pool, &resolver);
        assert!(eventually(|| pool.worker_counts() == (2, 1)).await);
        assert_eq!(
            urls(&pool, WorkerRole::Decode),
            ["http://10.9.0.1:7201", "http://10.9.0.2:7201"]
        );
        assert_eq!(urls(&pool, WorkerRole::Prefill), ["http://10.9.0.7:7101"]);
        let leaving = pool.worker(WorkerRole::Decode, pool.workers(WorkerRole::Decode)[0].id);
        let leaving = leaving.unwrap();
        let staying = Arc::clone(&pool.workers(WorkerRole::Decode)[1]);
        assert_eq!(leaving.url, "http://10.9.0.1:7201");

        resolver.answer("decode.test", &["10.9.0.2", "10.9.0.3"]);
        assert!(
            eventually(|| urls(&pool, WorkerRole::Decode)
                == ["http://10.9.0.2:7201", "http://10.9.0.3:7201"])
            .await
        );
        assert!(leaving.is_retired(), "the worker that left is retired");
        assert!(pool.worker(WorkerRole::Decode, leaving.id).is_none());
        let kept = pool.worker(WorkerRole::Decode, staying.id).unwrap();
        assert!(
            Arc::ptr_eq(&kept, &staying),
            "a worker that stays keeps its state"
        );
        assert!(!staying.is_retired());

        resolver.answer("decode.test", &[]);
        assert!(eventually(|| pool.worker_counts() == (0, 1)).await);
        assert!(staying.is_retired());
        let prompt = [1u32; 40];
        let mut names = crate::routing::PromptNames::new(&prompt);
        assert_eq!(pool.decode_candidates(&[], &mut names), []);
    }

    #[tokio::test]
    async fn a_failed_lookup_keeps_the_last_workers_and_is_retried() {
        let pool = pool(&["dns://decode.test:7201"], &[]);
        let resolver = Arc::new(FakeResolver::default());
        resolver.fail("decode.test");
        let _stop = discover(&pool, &resolver);
        assert!(eventually(|| resolver.lookups("decode.test") >= 3).await);
        assert_eq!(pool.worker_counts(), (0, 0), "nothing known yet");

        resolver.answer("decode.test", &["10.9.1.1"]);
        assert!(eventually(|| pool.worker_counts() == (1, 0)).await);
        let known = Arc::clone(&pool.workers(WorkerRole::Decode)[0]);

        resolver.fail("decode.test");
        let seen = resolver.lookups("decode.test");
        assert!(eventually(|| resolver.lookups("decode.test") >= seen + 3).await);
        assert_eq!(urls(&pool, WorkerRole::Decode), ["http://10.9.1.1:7201"]);
        assert!(!known.is_retired(), "a DNS failure removes nobody");

        resolver.answer("decode.test", &["10.9.1.2"]);
        assert!(eventually(|| urls(&pool, WorkerRole::Decode) == ["http://10.9.1.2:7201"]).await);
        assert!(known.is_retired());
    }

    #[tokio::test]
    async fn listed_and_discovered_urls_are_one_worker() {
        let pool = pool(
            &[
                "http://10.9.2.1:7201",
                "dns://decode.test:7201",
                "dns://decode-b.test:7201",
            ],
            &[],
        );
        assert_eq!(
            pool.worker_counts(),
            (1, 0),
            "the listed worker is there at once"
        );
        let listed = Arc::clone(&pool.workers(WorkerRole::Decode)[0]);
        let resolver = Arc::new(FakeResolver::default());
        resolver.answer("decode.test", &["10.9.2.1", "10.9.2.2"]);
        resolver.answer("decode-b.test", &["10.9.2.2"]);
        let _stop = discover(&pool, &resolver);
        assert!(eventually(|| pool.worker_counts() == (2, 0)).await);
        assert_eq!(
            urls(&pool, WorkerRole::Decode),
            ["http://10.9.2.1:7201", "http://10.9.2.2:7201"]
        );
        let first = pool.workers(WorkerRole::Decode);
        assert!(
            Arc::ptr_eq(&first[0], &listed),
            "the listed worker was not duplicated"
        );
        let shared = Arc::clone(&first[1]);

        // Each name drops its addresses: the listed one stays, and the one both names gave
        // stays while the other name still gives it.
        resolver.answer("decode.test", &[]);
        let lookups = resolver.total.load(Ordering::SeqCst);
        assert!(eventually(|| resolver.total.load(Ordering::SeqCst) >= lookups + 4).await);
        assert_eq!(pool.worker_counts(), (2, 0));
        assert!(!listed.is_retired() && !shared.is_retired());

        resolver.answer("decode-b.test", &[]);
        assert!(eventually(|| pool.worker_counts() == (1, 0)).await);
        assert!(shared.is_retired());
        assert!(Arc::ptr_eq(&pool.workers(WorkerRole::Decode)[0], &listed));
        assert!(!listed.is_retired());
    }
}
