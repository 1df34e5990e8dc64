//! The two tower services that put call tokens on the wire: [`AttachToken`] wraps a client
//! channel and adds a fresh token to every call; [`RequireToken`] wraps a server and answers
//! `UNAUTHENTICATED` to a call without a valid one before the service (or its request body)
//! is touched. gRPC health checks stay open: they reveal only "serving", and Kubernetes'
//! gRPC probes cannot send metadata.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime};

use http::header::AUTHORIZATION;
use tower::{Layer, Service};

use crate::error::AuthError;
use crate::internal::InternalAuth;

/// A gRPC client channel that signs its calls.
pub type AuthChannel = AttachToken<tonic::transport::Channel>;

/// A tonic server whose services require call tokens.
pub type GuardedServer = tonic::transport::Server<
    tower::layer::util::Stack<RequireTokenLayer, tower::layer::util::Identity>,
>;

/// The tower side of [`InternalAuth`]: clients that sign their calls, servers that check them.
impl InternalAuth {
    /// Wraps a channel so that its calls carry tokens.
    pub fn channel(&self, channel: tonic::transport::Channel) -> AuthChannel {
        AttachToken::new(channel, self.clone())
    }

    /// The layer that guards a tonic server's services.
    pub fn server_layer(&self) -> RequireTokenLayer {
        RequireTokenLayer::new(self.clone())
    }

    /// A tonic server builder that checks call tokens on every service but health, over
    /// mutual TLS when configured.
    pub fn server_builder(&self) -> Result<GuardedServer, AuthError> {
        let mut builder = tonic::transport::Server::builder();
        if let Some(tls) = self.server_tls() {
            builder = builder
                .tls_config(tls)
                .map_err(|e| AuthError::Config(format!("internal TLS: {e}")))?;
        }
        Ok(builder.layer(self.server_layer()))
    }
}

/// The gRPC health service's path prefix: never guarded.
const HEALTH_PREFIX: &str = "/grpc.health.v1.Health/";

/// A client channel that signs every call (see `token`).
#[derive(Debug, Clone)]
pub struct AttachToken<S> {
    inner: S,
    auth: InternalAuth,
}

impl<S> AttachToken<S> {
    pub fn new(inner: S, auth: InternalAuth) -> Self {
        Self { inner, auth }
    }
}

impl<S, B> Service<http::Request<B>> for AttachToken<S>
where
    S: Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        if let Some(token) = self.auth.call_token(req.uri().path()) {
            req.headers_mut().insert(AUTHORIZATION, token);
        }
        self.inner.call(req)
    }
}

/// Puts [`RequireToken`] in front of every service of a tonic server.
#[derive(Debug, Clone)]
pub struct RequireTokenLayer {
    auth: InternalAuth,
}

impl RequireTokenLayer {
    pub fn new(auth: InternalAuth) -> Self {
        Self { auth }
    }
}

impl<S> Layer<S> for RequireTokenLayer {
    type Service = RequireToken<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RequireToken {
            inner,
            auth: self.auth.clone(),
        }
    }
}

/// A server that refuses calls without a valid token.
#[derive(Debug, Clone)]
pub struct RequireToken<S> {
    inner: S,
    auth: InternalAuth,
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, B> Service<http::Request<B>> for RequireToken<S>
where
    S: Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let path = req.uri().path();
        if path.starts_with(HEALTH_PREFIX) {
            return Box::pin(self.inner.call(req));
        }
        let header = req.headers().get(AUTHORIZATION).map(|v| v.as_bytes());
        match self
            .auth
            .verify_call(path, header, SystemTime::now(), Instant::now())
        {
            Ok(()) => Box::pin(self.inner.call(req)),
            Err(e) => {
                let peer = req
                    .extensions()
                    .get::<tonic::transport::server::TcpConnectInfo>()
                    .and_then(|i| i.remote_addr());
                REFUSALS.note(|suppressed| {
                    tracing::warn!(
                        ?peer,
                        path,
                        reason = %e,
                        suppressed,
                        "refused an unauthenticated call"
                    );
                });
                let status = tonic::Status::unauthenticated(format!(
                    "this tandem worker requires the deployment's internal secret: {e}"
                ));
                Box::pin(std::future::ready(Ok(status.into_http())))
            }
        }
    }
}

/// Refusals are logged at most once a second (a stranger's flood must not flood the logs);
/// each log line says how many were not logged since the last.
static REFUSALS: RateLimitedLog = RateLimitedLog::new(Duration::from_secs(1));

/// A log statement that runs at most once per `every` (for events a stranger can trigger at
/// will: refused calls and connections).
#[derive(Debug)]
pub struct RateLimitedLog {
    every_ms: u64,
    last_ms: AtomicU64,
    suppressed: AtomicU64,
}

impl RateLimitedLog {
    pub const fn new(every: Duration) -> Self {
        Self {
            every_ms: every.as_millis() as u64,
            last_ms: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// Runs `log` with the number of suppressed events, or counts this one as suppressed.
    pub fn note(&self, log: impl FnOnce(u64)) {
        static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        let now = START.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1;
        let last = self.last_ms.load(Ordering::Relaxed);
        if (last == 0 || now.saturating_sub(last) >= self.every_ms)
            && self
                .last_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            log(self.suppressed.swap(0, Ordering::Relaxed));
        } else {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_limited_log_counts_what_it_suppresses() {
        let log = RateLimitedLog::new(Duration::from_secs(3600));
        let mut lines = Vec::new();
        for _ in 0..5 {
            log.note(|s| lines.push(s));
        }
        assert_eq!(lines, [0], "one line, then silence");
        assert_eq!(log.suppressed.load(Ordering::Relaxed), 4);
    }
}
