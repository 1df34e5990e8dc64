//! The decode worker run in-process through [`serve`] (no binary, no model download: the tiny
//! model), driven over its authenticated gRPC as the router and a prefill worker drive it: KV
//! pushed into a lease over each host transport decodes to what aggregated serving gives, and
//! so does a prompt split with a peer;
//! leases end cleanly when cancelled, expired or guessed at; shutdown drains and removes the
//! shared-memory files.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_cli::ModelArgs;
use tandem_decode::{DecodeConfig, DecodeWorker, serve};
use tandem_e2e::{DecodeClient, PromptKv, decode_client, local_prefill, test_auth};
use tandem_engine::{EngineConfig, Model};
use tandem_proto::v1::*;
use tandem_text::TextTokenizer;
use tandem_transfer::{FirstToken, Peers, connect};
use tokio::net::TcpListener;

struct Decode {
    client: DecodeClient,
    info: WorkerInfo,
    endpoint: String,
    model: Arc<Model>,
    tokenizer: TextTokenizer,
    shm: tempfile::TempDir,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    served: tokio::task::JoinHandle<Result<(), tandem_decode::DecodeError>>,
}

fn tiny() -> (Arc<Model>, TextTokenizer) {
    let args = ModelArgs {
        model: "tiny".into(),
        weights: "f32".into(),
        kv_dtype: "f32".into(),
        tokenizer: None,
        cache_dir: None,
        model_limits: None,
    };
    tandem_worker::load_model(&args).expect("the tiny model")
}

async fn start(lease_ttl: Duration) -> Decode {
    let (model, tokenizer) = tiny();
    let shm = tempfile::tempdir().expect("shm folder");
    let grpc = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let kv = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let kv_port = kv.local_addr().expect("addr").port();
    let endpoint = format!("http://{}", grpc.local_addr().expect("addr"));
    let config = DecodeConfig {
        shm_dir: Some(shm.path().to_path_buf()),
        default_lease_ttl: lease_ttl,
        auth: test_auth(),
        drain_timeout: Duration::from_secs(2),
        ..DecodeConfig::default()
    };
    let engine = EngineConfig {
        kv_budget_bytes: 8 << 20,
        ..EngineConfig::default()
    };
    let worker = DecodeWorker::new(model.clone(), tokenizer.clone(), engine, config, kv_port)
        .expect("decode worker");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(serve(worker, grpc, Some(kv), async {
        let _ = stopped.await;
    }));
    let (client, info) = decode_client(&endpoint, Duration::from_secs(10))
        .await
        .expect("client");
    Decode {
        client,
        info,
        endpoint,
        model,
        tokenizer,
        shm,
        stop: Some(stop),
        served,
    }
}

fn request(prompt: Vec<u32>, mode: Mode, max_tokens: u32, lease_ttl_ms: u32) -> GenerateRequest {
    GenerateRequest {
        request_id: format!("r{}", prompt.len()),
        prompt,
        sampling: Some(SamplingParams::default()),
        stop: Some(StopParams {
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        }),
        mode: mode as i32,
        lease_ttl_ms,
        local_prefill_below: 0,
        tpot_target_ms: 0,
        split_prompt_at: 0,
    }
}

async fn tokens(stream: &mut tonic::Streaming<GenerateEvent>) -> (Vec<u32>, Option<Finished>) {
    let mut out = Vec::new();
    while let Some(ev) = stream.message().await.expect("stream") {
        match ev.event {
            Some(generate_event::Event::Token(t)) => out.push(t.id),
            Some(generate_event::Event::Finished(f)) => return (out, Some(f)),
            _ => {}
        }
    }
    (out, None)
}

async fn lease_of(stream: &mut tonic::Streaming<GenerateEvent>) -> Lease {
    match stream
        .message()
        .await
        .expect("stream")
        .and_then(|e| e.event)
    {
        Some(generate_event::Event::Lease(lease)) => lease,
        other => panic!("the first event must be the lease, got {other:?}"),
    }
}

async fn used_blocks(d: &mut DecodeClient) -> u32 {
    let l = d
        .get_load(LoadRequest::default())
        .await
        .expect("load")
        .into_inner();
    l.total_blocks - l.free_blocks
}

