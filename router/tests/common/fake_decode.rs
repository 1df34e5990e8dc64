//! The scripted decode worker: it grants leases, waits for the fake prefill worker's commit
//! (expiring a lease that is neither committed nor renewed in time), or runs the prompt
//! itself, then streams its script's tokens for every choice; and it records every call.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_proto::v1::decode_service_server::DecodeService;
use tandem_proto::v1::generate_event::Event;
use tandem_proto::v1::*;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request, Response, Status};

use super::{CONTEXT, EOS, KV_TCP_PORT, MODEL, fake_prompt_logprobs, lock, text_tokens, tokenizer};

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
    /// GetLoad calls answered.
    pub load_calls: AtomicU64,
    /// The compute threads each GetLoad asked for (the elastic planner's), in order.
    pub threads_asked: Mutex<Vec<u32>>,
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
                // A worker that caches prefixes (and has nothing new to say about them).
                block_events: Some(BlockEvents::default()),
                ..Default::default()
            }),
            script: Mutex::new(DecodeScript::default()),
            generate_calls: Mutex::default(),
            leases: Mutex::default(),
            commits: Mutex::default(),
            renewals: Mutex::default(),
            closed_early: Mutex::default(),
            info_calls: AtomicU64::new(0),
            load_calls: AtomicU64::new(0),
            threads_asked: Mutex::default(),
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

    async fn get_load(&self, req: Request<LoadRequest>) -> Result<Response<LoadReport>, Status> {
        self.0.load_calls.fetch_add(1, Ordering::SeqCst);
        lock(&self.0.threads_asked).push(req.into_inner().compute_threads);
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
            // Like a worker that predates splits: it never takes one.
            split_prompt_at: 0,
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
