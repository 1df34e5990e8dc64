//! How a worker binary starts and stops, the same for both roles: tracing, the engine's
//! configuration and compute threads from the flags (bad flags fail before a runtime starts
//! or a model loads), the async runtime, and the gRPC listener.

use std::future::Future;
use std::time::Duration;

use tandem_cli::{EngineArgs, ServerArgs};
use tandem_engine::EngineConfig;
use tokio::net::TcpListener;

use crate::args::{engine_config, init_compute};
use crate::telemetry::init_tracing;

/// Why a worker could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("{0}")]
    Flags(String),
    #[error("starting the async runtime: {0}")]
    Runtime(std::io::Error),
    #[error("binding {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
}

/// Runs a worker binary: sets up tracing, the engine's configuration and compute threads
/// from `server` and `engine` (parts of `args`), then `run(args, config)` on a runtime of
/// its own. A model load still running on a blocking thread (stopped during startup) does
/// not hold the exit.
pub fn run_worker<A, E, Fut>(
    args: A,
    parts: fn(&A) -> (&ServerArgs, &EngineArgs),
    run: impl FnOnce(A, EngineConfig) -> Fut,
) -> Result<(), E>
where
    Fut: Future<Output = Result<(), E>>,
    E: From<StartError>,
{
    let (server, engine) = parts(&args);
    init_tracing(server.log.log_format);
    let config = engine_config(engine).map_err(StartError::Flags)?;
    init_compute(engine).map_err(StartError::Flags)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(StartError::Runtime)?;
    let result = runtime.block_on(run(args, config));
    runtime.shutdown_timeout(Duration::from_secs(2));
    result
}

/// Binds `port` on the flags' host (the worker's gRPC port, or another it serves).
pub async fn bind(server: &ServerArgs, port: u16) -> Result<TcpListener, StartError> {
    TcpListener::bind((server.host.as_str(), port))
        .await
        .map_err(|source| StartError::Bind {
            addr: format!("{}:{port}", server.host),
            source,
        })
}