async fn wait_free(d: &mut DecodeClient, within: Duration) {
    let start = Instant::now();
    while used_blocks(d).await > 0 {
        assert!(
            start.elapsed() < within,
            "blocks still held after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Ships `kv` (a prompt of `tokens` tokens) into `lease` over `transport` as a prefill
/// worker does (layers handed over from a plain thread, as from the engine's; the blocks the
/// decode worker's cache holds left out, the rest numbered from the lease's first block), and
/// commits with `first`.
async fn ship(
    d: &Decode,
    peers: &Peers,
    lease: Lease,
    transport: Transport,
    (kv, tokens, first): (&PromptKv, usize, u32),
) -> tandem_transfer::SendStats {
    let dest = KvDestination {
        transport: transport as i32,
        decode_endpoint: d.endpoint.clone(),
        decode_instance: d.info.instance_id.clone(),
        lease: lease.token,
        block_ids: lease.block_ids,
        kv_layout_hash: d.info.kv_layout_hash.clone(),
        first_block: lease.cached_tokens / 16,
        ..KvDestination::default()
    };
    let skip = lease.cached_tokens / 16;
    let mut sender = connect(
        peers,
        &dest,
        &d.model.kv_layout(),
        "test",
        tokens,
        skip as usize,
    )
    .await
    .unwrap_or_else(|e| panic!("{transport:?}: {e}"));
    let layers = kv.clone();
    let sender = tokio::task::spawn_blocking(move || {
        for (layer, pieces) in layers.iter().enumerate() {
            let pieces: Vec<(u32, &[u8])> = pieces
                .iter()
                .filter(|(lb, _)| *lb >= skip)
                .map(|(lb, b)| (*lb - skip, b.as_slice()))
                .collect();
            sender.send_layer(layer, &pieces).expect("send");
        }
        sender
    })
    .await
    .expect("sender thread");
    sender
        .commit(FirstToken::new(first, 0.0))
        .await
        .expect("commit")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_pushed_into_a_lease_decodes_as_aggregated_serving_does() {
    let mut d = start(Duration::from_secs(30)).await;
    let prompt: Vec<u32> = (0..37).map(|i| 3 + (i * 7) % 250).collect();
    let mut agg = d
        .client
        .generate(request(prompt.clone(), Mode::Aggregated, 10, 0))
        .await
        .expect("aggregated")
        .into_inner();
    let (want, _) = tokens(&mut agg).await;
    assert_eq!(want.len(), 10);
    let (kv, first) = local_prefill(&d.model, &d.tokenizer, &prompt);
    assert_eq!(first, want[0]);
    let peers = Peers::new(test_auth(), Some(d.shm.path().to_path_buf()));
    for transport in [Transport::Grpc, Transport::Tcp, Transport::Shm] {
        let mut stream = d
            .client
            .generate(request(prompt.clone(), Mode::Disaggregated, 10, 0))
            .await
            .expect("disaggregated")
            .into_inner();
        let lease = lease_of(&mut stream).await;
        // The aggregated run left the prompt's 2 full blocks in the decode worker's cache.
        assert_eq!((lease.cached_tokens, lease.block_ids.len()), (32, 1));
        let stats = ship(&d, &peers, lease, transport, (&kv, prompt.len(), first)).await;
        let (got, fin) = tokens(&mut stream).await;
        assert_eq!(
            got, want,
            "{transport:?} decodes as aggregated serving does"
        );
        let fin = fin.expect("finished");
        assert_eq!(fin.transport, transport as i32);
        assert_eq!(fin.kv_bytes, stats.bytes);
    }
    wait_free(&mut d.client, Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_prompt_resumes_here_as_aggregated_serving_runs_it() {
    let mut d = start(Duration::from_secs(30)).await;
    let prompt: Vec<u32> = (0..90).map(|i| 5 + (i * 11) % 240).collect();
    let split = |at: u32| GenerateRequest {
        split_prompt_at: at,
        ..request(prompt.clone(), Mode::Disaggregated, 10, 0)
    };
    // Splits it cannot resume at are declined: the lease is for the whole prompt.
    for at in [20, 90, 500] {
        let mut stream = d
            .client
            .generate(split(at))
            .await
            .expect("generate")
            .into_inner();
        let lease = lease_of(&mut stream).await;
        assert_eq!(
            (lease.split_prompt_at, lease.block_ids.len()),
            (0, 6),
            "at {at}"
        );
    }
    wait_free(&mut d.client, Duration::from_secs(2)).await;
    // The first 32 tokens' KV comes from a peer (whose first token is not used); this worker
    // computes the other 58.
    let mut stream = d
        .client
        .generate(split(32))
        .await
        .expect("generate")
        .into_inner();
    let lease = lease_of(&mut stream).await;
    assert_eq!((lease.split_prompt_at, lease.block_ids.len()), (32, 2));
    let (kv, _) = local_prefill(&d.model, &d.tokenizer, &prompt[..32]);
    let peers = Peers::new(test_auth(), Some(d.shm.path().to_path_buf()));
    let stats = ship(&d, &peers, lease, Transport::Tcp, (&kv, 32, 7)).await;
    let (got, fin) = tokens(&mut stream).await;
    assert_eq!(fin.expect("finished").kv_bytes, stats.bytes);
    let mut agg = d
        .client
        .generate(request(prompt.clone(), Mode::Aggregated, 10, 0))
        .await
        .expect("aggregated")
        .into_inner();
    let (want, _) = tokens(&mut agg).await;
    assert_eq!(got, want);
    // Now the cache holds more than the first part: the request runs here whole.
    let mut stream = d
        .client
        .generate(split(32))
        .await
        .expect("generate")
        .into_inner();
    match stream
        .message()
        .await
        .expect("stream")
        .and_then(|e| e.event)
    {
        Some(generate_event::Event::Local(local)) => assert_eq!(local.cached_tokens, 80),
        other => panic!("expected a local prefill, got {other:?}"),
    }
    assert_eq!(tokens(&mut stream).await.0, want);
    wait_free(&mut d.client, Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_end_cleanly_when_cancelled_expired_or_guessed() {
    let mut d = start(Duration::from_secs(30)).await;
    let prompt: Vec<u32> = (0..50).map(|i| 3 + i % 200).collect();

    // The router goes away before any KV arrives: the reservation is returned.
    let mut stream = d
        .client
        .generate(request(prompt.clone(), Mode::Disaggregated, 4, 0))
        .await
        .expect("generate")
        .into_inner();
    lease_of(&mut stream).await;
    assert!(used_blocks(&mut d.client).await > 0);
    drop(stream);
    wait_free(&mut d.client, Duration::from_secs(2)).await;

    // No KV ever comes: the lease expires with DEADLINE_EXCEEDED and its blocks return.
    let mut stream = d
        .client
        .generate(request(prompt.clone(), Mode::Disaggregated, 4, 300))
        .await
        .expect("generate")
        .into_inner();
    lease_of(&mut stream).await;
    let err = stream.message().await.expect_err("the lease expires");
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err}");
    wait_free(&mut d.client, Duration::from_secs(2)).await;

    // A commit on a guessed capability fails, names nothing, and leaves the real one alone.
    let mut victim = d
        .client
        .generate(request(prompt.clone(), Mode::Disaggregated, 4, 0))
        .await
        .expect("generate")
        .into_inner();
    let lease = lease_of(&mut victim).await;
    let guess = KvCommit {
        lease: vec![0x42; 16],
        kv_layout_hash: d.info.kv_layout_hash.clone(),
        num_tokens: prompt.len() as u32,
        transport: Transport::Grpc as i32,
        ..Default::default()
    };
    let err = d.client.commit_kv(guess).await.expect_err("guessed commit");
    assert_eq!(err.code(), tonic::Code::NotFound, "{err}");
    assert!(!err.message().contains(&prompt.len().to_string()), "{err}");
    let (kv, first) = local_prefill(&d.model, &d.tokenizer, &prompt);
    let peers = Peers::new(test_auth(), None);
    ship(
        &d,
        &peers,
        lease,
        Transport::Grpc,
        (&kv, prompt.len(), first),
    )
    .await;
    let (got, fin) = tokens(&mut victim).await;
    assert_eq!(got.len(), 4, "the victim finishes");
    assert!(fin.is_some());
    wait_free(&mut d.client, Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_and_removes_the_shared_memory_files() {
    let mut d = start(Duration::from_secs(30)).await;
    let pool = std::path::PathBuf::from(&d.info.shm_path);
    assert!(pool.starts_with(d.shm.path()) && pool.exists(), "{pool:?}");
    let mut stream = d
        .client
        .generate(request(vec![5; 20], Mode::Aggregated, 6, 0))
        .await
        .expect("generate")
        .into_inner();
    let _ = d.stop.take().map(|s| s.send(()));
    // The running request still finishes: shutdown drains before it stops serving.
    let (got, fin) = tokens(&mut stream).await;
    assert_eq!(got.len(), 6);
    assert!(fin.is_some());
    tokio::time::timeout(Duration::from_secs(10), d.served)
        .await
        .expect("serve returns")
        .expect("task")
        .expect("serve ends cleanly");
    assert!(!pool.exists(), "the pool file outlived the worker");
    assert!(
        !tandem_kv::shm::tags_path(&pool).exists(),
        "the tags file outlived it"
    );
}
