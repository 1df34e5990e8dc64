//! Workers found through `dns://` entries: an in-process router with a scripted resolver
//! over fake workers listening on several loopback addresses (127.0.0.1-3, one port, as the
//! pods behind a headless Service would), and the binary resolving `localhost` for real.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use tandem_router::{Resolve, ResolveError};

use super::*;

/// A resolver answering from a table the test edits.
#[derive(Debug, Default)]
struct ScriptedResolver {
    answers: Mutex<HashMap<String, Result<Vec<&'static str>, ()>>>,
    /// Lookups answered.
    lookups: std::sync::atomic::AtomicU64,
}

impl ScriptedResolver {
    /// Waits until the router has looked its names up twice more: the second lookup starts
    /// only once the first answer was taken in.
    async fn taken_in(&self) {
        let lookups = || self.lookups.load(std::sync::atomic::Ordering::SeqCst);
        let before = lookups();
        assert!(
            eventually(Duration::from_secs(10), || lookups() >= before + 2).await,
            "the router stopped looking its names up"
        );
    }

    fn answer(&self, name: &str, ips: &[&'static str]) {
        lock(&self.answers).insert(name.into(), Ok(ips.to_vec()));
    }

    fn fail(&self, name: &str) {
        lock(&self.answers).insert(name.into(), Err(()));
    }
}

impl Resolve for ScriptedResolver {
    fn resolve<'a>(
        &'a self,
        name: &'a str,
        port: u16,
    ) -> BoxFuture<'a, Result<Vec<SocketAddr>, ResolveError>> {
        let answer = lock(&self.answers).get(name).cloned();
        self.lookups
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Box::pin(async move {
            match answer {
                Some(Ok(ips)) => Ok(ips
                    .iter()
                    .map(|ip| SocketAddr::new(ip.parse().unwrap(), port))
                    .collect()),
                _ => Err(ResolveError {
                    name: name.into(),
                    source: std::io::Error::other("scripted SERVFAIL"),
                }),
            }
        })
    }
}

/// Listeners on one port at each of `hosts` (loopback addresses), like pods of one Service.
fn listeners_on_one_port(hosts: &[&str]) -> (u16, Vec<std::net::TcpListener>) {
    for _ in 0..50 {
        let first = std::net::TcpListener::bind((hosts[0], 0)).unwrap();
        let port = first.local_addr().unwrap().port();
        let rest: Result<Vec<_>, _> = hosts[1..]
            .iter()
            .map(|h| std::net::TcpListener::bind((*h, port)))
            .collect();
        if let Ok(mut rest) = rest {
            rest.insert(0, first);
            return (port, rest);
        }
    }
    panic!("no port free on all of {hosts:?}");
}

async fn health(router: &TestRouter) -> Value {
    get_json(&router.url, "/health").await
}

