//! The prefill worker run in-process through [`serve`] (the tiny model), sending into a
//! decode-side lease table that a KV-only decode service answers for: the KV it ships over
//! gRPC and raw TCP is the KV a local engine computes, committed with the greedy first token
//! (also when the prompt's prefix came from the worker's prefix cache);
//! a lease that ended is refused without failing the worker, and its blocks come back; a
//! decode service that cannot prove the deployment's secret gets nothing; the decode side's
//! cached prefix is read back rather than computed (and computed when the side keeps it on a
//! device).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_auth::{InternalAuth, Secret};
use tandem_cli::ModelArgs;
use tandem_e2e::{PrefillClient, local_prefill, prefill_client, test_auth};
use tandem_engine::{EngineConfig, Model};
use tandem_kv::KvCache;
use tandem_prefill::{PrefillConfig, PrefillWorker, serve};
use tandem_proto::v1::decode_service_server::DecodeServiceServer;
use tandem_proto::v1::*;
use tandem_text::TextTokenizer;
use tandem_transfer::{KvOnlyDecode, LeaseTable, TcpLimits, serve_tcp};
use tokio::net::TcpListener;

const BLOCKS: usize = 64;

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

async fn start_prefill(model: &Arc<Model>, tokenizer: &TextTokenizer) -> PrefillClient {
    let grpc = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let endpoint = format!("http://{}", grpc.local_addr().expect("addr"));
    let config = PrefillConfig {
        shm_dir: None,
        auth: test_auth(),
        ..PrefillConfig::default()
    };
    let engine = EngineConfig {
        kv_budget_bytes: 4 << 20,
        ..EngineConfig::default()
    };
    let worker =
        PrefillWorker::new(model.clone(), tokenizer.clone(), engine, config).expect("worker");
    tokio::spawn(serve(worker, grpc, std::future::pending()));
    prefill_client(&endpoint, Duration::from_secs(10))
        .await
        .expect("client")
        .0
}

/// A decode side with no model: a lease table over a host cache, answering `GetInfo` (signed
/// with `auth`), `PushKv` and `CommitKv`, plus the raw TCP listener.
struct KvSide {
    endpoint: String,
    table: Arc<LeaseTable>,
    cache: KvCache,
    hash: String,
    instance: Vec<u8>,
}

async fn start_kv_side(model: &Model, auth: InternalAuth) -> KvSide {
    start_kv_side_with(model, auth, false).await
}

/// `on_device`: the lease table says the cache is a device pool (a GPU decode worker's).
async fn start_kv_side_with(model: &Model, auth: InternalAuth, on_device: bool) -> KvSide {
    let layout = model.kv_layout();
    let cache = KvCache::with_budget(layout.clone(), BLOCKS * layout.block_bytes()).expect("cache");
    let hash = layout.hash();
    let mut table = LeaseTable::new(cache.block_writer(), hash.clone(), None);
    if on_device {
        table = table.with_device_pool(layout.block_layer_bytes());
    }
    let table = Arc::new(table);
    let kv = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let kv_port = kv.local_addr().expect("addr").port();
    tokio::spawn(serve_tcp(
        kv,
        table.clone(),
        auth.clone(),
        TcpLimits::default(),
        std::future::pending(),
    ));
    let instance = vec![7; 16];
    let info = WorkerInfo {
        role: Role::Decode as i32,
        kv_layout_hash: hash.clone(),
        transports: vec![Transport::Grpc as i32, Transport::Tcp as i32],
        kv_tcp_port: kv_port as u32,
        protocol_version: tandem_proto::PROTOCOL_VERSION,
        instance_id: instance.clone(),
        ..Default::default()
    };
    let grpc = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let endpoint = format!("http://{}", grpc.local_addr().expect("addr"));
    let svc = DecodeServiceServer::new(KvOnlyDecode {
        table: table.clone(),
        info,
        auth: auth.clone(),
    });
    let mut builder = auth.server_builder().expect("server");
    tokio::spawn(
        builder
            .add_service(svc)
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(grpc)),
    );
    KvSide {
        endpoint,
        table,
        cache,
        hash,
        instance,
    }
}

