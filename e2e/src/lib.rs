//! Test support for tandem's end-to-end tests: start the real binaries (`tandem-prefill`,
//! `tandem-decode`, `tandem-router`) on free loopback ports, wait until they answer, and
//! stop them when the test ends (also on panic).
//!
//! The binaries are found next to the test executable's `target/<profile>` folder; `cargo test
//! --workspace` builds them before any test runs. A missing binary is a clear error.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tandem_proto::v1::decode_service_client::DecodeServiceClient;
use tandem_proto::v1::prefill_service_client::PrefillServiceClient;
use tandem_proto::v1::{InfoRequest, WorkerInfo};
use tonic::transport::Channel;

/// Path of a workspace binary built beside the tests.
pub fn binary(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    // target/<profile>/deps/<test> → target/<profile>/<name>
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .context("test executable has no parent")?;
    let path = dir.join(name);
    if !path.exists() {
        bail!(
            "{} not found: run `cargo build --workspace` (or `cargo test --workspace`) first",
            path.display()
        );
    }
    Ok(path)
}

/// A free TCP port on 127.0.0.1 (the listener is closed right away, so a race is possible
/// but harmless in practice: tests retry startup on a bind failure).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(0)
}

/// A running child process, killed on drop.
#[derive(Debug)]
pub struct Proc {
    pub name: String,
    pub port: u16,
    child: Child,
}

impl Proc {
    /// Starts `binary` with `args` and `--port PORT` on a free port.
    pub fn start(bin: &str, args: &[&str]) -> anyhow::Result<Self> {
        let port = free_port();
        let mut cmd = Command::new(binary(bin)?);
        cmd.args(args).arg("--port").arg(port.to_string());
        cmd.env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
        );
        cmd.stdout(Stdio::null()).stderr(Stdio::inherit());
        let child = cmd.spawn().with_context(|| format!("starting {bin}"))?;
        Ok(Self {
            name: bin.to_string(),
            port,
            child,
        })
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills the process at once (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Whether the process has exited.
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Waits until a decode worker answers `GetInfo`.
pub async fn decode_client(
    endpoint: &str,
    timeout: Duration,
) -> anyhow::Result<(DecodeServiceClient<Channel>, WorkerInfo)> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(mut c) = DecodeServiceClient::connect(endpoint.to_string()).await
            && let Ok(info) = c
                .get_info(InfoRequest {
                    include_tokenizer: true,
                })
                .await
        {
            return Ok((c, info.into_inner()));
        }
        if Instant::now() > deadline {
            bail!("decode worker at {endpoint} did not answer within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until a prefill worker answers `GetInfo`.
pub async fn prefill_client(
    endpoint: &str,
    timeout: Duration,
) -> anyhow::Result<(PrefillServiceClient<Channel>, WorkerInfo)> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(mut c) = PrefillServiceClient::connect(endpoint.to_string()).await
            && let Ok(info) = c
                .get_info(InfoRequest {
                    include_tokenizer: false,
                })
                .await
        {
            return Ok((c, info.into_inner()));
        }
        if Instant::now() > deadline {
            bail!("prefill worker at {endpoint} did not answer within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until `GET url` answers 2xx.
pub async fn wait_http_ok(url: &str, timeout: Duration) -> anyhow::Result<()> {
    let client = reqwest::Client::new();
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(r) = client.get(url).send().await
            && r.status().is_success()
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{url} did not answer 2xx within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub mod kv_stub {
    //! A decode service that only receives KV (`PushKv`, `CommitKv`) into a lease table: for
    //! measuring transports without a model.

    use std::pin::Pin;
    use std::sync::Arc;

    use tandem_proto::v1::decode_service_server::DecodeService;
    use tandem_proto::v1::*;
    use tandem_transfer::{LeaseTable, receive_push_kv};
    use tonic::{Request, Response, Status, Streaming};

    pub struct KvOnlyDecode {
        pub table: Arc<LeaseTable>,
    }

    type Events = Pin<Box<dyn futures::Stream<Item = Result<GenerateEvent, Status>> + Send>>;

    #[tonic::async_trait]
    impl DecodeService for KvOnlyDecode {
        type GenerateStream = Events;
        async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<WorkerInfo>, Status> {
            Err(Status::unimplemented("KV only"))
        }
        async fn get_load(&self, _: Request<LoadRequest>) -> Result<Response<LoadReport>, Status> {
            Err(Status::unimplemented("KV only"))
        }
        async fn generate(&self, _: Request<GenerateRequest>) -> Result<Response<Events>, Status> {
            Err(Status::unimplemented("KV only"))
        }
        async fn push_kv(
            &self,
            req: Request<Streaming<KvMessage>>,
        ) -> Result<Response<KvAck>, Status> {
            let bytes = receive_push_kv(&self.table, &mut req.into_inner()).await?;
            Ok(Response::new(KvAck {
                bytes_received: bytes,
            }))
        }
        async fn commit_kv(&self, req: Request<KvCommit>) -> Result<Response<KvAck>, Status> {
            let bytes = self.table.commit(&req.into_inner())?;
            Ok(Response::new(KvAck {
                bytes_received: bytes,
            }))
        }
    }
}
