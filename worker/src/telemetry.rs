//! Logging setup and the shutdown signal.

use tracing_subscriber::EnvFilter;

/// Logs to stderr, filtered by `RUST_LOG` (default `info`), as text or JSON lines.
pub fn init_tracing(format: tandem_cli::LogFormat) {
    let json = format == tandem_cli::LogFormat::Json;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let result = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
    if let Err(e) = result {
        eprintln!("tracing already initialised: {e}");
    }
}

/// Listens for Ctrl-C (SIGINT) and SIGTERM from now on, and resolves on the first. Call it
/// first thing inside the runtime: a signal that arrives while the model loads then stops
/// the worker cleanly (and its shared files are removed) instead of killing it.
pub fn shutdown_signal() -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(mut term), Ok(mut int)) => Box::pin(async move {
                tokio::select! {
                    _ = term.recv() => tracing::info!("SIGTERM received"),
                    _ = int.recv() => tracing::info!("SIGINT received"),
                }
            }),
            _ => {
                tracing::warn!("cannot listen for SIGTERM; only Ctrl-C stops this process cleanly");
                Box::pin(async {
                    let _ = tokio::signal::ctrl_c().await;
                })
            }
        }
    }
    #[cfg(not(unix))]
    Box::pin(async {
        let _ = tokio::signal::ctrl_c().await;
    })
}
