//! tandem-router: the HTTP front door of tandem. It speaks OpenAI (`/v1/completions`,
//! `/v1/chat/completions`, `/v1/models`) and TGI (`/generate`, `/generate_stream`), owns the
//! tokenizer, picks a prefill and a decode worker per request, joins the two phases over the
//! workers' gRPC services (`tandem-proto`), and streams tokens back.
//!
//! It must not depend on the engine or the worker crates: everything it knows about a worker
//! comes over the wire (`GetInfo`, `GetLoad`, `Generate`, `Prefill`).
//!
//! Modules: `config` (flags → `RouterConfig`), `serve` (the bounded accept loop), `api`
//! (HTTP), `flow` (one request across the workers), `routing` (pure policy), `workers` (pool
//! and health), `discovery` (`dns://` entries, re-resolved), `admission` (concurrency and
//! queue bounds), `model` (tokenizer, template), `auth` (the public API key; the workers'
//! internal credentials are `tandem-auth`'s), `error` (`ApiError`, which every layer makes and
//! only `api` renders), `metrics`.

pub mod admission;
pub mod api;
pub mod auth;
pub mod config;
pub mod discovery;
pub mod error;
pub mod flow;
pub mod fuzzing;
pub mod metrics;
pub mod model;
pub mod routing;
pub mod serve;
pub mod workers;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use config::{ConfigError, FallbackPolicy, RouterArgs, RouterConfig, RoutingPolicy};
pub use discovery::{Resolve, ResolveError, SystemResolver};

/// Why the router stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("worker setup: {0}")]
    Workers(String),
    #[error("startup: {0}")]
    Startup(String),
    #[error("HTTP server: {0}")]
    Serve(#[from] std::io::Error),
}

/// How often the Prometheus recorder drains its histogram buffers.
const METRICS_UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// Serves the router on `listener` until `shutdown` is cancelled.
///
/// Answers HTTP at once (`/health` is 503 and generation routes 503 + `Retry-After` until a
/// decode worker has handed over its tokenizer); fails with `RouterError::Startup` if none
/// has within `startup_timeout`, unless decode workers are found through DNS (they may
/// appear at any time: the router warns and keeps waiting). On shutdown it stops accepting,
/// lets running requests finish for up to `shutdown_grace`, then returns.
pub async fn run(
    config: RouterConfig,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), RouterError> {
    run_with_resolver(config, listener, shutdown, Arc::new(SystemResolver)).await
}

/// [`run`], resolving `dns://` entries with `resolver` instead of the system's.
pub async fn run_with_resolver(
    config: RouterConfig,
    listener: TcpListener,
    shutdown: CancellationToken,
    resolver: Arc<dyn Resolve>,
) -> Result<(), RouterError> {
    config.validate()?;
    let prometheus = metrics::prometheus();
    metrics::register_static_series();
    metrics::register_slo(&config.slo);
    let pool = Arc::new(
        workers::WorkerPool::new(
            &config.prefill_urls,
            &config.decode_urls,
            config.transport,
            config.served_model_name.clone(),
            config.internal_auth.clone(),
        )
        .map_err(RouterError::Workers)?,
    );
    // Background tasks stop with the server, whichever way it ends.
    let background = shutdown.child_token();
    let _stop_background = background.clone().drop_guard();
    pool.spawn_health_tasks(config.health_interval, &background);
    if config.elastic_threads {
        pool.spawn_thread_planner(config.slo.tpot_ms, &background);
    }
    discovery::spawn_discovery(&pool, resolver, config.dns_refresh, &background);
    {
        let prometheus = prometheus.clone();
        let background = background.clone();
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(METRICS_UPKEEP_INTERVAL);
            loop {
                tokio::select! {
                    _ = background.cancelled() => break,
                    _ = ticker.tick() => prometheus.run_upkeep(),
                }
            }
        });
    }
    let startup_timeout = config.startup_timeout;
    let shutdown_grace = config.shutdown_grace;
    let local = listener.local_addr()?;
    tracing::info!(
        address = %local,
        decode = ?config.decode_urls,
        prefill = ?config.prefill_urls,
        transport = config.transport.as_str_name(),
        "router listening"
    );
    if config.prefill_urls.is_empty() {
        tracing::info!("no prefill workers configured: every request runs aggregated");
    }
    let limits = serve::ConnectionLimits {
        max_connections: config.max_connections,
        header_read_timeout: config.header_read_timeout,
    };
    let app = api::app(api::state::AppState::new(
        config,
        Arc::clone(&pool),
        prometheus,
    ));
    let server = serve::serve(listener, app, limits, shutdown.clone());
    let startup = wait_for_model(&pool, startup_timeout, pool.discovers_decode_workers());
    let drain_limit = async {
        shutdown.cancelled().await;
        tracing::info!("shutting down: no new connections; running requests may finish");
        tokio::time::sleep(shutdown_grace).await;
    };
    tokio::select! {
        result = server => result?,
        error = startup => return Err(error),
        _ = drain_limit => tracing::warn!("shutdown grace period over; cutting remaining requests"),
    }
    tracing::info!("router stopped");
    Ok(())
}

/// Resolves only with an error: when no decode worker handed over the model in time. With
/// `patient` (decode workers come from DNS, and a Deployment may scale up after its router
/// starts) it warns once per `timeout` instead and never fails.
async fn wait_for_model(
    pool: &workers::WorkerPool,
    timeout: Duration,
    patient: bool,
) -> RouterError {
    let mut started = Instant::now();
    let mut ticker = tokio::time::interval(Duration::from_millis(50));
    loop {
        ticker.tick().await;
        if pool.model().is_some() {
            return std::future::pending().await;
        }
        if started.elapsed() < timeout {
            continue;
        }
        if !patient {
            return RouterError::Startup(format!(
                "no decode worker answered GetInfo with a usable tokenizer within {} s",
                timeout.as_secs()
            ));
        }
        tracing::warn!(
            waited_s = timeout.as_secs(),
            "no discovered decode worker has handed over the model yet; still waiting"
        );
        started = Instant::now();
    }
}