fn prompt(len: u32) -> Vec<u32> {
    (0..len).map(|i| 3 + (i * 11) % 250).collect()
}

fn destination(
    side: &KvSide,
    lease: &tandem_transfer::Lease,
    transport: Transport,
) -> KvDestination {
    KvDestination {
        transport: transport as i32,
        decode_endpoint: side.endpoint.clone(),
        decode_instance: side.instance.clone(),
        lease: lease.token().as_bytes().to_vec(),
        block_ids: lease.blocks.clone(),
        kv_layout_hash: side.hash.clone(),
        first_block: 0,
        ..KvDestination::default()
    }
}

async fn used_blocks(p: &mut PrefillClient) -> u32 {
    let l = p
        .get_load(LoadRequest::default())
        .await
        .expect("load")
        .into_inner();
    l.total_blocks - l.free_blocks
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shipped_kv_is_the_computed_kv_committed_with_the_first_token() {
    let (model, tokenizer) = tiny();
    let mut p = start_prefill(&model, &tokenizer).await;
    let side = start_kv_side(&model, test_auth()).await;
    let p37 = prompt(37);
    let (want, first) = local_prefill(&model, &tokenizer, &p37);
    for (i, transport) in [Transport::Grpc, Transport::Tcp].into_iter().enumerate() {
        // Scattered destination blocks, different for each transport.
        let blocks: Vec<u32> = [5u32, 40, 9].iter().map(|b| b + i as u32).collect();
        let (lease, mut committed) = side
            .table
            .create(blocks.clone(), p37.len(), "t")
            .expect("lease");
        let resp = p
            .prefill(PrefillRequest {
                stop: None,
                request_id: format!("ship-{i}"),
                prompt: p37.clone(),
                sampling: Some(SamplingParams::default()),
                destination: Some(destination(&side, &lease, transport)),
            })
            .await
            .unwrap_or_else(|e| panic!("{transport:?}: {e}"))
            .into_inner();
        assert_eq!(resp.first_token, first, "{transport:?}");
        // The second time, the prompt's two full blocks before its last token come from the
        // prefix cache: not computed, but shipped all the same.
        assert_eq!(resp.cached_tokens, 32 * i as u32, "{transport:?}");
        let commit = committed
            .try_recv()
            .expect("the lease was committed")
            .expect("a good commit");
        assert_eq!(commit.first_token, first);
        for (layer, pieces) in want.iter().enumerate() {
            for (lb, bytes) in pieces {
                let got = side
                    .cache
                    .block_layer_bytes(layer, blocks[*lb as usize])
                    .expect("block");
                assert!(
                    got == bytes.as_slice(),
                    "{transport:?}: layer {layer} block {lb} differs"
                );
            }
        }
    }
    assert_eq!(
        used_blocks(&mut p).await,
        0,
        "the prefill worker keeps no blocks"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_lease_or_an_unproven_decode_side_gets_nothing() {
    let (model, tokenizer) = tiny();
    let mut p = start_prefill(&model, &tokenizer).await;
    let side = start_kv_side(&model, test_auth()).await;
    let p40 = prompt(40);

    // The decode side cancelled the lease (its client went away) before the KV came.
    let (lease, _committed) = side
        .table
        .create(vec![1, 2, 3], p40.len(), "gone")
        .expect("lease");
    side.table.cancel(lease.token());
    let err = p
        .prefill(PrefillRequest {
            stop: None,
            request_id: "gone".into(),
            prompt: p40.clone(),
            sampling: None,
            destination: Some(destination(&side, &lease, Transport::Grpc)),
        })
        .await
        .expect_err("an ended lease");
    // ABORTED: a failure at the decode side, which must not count against this worker.
    assert_eq!(err.code(), tonic::Code::Aborted, "{err}");
    let start = Instant::now();
    while used_blocks(&mut p).await > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "prefill blocks not returned"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A decode service signing with another secret cannot prove it is ours.
    let other = InternalAuth::new(
        Some(&Secret::new(&"x".repeat(48)).expect("secret")),
        None,
        false,
    );
    let stranger = start_kv_side(&model, other).await;
    let (lease, mut committed) = stranger
        .table
        .create(vec![0, 1, 2], p40.len(), "s")
        .expect("lease");
    let err = p
        .prefill(PrefillRequest {
            stop: None,
            request_id: "stranger".into(),
            prompt: p40,
            sampling: None,
            destination: Some(destination(&stranger, &lease, Transport::Tcp)),
        })
        .await
        .expect_err("an unproven decode side");
    assert_eq!(err.code(), tonic::Code::Aborted, "{err}");
    assert!(committed.try_recv().is_err(), "nothing was committed");
    for layer in 0..model.config().num_hidden_layers {
        let block = stranger.cache.block_layer_bytes(layer, 0).expect("block");
        assert!(
            block.iter().all(|&b| b == 0),
            "KV reached an unproven decode side"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decode_sides_cached_prefix_is_read_back_not_computed() {
    let (model, tokenizer) = tiny();
    let p60 = prompt(60);
    let (want, first) = local_prefill(&model, &tokenizer, &p60);
    for on_device in [false, true] {
        let mut p = start_prefill(&model, &tokenizer).await;
        let mut side = start_kv_side_with(&model, test_auth(), on_device).await;
        // The decode side holds the prompt's first 3 blocks (at scattered places) for the
        // lease, which covers the 4th.
        let cached = vec![30u32, 12, 21];
        for (layer, pieces) in want.iter().enumerate() {
            for (lb, bytes) in pieces.iter().filter(|(lb, _)| (*lb as usize) < 3) {
                side.cache
                    .write_block_layer_bytes(layer, cached[*lb as usize], bytes)
                    .expect("write");
            }
        }
        for round in 0..2 {
            let (lease, mut committed) = side
                .table
                .create_claimed(None, vec![40], cached.clone(), p60.len(), "t")
                .expect("lease");
            let mut dest = destination(&side, &lease, Transport::Grpc);
            dest.first_block = 3;
            let resp = p
                .prefill(PrefillRequest {
                    stop: None,
                    request_id: format!("pull-{on_device}-{round}"),
                    prompt: p60.clone(),
                    sampling: Some(SamplingParams::default()),
                    destination: Some(dest),
                })
                .await
                .expect("prefill")
                .into_inner();
            assert_eq!(resp.first_token, first, "device {on_device}, round {round}");
            let block_bytes = model.kv_layout().block_bytes() as u64;
            let expected = match (on_device, round) {
                // Read back the first time, found in its own cache the second.
                (false, 0) => (48, 48, 3 * block_bytes),
                (false, _) => (48, 0, 0),
                // A device side refuses: the worker computes the blocks (and has them
                // cached the second time).
                (true, 0) => (0, 0, 0),
                (true, _) => (48, 0, 0),
            };
            assert_eq!(
                (resp.cached_tokens, resp.pulled_tokens, resp.pulled_bytes),
                expected,
                "device {on_device}, round {round}"
            );
            committed
                .try_recv()
                .expect("the lease was committed")
                .expect("a good commit");
            for (layer, pieces) in want.iter().enumerate() {
                let (_, bytes) = pieces.iter().find(|(lb, _)| *lb == 3).expect("block 3");
                let got = side.cache.block_layer_bytes(layer, 40).expect("block");
                assert!(
                    got == bytes.as_slice(),
                    "layer {layer}: the shipped block differs"
                );
            }
        }
    }
}
