//! Test harness: scripted fake prefill and decode workers (real tonic servers on
//! 127.0.0.1:0, each on its own thread and runtime so that `kill` drops every connection as a
//! crashed process would), and an in-process router on a pre-bound listener.

#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_proto::v1::decode_service_client::DecodeServiceClient;
use tandem_proto::v1::decode_service_server::{DecodeService, DecodeServiceServer};
use tandem_proto::v1::generate_event::Event;
use tandem_proto::v1::prefill_service_server::{PrefillService, PrefillServiceServer};
use tandem_proto::v1::*;
use tandem_router::RouterConfig;
use tandem_text::TextTokenizer;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_util::sync::CancellationToken;
use tonic::{Code, Request, Response, Status};

pub const MODEL: &str = "fake-model";
pub const CONTEXT: u32 = 128;
pub const KV_BYTES: u64 = 4096;
pub const KV_TCP_PORT: u32 = 7301;
/// EOS of the byte-level test tokenizer (`<|im_end|>`).
pub const EOS: u32 = 2;

/// The test tokenizer: one token per byte, id = 3 + byte.
pub fn tokenizer() -> TextTokenizer {
    TextTokenizer::byte_level()
}

/// `(id, text)` per byte of `text`, as the fake decode worker streams them.
pub fn text_tokens(text: &str) -> Vec<(u32, String)> {
    text.bytes()
        .map(|b| (3 + u32::from(b), (b as char).to_string()))
        .collect()
}

/// Locks a test mutex, ignoring poisoning (a failed assertion elsewhere must not cascade).
pub fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

// ---------------------------------------------------------------------------------------
// Fake decode worker

/// What the fake decode worker does with each Generate.
#[derive(Debug, Clone)]
pub struct DecodeScript {
    /// Tokens to stream (at most `max_tokens` of them); ending early means EOS.
    pub tokens: Vec<(u32, String)>,
    pub token_delay: Duration,
    /// After this many tokens, fail the stream with Internal.
    pub fail_after: Option<usize>,
    /// Fail Generate at once with this code.
    pub generate_error: Option<Code>,
    /// Grant leases at most this long a wait without progress (as a worker's
    /// `--max-lease-ttl-ms` does), whatever the router asks.
    pub lease_ttl_cap_ms: Option<u32>,
    /// Prompt tokens its prefix cache holds (whole blocks, never the last token's): a lease
    /// skips them, or the request runs here when the rest is below `local_prefill_below`.
    pub cached_tokens: u32,
}

impl Default for DecodeScript {
    fn default() -> Self {
        let mut tokens = text_tokens("Hello from tandem!");
        tokens.push((EOS, String::new()));
        Self {
            tokens,
            token_delay: Duration::from_millis(1),
            fail_after: None,
            generate_error: None,
            lease_ttl_cap_ms: None,
            cached_tokens: 0,
        }
    }
}

#[derive(Debug)]
pub struct DecodeState {
    pub info: Mutex<WorkerInfo>,
    pub load: Mutex<LoadReport>,
    pub script: Mutex<DecodeScript>,
    pub generate_calls: Mutex<Vec<GenerateRequest>>,
    pub leases: Mutex<Vec<Lease>>,
    pub commits: Mutex<Vec<KvCommit>>,
    /// Lease ids the router renewed while its prefill was pending.
    pub renewals: Mutex<Vec<Vec<u8>>>,
    /// When a Generate stream was closed by the router before it finished.
    pub closed_early: Mutex<Vec<Instant>>,
    pub info_calls: AtomicU64,
    waiting: Mutex<HashMap<Vec<u8>, oneshot::Sender<KvCommit>>>,
    next_lease: AtomicU64,
}

/// A scripted DecodeService.
#[derive(Debug, Clone)]
pub struct FakeDecode(pub Arc<DecodeState>);