/// Waits (10 s at most) until `/health` counts `decode` and `prefill` workers in the pool.
async fn wait_pool_size(router: &TestRouter, decode: u64, prefill: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let h = health(router).await;
        if h["decode_workers"] == decode && h["prefill_workers"] == prefill {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "pool never reached {decode}/{prefill}: {h}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn workers_behind_a_name_join_serve_and_leave() {
    let (port, decode_listeners) = listeners_on_one_port(&["127.0.0.1", "127.0.0.2", "127.0.0.3"]);
    let decodes: Vec<FakeDecode> = (0..3)
        .map(|i| FakeDecode::new(&format!("decode-{i}")))
        .collect();
    let _decode_servers: Vec<FakeServer> = decode_listeners
        .into_iter()
        .zip(&decodes)
        .map(|(l, d)| FakeServer::start_on(l, Service::Decode(d.clone())))
        .collect();
    let prefill = FakePrefill::new("prefill-0");
    let ps = FakeServer::prefill(&prefill);
    let resolver = Arc::new(ScriptedResolver::default());
    resolver.answer("decode.test", &["127.0.0.1", "127.0.0.2", "127.0.0.1"]);
    resolver.answer("prefill.test", &["127.0.0.1"]);
    let mut c = config(&[], &[]);
    c.decode_urls = vec![format!("dns://decode.test:{port}")];
    c.prefill_urls = vec![format!("dns://prefill.test:{}", ps.addr.port())];
    c.dns_refresh = Duration::from_millis(20);
    let router = TestRouter::start_with_resolver(c, resolver.clone()).await;
    router.wait_healthy(2, 1).await;
    assert_eq!(
        health(&router).await["decode_workers"],
        2,
        "duplicates count once"
    );

    let r = complete(&router.url, 4).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-tandem-mode"), "disaggregated");
    assert_eq!(prefill.calls().len(), 1);
    let served: usize = decodes[..2].iter().map(|d| d.generate_calls().len()).sum();
    assert_eq!(served, 1);

    // A third pod appears, with the most free KV blocks: it joins, is polled, and takes
    // the next request.
    lock(&decodes[2].0.load).free_blocks = 1_000;
    resolver.answer("decode.test", &["127.0.0.1", "127.0.0.2", "127.0.0.3"]);
    router.wait_healthy(3, 1).await;
    let third = format!("http://127.0.0.3:{port}");
    let healthy = format!("tandem_router_worker_healthy{{worker=\"{third}\",role=\"decode\"}}");
    assert_eq!(series(&router.url, &healthy).await, Some(1.0));
    let kv_total =
        format!("tandem_router_worker_kv_blocks_total{{worker=\"{third}\",role=\"decode\"}}");
    assert!(series(&router.url, &kv_total).await.is_some());
    assert!(
        series(
            &router.url,
            "tandem_router_discovered_workers{role=\"decode\"}"
        )
        .await
        .is_some()
    );
    decodes[2].set_script(DecodeScript {
        token_delay: Duration::from_millis(150),
        ..Default::default()
    });
    let slow = {
        let url = router.url.clone();
        tokio::spawn(async move {
            let r = complete(&url, 10).await;
            (r.status(), r.json::<Value>().await.unwrap())
        })
    };
    assert!(
        eventually(Duration::from_secs(5), || decodes[2].generate_calls().len()
            == 1)
        .await
    );

    // It goes away while that request runs: nothing new is routed to it, the request ends
    // normally, and its series are gone from /metrics (not left at zero).
    resolver.answer("decode.test", &["127.0.0.1", "127.0.0.2"]);
    wait_pool_size(&router, 2, 1).await;
    assert!(
        !slow.is_finished(),
        "the slow request outlived its worker's membership"
    );
    for _ in 0..3 {
        assert_eq!(complete(&router.url, 2).await.status(), 200);
    }
    let (status, body) = slow.await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(body["choices"][0]["text"], "Hello from");
    assert_eq!(decodes[2].generate_calls().len(), 1);
    assert_eq!(series(&router.url, &healthy).await, None);
    assert_eq!(series(&router.url, &kv_total).await, None);

    // A failing lookup keeps the last known workers.
    resolver.fail("decode.test");
    resolver.taken_in().await;
    assert_eq!(health(&router).await["decode_workers_healthy"], 2);
    assert_eq!(complete(&router.url, 2).await.status(), 200);

    // An empty answer empties the pool: 503 until workers come back.
    resolver.answer("decode.test", &[]);
    wait_pool_size(&router, 0, 1).await;
    let r = complete(&router.url, 2).await;
    assert_eq!(r.status(), 503);
    assert_eq!(header(&r, "retry-after"), "1");
    resolver.answer("decode.test", &["127.0.0.2"]);
    router.wait_healthy(1, 1).await;
    assert_eq!(complete(&router.url, 2).await.status(), 200);
    router.stop().await;
}

#[tokio::test]
async fn a_name_with_no_workers_yet_answers_503_without_stopping_the_router() {
    let resolver = Arc::new(ScriptedResolver::default());
    resolver.fail("decode.test");
    let (port, mut listeners) = listeners_on_one_port(&["127.0.0.1"]);
    let mut c = config(&[], &[]);
    c.decode_urls = vec![format!("dns://decode.test:{port}")];
    c.dns_refresh = Duration::from_millis(20);
    // Past this a router with listed workers gives up; one that discovers them waits.
    c.startup_timeout = Duration::from_millis(300);
    let started = Instant::now();
    let router = TestRouter::start_with_resolver(c, resolver.clone()).await;
    // Well past the startup timeout, while the name keeps failing: 503s, and the router runs.
    while started.elapsed() < Duration::from_millis(600) {
        let r = complete(&router.url, 2).await;
        assert_eq!(r.status(), 503);
        assert_eq!(header(&r, "retry-after"), "1");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    resolver.answer("decode.test", &[]);
    resolver.taken_in().await;
    assert_eq!(complete(&router.url, 2).await.status(), 503);

    let decode = FakeDecode::new("late");
    let _server = FakeServer::start_on(listeners.remove(0), Service::Decode(decode.clone()));
    resolver.answer("decode.test", &["127.0.0.1"]);
    router.wait_healthy(1, 0).await;
    let r = complete(&router.url, 2).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-tandem-mode"), "aggregated");
    assert_eq!(decode.generate_calls().len(), 1);
    // stop() checks that the router ran cleanly, i.e. the startup timeout did not end it.
    router.stop().await;
}

#[tokio::test]
async fn the_binary_resolves_dns_entries_with_the_system_resolver() {
    let localhost: Vec<SocketAddr> = tokio::net::lookup_host(("localhost", 1))
        .await
        .map(Iterator::collect)
        .unwrap_or_default();
    if !localhost
        .iter()
        .any(|a| a.ip() == std::net::Ipv4Addr::LOCALHOST)
    {
        eprintln!("skipped: `localhost` does not resolve to 127.0.0.1 here ({localhost:?})");
        return;
    }
    let decode = FakeDecode::new("decode-0");
    let ds = FakeServer::decode(&decode);
    let decode_entry = format!("dns://localhost:{}", ds.addr.port());
    let (mut child, url) = spawn_binary(&[
        "--decode",
        &decode_entry,
        "--health-interval-ms",
        "50",
        "--dns-refresh-ms",
        "100",
    ]);
    let health = binary_health(&url).await.unwrap_or(Value::Null);
    let completion = post(
        &url,
        "/v1/completions",
        json!({"prompt": "Hi", "max_tokens": 2}),
    )
    .await;
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(health["status"], "ok", "the binary never became healthy");
    // One worker per distinct address of `localhost` (127.0.0.1, maybe ::1 as well).
    let distinct: std::collections::BTreeSet<_> = localhost.iter().map(|a| a.ip()).collect();
    assert_eq!(health["decode_workers"], distinct.len());
    assert_eq!(completion.status(), 200);
    assert_eq!(decode.generate_calls().len(), 1);
}
