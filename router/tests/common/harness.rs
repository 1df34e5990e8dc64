//! Routers under test: in process on a pre-bound listener (with the config the tests start
//! from, and the usual pair of fake workers), or the binary itself; plus bounded waiting.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use tandem_router::RouterConfig;
use tokio_util::sync::CancellationToken;

use super::fake_decode::FakeDecode;
use super::fake_prefill::FakePrefill;
use super::http::client;
use super::servers::FakeServer;

/// An in-process router.
pub struct TestRouter {
    pub url: String,
    shutdown: CancellationToken,
    handle: tokio::task::JoinHandle<Result<(), tandem_router::RouterError>>,
}

/// Test defaults: fast health polls, bounded startup and requests.
pub fn config(prefill: &[&FakeServer], decode: &[&FakeServer]) -> RouterConfig {
    let mut c = RouterConfig::new(
        prefill.iter().map(|s| s.url.clone()).collect(),
        decode.iter().map(|s| s.url.clone()).collect(),
    );
    c.health_interval = Duration::from_millis(50);
    c.startup_timeout = Duration::from_secs(20);
    c.request_timeout = Some(Duration::from_secs(20));
    c.shutdown_grace = Duration::from_secs(2);
    c
}

impl TestRouter {
    /// Starts the router and waits until it is ready and every worker has been polled.
    pub async fn start(config: RouterConfig) -> Self {
        let (decode, prefill) = (config.decode_urls.len(), config.prefill_urls.len());
        let r = Self::start_unready(config).await;
        r.wait_healthy(decode, prefill).await;
        r
    }

    /// Starts the router without waiting for its workers.
    pub async fn start_unready(config: RouterConfig) -> Self {
        Self::start_with_resolver(config, Arc::new(tandem_router::SystemResolver)).await
    }

    /// Starts the router, resolving its `dns://` entries with `resolver`, without waiting.
    pub async fn start_with_resolver(
        config: RouterConfig,
        resolver: Arc<dyn tandem_router::Resolve>,
    ) -> Self {
        init_logging();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let shutdown = CancellationToken::new();
        let handle = tokio::spawn(tandem_router::run_with_resolver(
            config,
            listener,
            shutdown.clone(),
            resolver,
        ));
        TestRouter {
            url,
            shutdown,
            handle,
        }
    }

    /// Waits (10 s at most) until `/health` is 200 with at least `decode` healthy decode
    /// and `prefill` healthy prefill workers.
    pub async fn wait_healthy(&self, decode: usize, prefill: usize) {
        let client = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(r) = client.get(format!("{}/health", self.url)).send().await
                && r.status() == 200
                && let Ok(v) = r.json::<serde_json::Value>().await
                && v["prefill_workers_healthy"].as_u64().unwrap_or(0) >= prefill as u64
                && v["decode_workers_healthy"].as_u64().unwrap_or(0) >= decode as u64
            {
                return;
            }
            assert!(Instant::now() < deadline, "router never became healthy");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        let r = tokio::time::timeout(Duration::from_secs(5), self.handle)
            .await
            .expect("router stops in time")
            .expect("router task");
        r.expect("router ran cleanly");
    }
}

/// Router logs on stderr when `TANDEM_TEST_LOG` is set (e.g. `TANDEM_TEST_LOG=debug`).
fn init_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Ok(filter) = std::env::var("TANDEM_TEST_LOG") {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
                .with_test_writer()
                .try_init();
        }
    });
}

/// Polls `f` every 10 ms until it holds or `within` passes.
pub async fn eventually(within: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// One decode and one prefill fake, and a router over them.
pub async fn setup() -> (FakeDecode, FakePrefill, FakeServer, FakeServer, TestRouter) {
    setup_with(|_| {}).await
}

/// [`setup`], with the router's config changed by `configure` first.
pub async fn setup_with(
    configure: impl FnOnce(&mut RouterConfig),
) -> (FakeDecode, FakePrefill, FakeServer, FakeServer, TestRouter) {
    let decode = FakeDecode::new("decode-0");
    let prefill = FakePrefill::new("prefill-0");
    let ds = FakeServer::decode(&decode);
    let ps = FakeServer::prefill(&prefill);
    let mut c = config(&[&ps], &[&ds]);
    configure(&mut c);
    let router = TestRouter::start(c).await;
    (decode, prefill, ds, ps, router)
}

/// The router binary on a free loopback port, with `args` after `--host` and `--port` and
/// without the environment's API key; and its URL.
pub fn spawn_binary(args: &[&str]) -> (std::process::Child, String) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_tandem-router"))
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(args)
        .env_remove("TANDEM_API_KEY")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    (child, format!("http://127.0.0.1:{port}"))
}

/// Polls a binary's `/health` (5 s at most) until it answers 200: its body, or None.
pub async fn binary_health(url: &str) -> Option<Value> {
    for _ in 0..200 {
        if let Ok(r) = client().get(format!("{url}/health")).send().await
            && r.status() == 200
        {
            return Some(r.json().await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    None
}
