//! Fake workers served for real: each on its own thread and runtime, so that `kill` drops
//! every connection at once, as a crashed process would.

use std::net::SocketAddr;

use tandem_proto::v1::decode_service_server::DecodeServiceServer;
use tandem_proto::v1::prefill_service_server::PrefillServiceServer;
use tokio::sync::oneshot;
use tokio_stream::wrappers::TcpListenerStream;

use super::fake_decode::FakeDecode;
use super::fake_prefill::FakePrefill;

/// A fake worker serving on its own thread and runtime.
#[derive(Debug)]
pub struct FakeServer {
    pub url: String,
    pub addr: SocketAddr,
    kill: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

pub enum Service {
    Decode(FakeDecode),
    Prefill(FakePrefill),
}

impl FakeServer {
    pub fn decode(decode: &FakeDecode) -> Self {
        Self::start(Service::Decode(decode.clone()))
    }

    pub fn prefill(prefill: &FakePrefill) -> Self {
        Self::start(Service::Prefill(prefill.clone()))
    }

    pub fn start(service: Service) -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        Self::start_on(listener, service)
    }

    /// Serves on an already bound listener (so a router can be pointed at it first).
    pub fn start_on(listener: std::net::TcpListener, service: Service) -> Self {
        let addr = listener.local_addr().expect("addr");
        listener.set_nonblocking(true).expect("nonblocking");
        let (kill_tx, kill_rx) = oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
                let incoming = TcpListenerStream::new(listener);
                let mut builder = tonic::transport::Server::builder();
                let router = match service {
                    Service::Decode(d) => builder.add_service(DecodeServiceServer::new(d)),
                    Service::Prefill(p) => builder.add_service(PrefillServiceServer::new(p)),
                };
                tokio::select! {
                    r = router.serve_with_incoming(incoming) => {
                        if let Err(e) = r { eprintln!("fake worker stopped: {e}"); }
                    }
                    _ = kill_rx => {}
                }
            });
            // Dropping the runtime drops every connection task: the peer sees the process die.
            drop(rt);
        });
        FakeServer {
            url: format!("http://{addr}"),
            addr,
            kill: Some(kill_tx),
            thread: Some(thread),
        }
    }

    /// Stops the worker abruptly, closing all its connections.
    pub fn kill(&mut self) {
        if let Some(k) = self.kill.take() {
            let _ = k.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for FakeServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A URL where nothing listens.
pub fn dead_url() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    drop(l);
    format!("http://{addr}")
}
