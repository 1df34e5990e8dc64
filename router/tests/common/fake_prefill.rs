//! The scripted prefill worker: after its delay it fails as scripted, or commits the KV on
//! the decode worker its destination names and answers with the first token; it records
//! every call and every call the router cancelled.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_proto::v1::decode_service_client::DecodeServiceClient;
use tandem_proto::v1::prefill_service_server::PrefillService;
use tandem_proto::v1::*;
use tonic::{Code, Request, Response, Status};

use super::{CONTEXT, KV_BYTES, MODEL, fake_prompt_logprobs, lock};

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
    /// What GetLoad answers (block events are added: a worker that caches prefixes).
    pub load: Mutex<LoadReport>,
    /// The compute threads each GetLoad asked for (the elastic planner's), in order.
    pub threads_asked: Mutex<Vec<u32>>,
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
            load: Mutex::default(),
            threads_asked: Mutex::default(),
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

    async fn get_load(&self, req: Request<LoadRequest>) -> Result<Response<LoadReport>, Status> {
        lock(&self.0.threads_asked).push(req.into_inner().compute_threads);
        // A worker that caches prefixes (and has nothing new to say about them).
        Ok(Response::new(LoadReport {
            block_events: Some(BlockEvents::default()),
            ..lock(&self.0.load).clone()
        }))
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
