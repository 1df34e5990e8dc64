//! How a worker binary starts and stops, the same for both roles: the secret refused on the
//! command line, tracing, the engine's configuration and compute threads from the flags (bad
//! flags fail before a runtime starts or a model loads), the async runtime, then the shutdown
//! signal, the credentials and the gRPC listener.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tandem_auth::InternalAuth;
use tandem_cli::{EngineArgs, ServerArgs};
use tandem_engine::EngineConfig;
use tokio::net::TcpListener;

use crate::args::{engine_config, init_compute, internal_auth};
use crate::telemetry::{init_tracing, shutdown_signal};

/// Why a worker could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("{0}")]
    Flags(String),
    #[error(transparent)]
    SecretOnCommandLine(tandem_auth::AuthError),
    #[error("internal authentication: {0}")]
    Auth(#[from] tandem_auth::AuthError),
    #[error("starting the async runtime: {0}")]
    Runtime(std::io::Error),
    #[error("binding {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
}

/// Runs a worker binary: refuses a secret on its command line (`ps` shows every process's
/// command line to every user), parses the flags, sets up tracing and the engine's
/// configuration and compute threads from `server` and `engine` (parts of the flags), then,
/// on a runtime of its own, [`open`]s the worker (its gRPC port is the flag's, else
/// `default_port`) and hands it to `run`. A model load still running on a blocking thread
/// (stopped during startup) does not hold the exit.
pub fn run_worker<A, E, Fut>(
    parse: fn() -> A,
    parts: fn(&A) -> (&ServerArgs, &EngineArgs),
    default_port: u16,
    run: impl FnOnce(A, EngineConfig, Opened) -> Fut,
) -> Result<(), E>
where
    Fut: Future<Output = Result<(), E>>,
    E: From<StartError>,
{
    tandem_auth::refuse_secret_on_command_line(std::env::args_os())
        .map_err(StartError::SecretOnCommandLine)?;
    let args = parse();
    let (server, engine) = parts(&args);
    init_tracing(server.log.log_format);
    let config = engine_config(engine).map_err(StartError::Flags)?;
    init_compute(engine).map_err(StartError::Flags)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(StartError::Runtime)?;
    let result = runtime.block_on(async {
        let opened = open(parts(&args).0, default_port).await?;
        run(args, config, opened).await
    });
    runtime.shutdown_timeout(Duration::from_secs(2));
    result
}

/// What a worker opens before it loads its model.
pub struct Opened {
    /// Resolves on SIGINT or SIGTERM; listened for first, so that nothing can be left behind.
    pub shutdown: Pin<Box<dyn Future<Output = ()> + Send>>,
    pub auth: InternalAuth,
    pub grpc: TcpListener,
}

impl std::fmt::Debug for Opened {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opened").field("grpc", &self.grpc).finish()
    }
}

/// Listens for shutdown, loads the credentials (refusing a non-loopback address without a
/// secret) and binds the gRPC port (the flag's, else `default_port`).
pub async fn open(server: &ServerArgs, default_port: u16) -> Result<Opened, StartError> {
    let shutdown = shutdown_signal();
    let auth = internal_auth(server)?;
    let grpc = bind(server, server.port.unwrap_or(default_port)).await?;
    Ok(Opened {
        shutdown,
        auth,
        grpc,
    })
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