impl FakeDecode {
    pub fn new(name: &str) -> Self {
        let tok = tokenizer();
        let spec = TokenizerSpec {
            tokenizer_json: tok.to_json().expect("tokenizer json"),
            bos_token: tok.info().bos_token.clone(),
            eos_token: tok.info().eos_token.clone(),
            eos_token_ids: tok.info().eos_token_ids.clone(),
            chat_template: tok.info().chat_template.clone(),
        };
        let info = WorkerInfo {
            worker_id: name.into(),
            role: Role::Decode as i32,
            model_name: MODEL.into(),
            kv_layout_hash: "hash-A".into(),
            kv_layout: Some(KvLayout {
                num_layers: 2,
                num_kv_heads: 1,
                head_dim: 8,
                block_size: 16,
                dtype: "f32".into(),
                model_fingerprint: "fp".into(),
            }),
            context_length: CONTEXT,
            vocab_size: u32::try_from(tok.vocab_size()).unwrap_or(u32::MAX),
            tokenizer: Some(spec),
            transports: vec![
                Transport::Grpc as i32,
                Transport::Tcp as i32,
                Transport::Shm as i32,
            ],
            shm_path: format!("/dev/shm/{name}"),
            shm_bytes: 1 << 20,
            kv_tcp_port: KV_TCP_PORT,
            advertise_host: String::new(),
            total_blocks: 64,
            protocol_version: tandem_proto::PROTOCOL_VERSION,
            instance_id: format!("{name:16}").into_bytes(),
            ..WorkerInfo::default()
        };
        FakeDecode(Arc::new(DecodeState {
            info: Mutex::new(info),
            load: Mutex::new(LoadReport {
                total_blocks: 64,
                free_blocks: 64,
                ..Default::default()
            }),
            script: Mutex::new(DecodeScript::default()),
            generate_calls: Mutex::default(),
            leases: Mutex::default(),
            commits: Mutex::default(),
            renewals: Mutex::default(),
            closed_early: Mutex::default(),
            info_calls: AtomicU64::new(0),
            waiting: Mutex::default(),
            next_lease: AtomicU64::new(100),
        }))
    }

    pub fn set_script(&self, script: DecodeScript) {
        *lock(&self.0.script) = script;
    }

    pub fn generate_calls(&self) -> Vec<GenerateRequest> {
        lock(&self.0.generate_calls).clone()
    }

    pub fn closed_early(&self) -> Vec<Instant> {
        lock(&self.0.closed_early).clone()
    }
}

type EventStream = ReceiverStream<Result<GenerateEvent, Status>>;

fn event(e: Event) -> Result<GenerateEvent, Status> {
    Ok(GenerateEvent { event: Some(e) })
}

#[tonic::async_trait]
impl DecodeService for FakeDecode {
    type GenerateStream = EventStream;
    type PullKvStream = tokio_stream::wrappers::ReceiverStream<Result<KvBlocks, Status>>;

    async fn get_info(&self, req: Request<InfoRequest>) -> Result<Response<WorkerInfo>, Status> {
        self.0.info_calls.fetch_add(1, Ordering::SeqCst);
        let mut info = lock(&self.0.info).clone();
        if !req.into_inner().include_tokenizer {
            info.tokenizer = None;
        }
        Ok(Response::new(info))
    }

    async fn get_load(&self, _: Request<LoadRequest>) -> Result<Response<LoadReport>, Status> {
        Ok(Response::new(lock(&self.0.load).clone()))
    }

