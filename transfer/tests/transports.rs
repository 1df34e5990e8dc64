//! Each transport end to end on loopback: a sender fed layer by layer from a std thread (as
//! the engine does), a decode-side lease table behind a real tonic server and TCP listener,
//! bytes checked where they land; and the failures: layout mismatch, corrupt or incomplete
//! data, a lease cancelled mid-transfer.

use std::sync::Arc;

use tandem_engine::kv::{KvCache, KvDtype, KvLayout, KvStorage};
use tandem_proto::v1::decode_service_server::DecodeServiceServer;
use tandem_proto::v1::*;
use tandem_transfer::{
    KvOnlyDecode, LeaseTable, OwnerTags, Peers, TransferError, connect, serve_tcp, tags_path,
};
use tokio::net::TcpListener;

fn layout(fingerprint: &str) -> KvLayout {
    KvLayout {
        num_layers: 3,
        num_kv_heads: 2,
        head_dim: 8,
        block_size: 16,
        dtype: KvDtype::F32,
        model_fingerprint: fingerprint.into(),
    }
}

struct DecodeSide {
    cache: KvCache,
    table: Arc<LeaseTable>,
    endpoint: String,
    kv_tcp_addr: String,
    shm_path: String,
    shm_bytes: u64,
    _dir: tempfile::TempDir,
}

async fn decode_side(blocks: usize) -> DecodeSide {
    let dir = tempfile::tempdir().unwrap();
    let l = layout("m");
    let path = dir.path().join("pool.kv");
    let bytes = blocks * l.block_bytes();
    let cache = KvCache::new(
        l.clone(),
        blocks,
        KvStorage::create_shared(&path, bytes).unwrap(),
    )
    .unwrap();
    let tags = OwnerTags::create(&tags_path(&path), blocks).unwrap();
    let table = Arc::new(LeaseTable::new(cache.block_writer(), l.hash(), Some(tags)));
    let grpc = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", grpc.local_addr().unwrap());
    let svc = DecodeServiceServer::new(KvOnlyDecode {
        table: table.clone(),
    });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(
                tonic::transport::server::TcpIncoming::from(grpc).with_nodelay(Some(true)),
            ),
    );
    let kv = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let kv_tcp_addr = kv.local_addr().unwrap().to_string();
    tokio::spawn(serve_tcp(kv, table.clone(), std::future::pending()));
    DecodeSide {
        cache,
        table,
        endpoint,
        kv_tcp_addr,
        shm_path: path.to_string_lossy().into(),
        shm_bytes: bytes as u64,
        _dir: dir,
    }
}

/// The prefill side's blocks: distinct bytes per (layer, logical block).
fn source(l: &KvLayout, layer: usize, lb: u32) -> Vec<u8> {
    (0..l.block_layer_bytes())
        .map(|i| ((i * 31 + layer * 7 + lb as usize * 13) % 251) as u8)
        .collect()
}

fn destination(
    d: &DecodeSide,
    transport: Transport,
    lease_id: u64,
    blocks: &[u32],
) -> KvDestination {
    KvDestination {
        transport: transport as i32,
        decode_endpoint: d.endpoint.clone(),
        kv_tcp_addr: d.kv_tcp_addr.clone(),
        shm_path: d.shm_path.clone(),
        shm_bytes: d.shm_bytes,
        lease_id,
        block_ids: blocks.to_vec(),
        kv_layout_hash: d.table.layout_hash().to_string(),
        ..KvDestination::default()
    }
}

