//! The HTTP accept loop, with every client connection bounded: at most
//! `--max-connections` open at once (more are closed as they arrive, a count in
//! `tandem_router_connections_refused_total`), and a connection that does not send a whole
//! request head within `--header-read-timeout-ms` (a slowloris, a half-sent request, an idle
//! keep-alive) is closed. Request bodies are bounded in size and time by the JSON extractor
//! (`api::extract`); the response side by the request deadline and the event buffer.
//!
//! Written on hyper-util directly because `axum::serve` does not expose hyper's header
//! timeout. On shutdown it stops accepting and lets open connections finish their requests
//! (the caller bounds how long).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::metrics as m;

/// Bounds of client connections.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
}

/// Refused connections are logged at most once a second.
static REFUSED: tandem_auth::RateLimitedLog =
    tandem_auth::RateLimitedLog::new(Duration::from_secs(1));

/// Serves `app` on `listener` until `shutdown` is cancelled, then waits for the open
/// connections to finish.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    builder.http2().timer(TokioTimer::new());
    let builder = Arc::new(builder);
    loop {
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accepting a client connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            metrics::counter!(m::CONNECTIONS_REFUSED_TOTAL).increment(1);
            REFUSED.note(|suppressed| {
                tracing::warn!(
                    %peer,
                    suppressed,
                    limit = limits.max_connections,
                    "client connection closed: the router serves at most this many at once"
                );
            });
            drop(stream);
            continue;
        };
        // Token streams are many small writes: without TCP_NODELAY, Nagle's algorithm and
        // the client's delayed ACKs hold each SSE chunk back by up to tens of milliseconds.
        if let Err(e) = stream.set_nodelay(true) {
            tracing::warn!(error = %e, "cannot set TCP_NODELAY on a client connection");
        }
        let service = TowerToHyperService::new(app.clone());
        let builder = Arc::clone(&builder);
        let connection = graceful.watch(
            builder
                .serve_connection_with_upgrades(TokioIo::new(stream), service)
                .into_owned(),
        );
        tokio::spawn(async move {
            let _slot = slot;
            metrics::gauge!(m::OPEN_CONNECTIONS).increment(1.0);
            if let Err(e) = connection.await {
                tracing::debug!(%peer, error = %e, "client connection ended with an error");
            }
            metrics::gauge!(m::OPEN_CONNECTIONS).decrement(1.0);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}