    async fn generate(
        &self,
        req: Request<GenerateRequest>,
    ) -> Result<Response<EventStream>, Status> {
        let req = req.into_inner();
        lock(&self.0.generate_calls).push(req.clone());
        let script = lock(&self.0.script).clone();
        if let Some(code) = script.generate_error {
            return Err(Status::new(code, "scripted Generate failure"));
        }
        let (tx, rx) = mpsc::channel(16);
        let state = Arc::clone(&self.0);
        tokio::spawn(async move {
            let work = run_generate(&state, &req, &script, &tx);
            tokio::select! {
                _ = work => {}
                _ = tx.closed() => lock(&state.closed_early).push(Instant::now()),
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn push_kv(
        &self,
        _: Request<tonic::Streaming<KvMessage>>,
    ) -> Result<Response<KvAck>, Status> {
        Err(Status::unimplemented("the fake takes commits only"))
    }

    async fn commit_kv(&self, req: Request<KvCommit>) -> Result<Response<KvAck>, Status> {
        let commit = req.into_inner();
        lock(&self.0.commits).push(commit.clone());
        let waiter = lock(&self.0.waiting).remove(&commit.lease);
        match waiter {
            Some(tx) => {
                let bytes = commit.bytes;
                let _ = tx.send(commit);
                Ok(Response::new(KvAck {
                    bytes_received: bytes,
                }))
            }
            None => Err(Status::not_found("no such lease")),
        }
    }

    async fn renew_lease(
        &self,
        req: Request<RenewLeaseRequest>,
    ) -> Result<Response<RenewLeaseResponse>, Status> {
        let id = req.into_inner().lease;
        lock(&self.0.renewals).push(id.clone());
        let open = lock(&self.0.waiting).contains_key(&id);
        Ok(Response::new(RenewLeaseResponse { open }))
    }

    async fn pull_kv(
        &self,
        _: Request<PullKvRequest>,
    ) -> Result<Response<Self::PullKvStream>, Status> {
        Err(Status::unimplemented("the fake decode worker holds no KV"))
    }

    async fn open_nccl(
        &self,
        _: Request<OpenNcclRequest>,
    ) -> Result<Response<OpenNcclResponse>, Status> {
        Err(Status::unimplemented(
            "the fake decode worker has no device pool",
        ))
    }
}

async fn run_generate(
    state: &DecodeState,
    req: &GenerateRequest,
    script: &DecodeScript,
    tx: &mpsc::Sender<Result<GenerateEvent, Status>>,
) {
    let len = req.prompt.len() as u32;
    let cached = script.cached_tokens.min(len.saturating_sub(1) / 16 * 16);
    let mut disaggregated = req.mode == Mode::Disaggregated as i32;
    if disaggregated && cached > 0 && len - cached < req.local_prefill_below {
        let local = Event::Local(LocalPrefill {
            cached_tokens: cached,
        });
        if tx.send(event(local)).await.is_err() {
            return;
        }
        disaggregated = false;
    }
    let mut kv_bytes = 0;
    if disaggregated {
        let token = u128::from(state.next_lease.fetch_add(1, Ordering::SeqCst))
            .to_le_bytes()
            .to_vec();
        let blocks = req.prompt.len().div_ceil(16) as u32 - cached / 16;
        let ttl_ms = req
            .lease_ttl_ms
            .max(1)
            .min(script.lease_ttl_cap_ms.unwrap_or(u32::MAX));
        let lease = Lease {
            token: token.clone(),
            block_ids: (10..10 + blocks).collect(),
            ttl_ms,
            cached_tokens: cached,
        };
        let (commit_tx, mut commit_rx) = oneshot::channel();
        lock(&state.waiting).insert(token.clone(), commit_tx);
        lock(&state.leases).push(lease.clone());
        if tx.send(event(Event::Lease(lease))).await.is_err() {
            return;
        }
        // As a worker does: the lease expires after `ttl_ms` without a renewal or the commit.
        let ttl = Duration::from_millis(u64::from(ttl_ms));
        let renewals = |state: &DecodeState| {
            lock(&state.renewals)
                .iter()
                .filter(|t| **t == token)
                .count()
        };
        let mut seen = renewals(state);
        loop {
            match tokio::time::timeout(ttl, &mut commit_rx).await {
                Ok(Ok(commit)) => {
                    kv_bytes = commit.bytes;
                    break;
                }
                Err(_) if renewals(state) > seen => seen = renewals(state),
                _ => {
                    lock(&state.waiting).remove(&token);
                    let _ = tx
                        .send(Err(Status::deadline_exceeded("lease expired")))
                        .await;
                    return;
                }
            }
        }
    }
    let max = req.stop.as_ref().map_or(16, |s| s.max_tokens) as usize;
    // The alternatives a request asked for, plus one too many: the router must drop it.
    let alternatives = req.sampling.as_ref().map_or(0, |s| s.top_logprobs);
    let choices = req.sampling.as_ref().map_or(1, |s| s.n.max(1));
    let mut sent = 0u32;
    for (i, (id, text)) in script.tokens.iter().take(max).enumerate() {
        tokio::time::sleep(script.token_delay).await;
        if script.fail_after == Some(i) {
            let _ = tx
                .send(Err(Status::internal("scripted mid-stream failure")))
                .await;
            return;
        }
        // Every choice of an n > 1 request gets the script, interleaved token by token.
        for choice in 0..choices {
            let token = TokenEvent {
                id: *id,
                text: text.clone(),
                logprob: -0.5 - choice as f32,
                index: i as u32,
                special: *id == EOS,
                top_logprobs: if alternatives == 0 {
                    Vec::new()
                } else {
                    (0..=alternatives)
                        .map(|k| TopLogprob {
                            id: if k == 0 { *id } else { *id + k },
                            logprob: -0.5 - k as f32,
                        })
                        .collect()
                },
                choice,
                prompt_logprobs: if i == 0 && choice == 0 && !disaggregated {
                    fake_prompt_logprobs(&req.prompt, req.sampling.as_ref())
                } else {
                    Vec::new()
                },
            };
            if tx.send(event(Event::Token(token))).await.is_err() {
                return;
            }
        }
        sent += 1;
    }
    let reason = if sent as usize == max {
        FinishReason::Length
    } else {
        FinishReason::Stop
    };
    for choice in 0..choices {
        let _ = tx
            .send(event(Event::Finished(Finished {
                reason: reason as i32,
                prompt_tokens: req.prompt.len() as u32,
                completion_tokens: sent,
                kv_bytes,
                kv_wait_seconds: 0.001,
                transport: if disaggregated {
                    Transport::Shm as i32
                } else {
                    0
                },
                choice,
                cached_tokens: 0,
            })))
            .await;
    }
}

// ---------------------------------------------------------------------------------------
// Fake prefill worker

#[derive(Debug, Clone, Default)]
pub struct PrefillScript {
    pub delay: Duration,
    pub error: Option<Code>,
    /// Answer ABORTED (a failed KV transfer) when the destination is this decode endpoint.
    pub abort_for: Option<String>,
    /// Prompt tokens it says came from its prefix cache.
    pub cached_tokens: u32,
    /// Of those, tokens (and their bytes) it says it read back from the decode worker.
    pub pulled_tokens: u32,
    pub pulled_bytes: u64,
}

#[derive(Debug)]
pub struct PrefillState {
    pub info: Mutex<WorkerInfo>,
    pub script: Mutex<PrefillScript>,
    pub calls: Mutex<Vec<PrefillRequest>>,
    /// When a Prefill call was cancelled by the router before it answered.
    pub cancelled: Mutex<Vec<Instant>>,
}

/// A scripted PrefillService that commits on the decode worker named in the destination.
#[derive(Debug, Clone)]
pub struct FakePrefill(pub Arc<PrefillState>);

impl FakePrefill {
    pub fn new(name: &str) -> Self {
        FakePrefill(Arc::new(PrefillState {
            info: Mutex::new(WorkerInfo {
                worker_id: name.into(),
                role: Role::Prefill as i32,
                model_name: MODEL.into(),
                kv_layout_hash: "hash-A".into(),
                context_length: CONTEXT,
                transports: vec![
                    Transport::Grpc as i32,
                    Transport::Tcp as i32,
                    Transport::Shm as i32,
                ],
                protocol_version: tandem_proto::PROTOCOL_VERSION,
                ..Default::default()
            }),
            script: Mutex::default(),
            calls: Mutex::default(),
            cancelled: Mutex::default(),
        }))
    }

    pub fn set_script(&self, script: PrefillScript) {
        *lock(&self.0.script) = script;
    }

    pub fn calls(&self) -> Vec<PrefillRequest> {
        lock(&self.0.calls).clone()
    }

    pub fn cancelled(&self) -> Vec<Instant> {
        lock(&self.0.cancelled).clone()
    }
}

/// Records a cancellation if dropped before `done`.
struct CancelProbe {
    state: Arc<PrefillState>,
    done: bool,
}

impl Drop for CancelProbe {
    fn drop(&mut self) {
        if !self.done {
            lock(&self.state.cancelled).push(Instant::now());
        }
    }
}

#[tonic::async_trait]
impl PrefillService for FakePrefill {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<WorkerInfo>, Status> {
        Ok(Response::new(lock(&self.0.info).clone()))
    }

    async fn get_load(&self, _: Request<LoadRequest>) -> Result<Response<LoadReport>, Status> {
        Ok(Response::new(LoadReport::default()))
    }

    async fn prefill(
        &self,
        req: Request<PrefillRequest>,
    ) -> Result<Response<PrefillResponse>, Status> {
        let req = req.into_inner();
        lock(&self.0.calls).push(req.clone());
        let script = lock(&self.0.script).clone();
        let mut probe = CancelProbe {
            state: Arc::clone(&self.0),
            done: false,
        };
        tokio::time::sleep(script.delay).await;
        probe.done = true;
        if let Some(code) = script.error {
            return Err(Status::new(code, "scripted prefill failure"));
        }
        let dest = req
            .destination
            .ok_or_else(|| Status::invalid_argument("no destination"))?;
        if script.abort_for.as_deref() == Some(dest.decode_endpoint.as_str()) {
            return Err(Status::aborted(
                "KV transfer to the decode worker failed: scripted",
            ));
        }
        let mut decode = DecodeServiceClient::connect(dest.decode_endpoint.clone())
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let first_token = 3 + u32::from(b'H');
        decode
            .commit_kv(KvCommit {
                lease: dest.lease.clone(),
                kv_layout_hash: dest.kv_layout_hash.clone(),
                request_id: req.request_id.clone(),
                first_token,
                first_logprob: -0.5,
                num_tokens: req.prompt.len() as u32,
                checksums: Vec::new(),
                transport: dest.transport,
                bytes: KV_BYTES,
                first_top_logprobs: Vec::new(),
                other_choices: Vec::new(),
            })
            .await?;
        Ok(Response::new(PrefillResponse {
            first_token,
            first_logprob: -0.5,
            kv_bytes: KV_BYTES,
            transfer_seconds: 0.002,
            compute_seconds: 0.001,
            queue_seconds: 0.0,
            transport: dest.transport,
            first_top_logprobs: Vec::new(),
            other_choices: Vec::new(),
            prompt_logprobs: fake_prompt_logprobs(&req.prompt, req.sampling.as_ref()),
            cached_tokens: script.cached_tokens,
            pulled_tokens: script.pulled_tokens,
            pulled_bytes: script.pulled_bytes,
        }))
    }
}

/// What the fakes report for prompt logprobs when asked: prompt token i (from 1) at
/// -0.1 × i, rank i, and one alternative more than asked (id + k at -0.1 × i - k).
pub fn fake_prompt_logprobs(
    prompt: &[u32],
    sampling: Option<&SamplingParams>,
) -> Vec<PromptLogprob> {
    let Some(k) = sampling.and_then(|s| s.prompt_logprobs) else {
        return Vec::new();
    };
    (1..prompt.len())
        .map(|i| PromptLogprob {
            logprob: -0.1 * i as f32,
            rank: i as u32,
            top_logprobs: (1..=k + 1)
                .map(|a| TopLogprob {
                    id: prompt[i] + a,
                    logprob: -0.1 * i as f32 - a as f32,
                })
                .collect(),
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// Servers

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

// ---------------------------------------------------------------------------------------
// Router

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

/// The `data` payloads of an SSE body (`data:` with or without a space).
pub fn sse_payloads(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let e = e.trim();
            let rest = e
                .strip_prefix("data:")
                .unwrap_or_else(|| panic!("not a data event: {e:?}"));
            rest.strip_prefix(' ').unwrap_or(rest).to_string()
        })
        .collect()
}