/// Sends every layer from a blocking thread, as the engine thread would.
async fn send_all(
    sender: Box<dyn tandem_transfer::KvSender>,
    l: &KvLayout,
    nblocks: u32,
    skip_layer: Option<usize>,
) -> Result<Box<dyn tandem_transfer::KvSender>, TransferError> {
    let l = l.clone();
    tokio::task::spawn_blocking(move || {
        let mut sender = sender;
        for layer in 0..l.num_layers {
            if Some(layer) == skip_layer {
                continue;
            }
            let data: Vec<Vec<u8>> = (0..nblocks).map(|lb| source(&l, layer, lb)).collect();
            let pieces: Vec<(u32, &[u8])> = data
                .iter()
                .enumerate()
                .map(|(i, d)| (i as u32, d.as_slice()))
                .collect();
            sender.send_layer(layer, &pieces)?;
        }
        Ok(sender)
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_transport_delivers_verified_blocks() {
    let d = decode_side(32).await;
    let peers = Peers::new();
    let l = layout("m");
    for transport in [Transport::Grpc, Transport::Tcp, Transport::Shm] {
        let tokens = 40; // 3 blocks, the last partly filled
        let blocks = vec![9, 2, 17];
        let (lease, rx) = d.table.create(blocks.clone(), tokens, "req");
        let dest = destination(&d, transport, lease.id, &blocks);
        let sender = connect(&peers, &dest, &l, "req", tokens).await.unwrap();
        let sender = send_all(sender, &l, 3, None).await.unwrap();
        let stats = sender.commit(42, -0.25).await.unwrap();
        assert_eq!(stats.transport, transport);
        assert_eq!(stats.bytes, (3 * 3 * l.block_layer_bytes()) as u64);
        let commit = rx.await.unwrap().unwrap();
        assert_eq!(
            (commit.first_token, commit.first_logprob, commit.bytes),
            (42, -0.25, stats.bytes)
        );
        for layer in 0..3 {
            for (lb, &b) in blocks.iter().enumerate() {
                assert_eq!(
                    d.cache.block_layer_bytes(layer, b).unwrap(),
                    &source(&l, layer, lb as u32)[..],
                    "{transport:?} layer {layer} block {lb}"
                );
            }
        }
        assert!(d.table.is_empty());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatches_and_incomplete_transfers_fail_loudly() {
    let d = decode_side(16).await;
    let peers = Peers::new();
    let (lease, rx) = d.table.create(vec![1, 2], 20, "req");
    let dest = destination(&d, Transport::Tcp, lease.id, &[1, 2]);
    // A prefill worker with another model's layout is refused before any byte moves.
    let other = layout("another-model");
    assert!(matches!(
        connect(&peers, &dest, &other, "req", 20).await,
        Err(TransferError::LayoutMismatch(_))
    ));
    // Wrong number of blocks for the prompt.
    assert!(
        connect(&peers, &dest, &layout("m"), "req", 40)
            .await
            .is_err()
    );

    // A transfer missing a layer fails at commit, on every transport, and fails the lease.
    for transport in [Transport::Tcp, Transport::Grpc, Transport::Shm] {
        let (lease, rx) = d.table.create(vec![3, 4], 20, "req");
        let dest = destination(&d, transport, lease.id, &[3, 4]);
        let sender = connect(&peers, &dest, &layout("m"), "req", 20)
            .await
            .unwrap();
        let sender = send_all(sender, &layout("m"), 2, Some(1)).await.unwrap();
        assert!(sender.commit(1, 0.0).await.is_err(), "{transport:?}");
        if transport != Transport::Shm {
            assert!(
                rx.await.unwrap().is_err(),
                "{transport:?}: the waiting request learns why"
            );
        }
    }
    d.table.cancel(lease.id);
    drop(rx);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_lease_fences_every_transport() {
    let d = decode_side(16).await;
    let peers = Peers::new();
    let l = layout("m");
    for transport in [Transport::Shm, Transport::Tcp, Transport::Grpc] {
        let blocks = vec![5, 6];
        let (lease, _rx) = d.table.create(blocks.clone(), 32, "req");
        let dest = destination(&d, transport, lease.id, &blocks);
        let sender = connect(&peers, &dest, &l, "req", 32).await.unwrap();
        let before: Vec<u8> = d.cache.block_layer_bytes(0, 5).unwrap().to_vec();
        assert_eq!(d.table.cancel(lease.id), Some(blocks.clone()));
        let result = send_all(sender, &l, 2, None).await;
        match result {
            // Shared memory refuses to write at once (the owner tag is gone) ...
            Err(TransferError::Cancelled(_)) => assert_eq!(transport, Transport::Shm),
            // ... the network transports learn it from the peer, at the latest at commit.
            Ok(sender) => assert!(sender.commit(1, 0.0).await.is_err(), "{transport:?}"),
            Err(_) => {}
        }
        assert_eq!(
            d.cache.block_layer_bytes(0, 5).unwrap(),
            &before[..],
            "{transport:?} wrote into a cancelled lease"
        );
    }
}

/// cuda-ipc and nccl need a decode worker with a device pool (and a CUDA build): without
/// either, the transfer is refused before any byte moves, with the reason; host transports
/// refuse device pointers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_ipc_without_a_device_pool_is_refused_up_front() {
    let d = decode_side(8).await;
    let peers = Peers::new();
    let l = layout("m");
    let (lease, _rx) = d.table.create(vec![1], 10, "req");
    for transport in [Transport::CudaIpc, Transport::Nccl] {
        let dest = destination(&d, transport, lease.id, &[1]);
        let err = match connect(&peers, &dest, &l, "req", 10).await {
            Ok(_) => panic!("{transport:?} to a pool-less decode worker was accepted"),
            Err(e) => e,
        };
        assert!(matches!(err, TransferError::Connect(_)), "{err}");
        let why = err.to_string();
        assert!(
            why.contains("cuda") || why.contains("nccl") || why.contains("device"),
            "{why}"
        );
    }

    let dest = destination(&d, Transport::Shm, lease.id, &[1]);
    let mut sender = connect(&peers, &dest, &l, "req", 10).await.unwrap();
    assert!(!sender.reads_device());
    let src = tandem_engine::kv::DeviceKv {
        base: 0,
        num_blocks: 4,
        num_layers: 3,
        block_layer_bytes: 64,
        stream: 0,
        context: 0,
    };
    assert!(sender.send_device_layer(0, &src, &[(0, 1)]).is_err());
}
