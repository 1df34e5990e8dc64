//! Each transport end to end on loopback: a sender fed layer by layer from a std thread (as
//! the engine does), a decode-side lease table behind a real tonic server and TCP listener,
//! bytes checked where they land; and the failures: layout mismatch, corrupt or incomplete
//! data, a lease cancelled mid-transfer.

use std::path::PathBuf;
use std::sync::Arc;

use tandem_auth::{InternalAuth, Secret};
use tandem_kv::shm::{OwnerTags, POOL_PREFIX, file_identity, tags_path};
use tandem_kv::{KvCache, KvDtype, KvLayout, KvStorage};
use tandem_proto::v1::decode_service_server::DecodeServiceServer;
use tandem_proto::v1::*;
use tandem_transfer::{
    FirstToken, KvOnlyDecode, Lease, LeaseTable, Peers, TcpLimits, TransferError, connect,
    serve_tcp,
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

/// The deployment's credentials in these tests.
fn deployment() -> InternalAuth {
    InternalAuth::with_secret(&Secret::new(&"transport-tests-secret-".repeat(2)).unwrap())
}

fn stranger() -> InternalAuth {
    InternalAuth::with_secret(&Secret::new(&"not-the-deployment-key-".repeat(2)).unwrap())
}

struct DecodeSide {
    cache: KvCache,
    table: Arc<LeaseTable>,
    endpoint: String,
    kv_tcp_addr: String,
    dir: tempfile::TempDir,
    _tags: PathBuf,
}

impl DecodeSide {
    /// A prefill worker's peers with `auth`, mapping pools from this side's folder.
    fn peers(&self, auth: InternalAuth) -> Peers {
        Peers::new(auth, Some(self.dir.path().to_path_buf()))
    }
}

/// How the fake decode worker behaves.
struct Side {
    /// Its credentials: checks calls with them and signs its info.
    auth: InternalAuth,
    /// Whether its gRPC server checks call tokens (off: anyone gets its signed info).
    guard_calls: bool,
    /// Advertise this shared-memory path instead of its own pool.
    shm_path: Option<PathBuf>,
    limits: TcpLimits,
}

impl Default for Side {
    fn default() -> Self {
        Self {
            auth: deployment(),
            guard_calls: true,
            shm_path: None,
            limits: TcpLimits::default(),
        }
    }
}

async fn decode_side(blocks: usize) -> DecodeSide {
    decode_side_with(blocks, Side::default()).await
}

async fn decode_side_with(blocks: usize, side: Side) -> DecodeSide {
    let dir = tempfile::tempdir().unwrap();
    let l = layout("m");
    let path = dir.path().join(format!("{POOL_PREFIX}test-1"));
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
    let kv = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let kv_tcp_addr = kv.local_addr().unwrap().to_string();
    let (device, inode) = file_identity(&path).unwrap();
    let info = WorkerInfo {
        worker_id: "decode-test".into(),
        role: Role::Decode as i32,
        kv_layout_hash: l.hash(),
        transports: vec![
            Transport::Grpc as i32,
            Transport::Tcp as i32,
            Transport::Shm as i32,
        ],
        shm_path: side
            .shm_path
            .clone()
            .unwrap_or_else(|| path.clone())
            .to_string_lossy()
            .into(),
        shm_bytes: bytes as u64,
        shm_device: device,
        shm_inode: inode,
        kv_tcp_port: u32::from(kv.local_addr().unwrap().port()),
        total_blocks: blocks as u32,
        protocol_version: tandem_proto::PROTOCOL_VERSION,
        instance_id: vec![1; 16],
        ..WorkerInfo::default()
    };
    let svc = DecodeServiceServer::new(KvOnlyDecode {
        table: table.clone(),
        info,
        auth: side.auth.clone(),
    });
    let incoming = tonic::transport::server::TcpIncoming::from(grpc).with_nodelay(Some(true));
    if side.guard_calls {
        // As a worker serves: call tokens checked, over TLS when the credentials have it.
        let mut server = side.auth.server_builder().unwrap();
        tokio::spawn(server.add_service(svc).serve_with_incoming(incoming));
    } else {
        let mut server = tonic::transport::Server::builder();
        tokio::spawn(server.add_service(svc).serve_with_incoming(incoming));
    }
    tokio::spawn(serve_tcp(
        kv,
        table.clone(),
        side.auth.clone(),
        side.limits,
        std::future::pending(),
    ));
    DecodeSide {
        cache,
        table,
        endpoint,
        kv_tcp_addr,
        _tags: tags_path(&path),
        dir,
    }
}

/// The prefill side's blocks: distinct bytes per (layer, logical block).
fn source(l: &KvLayout, layer: usize, lb: u32) -> Vec<u8> {
    (0..l.block_layer_bytes())
        .map(|i| ((i * 31 + layer * 7 + lb as usize * 13) % 251) as u8)
        .collect()
}

fn destination(d: &DecodeSide, transport: Transport, lease: &Lease) -> KvDestination {
    KvDestination {
        transport: transport as i32,
        decode_endpoint: d.endpoint.clone(),
        lease: lease.token().as_bytes().to_vec(),
        block_ids: lease.blocks.clone(),
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
    let peers = d.peers(deployment());
    let l = layout("m");
    for transport in [Transport::Grpc, Transport::Tcp, Transport::Shm] {
        let tokens = 40; // 3 blocks, the last partly filled
        let blocks = vec![9, 2, 17];
        let (lease, rx) = d.table.create(blocks.clone(), tokens, "req").unwrap();
        let dest = destination(&d, transport, &lease);
        let sender = connect(&peers, &dest, &l, "req", tokens, 0).await.unwrap();
        let sender = send_all(sender, &l, 3, None).await.unwrap();
        // The first token's alternatives travel with it, on every transport, and so do the
        // other choices' first tokens: as many as a request may have, each with as many
        // alternatives as it may ask for (the largest TCP commit header).
        let top = vec![(42, -0.25), (7, -1.5), (1000, -3.0)];
        let others: Vec<FirstToken> = (1..tandem_proto::limits::MAX_CHOICES as u32)
            .map(|c| FirstToken {
                token: 100 + c,
                logprob: -(c as f32),
                top_logprobs: (0..tandem_proto::limits::MAX_TOP_LOGPROBS as u32)
                    .map(|k| (c * 1000 + k, -(k as f32)))
                    .collect(),
                other_choices: Vec::new(),
            })
            .collect();
        let first = FirstToken {
            token: 42,
            logprob: -0.25,
            top_logprobs: top.clone(),
            other_choices: others.clone(),
        };
        let stats = sender.commit(first).await.unwrap();
        assert_eq!(stats.transport, transport);
        assert_eq!(stats.bytes, (3 * 3 * l.block_layer_bytes()) as u64);
        let commit = rx.await.unwrap().unwrap();
        assert_eq!(
            (commit.first_token, commit.first_logprob, commit.bytes),
            (42, -0.25, stats.bytes)
        );
        assert_eq!(commit.first_top_logprobs, top, "{transport:?}");
        assert_eq!(commit.other_choices, others, "{transport:?}");
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
    let peers = d.peers(deployment());
    let (lease, rx) = d.table.create(vec![1, 2], 20, "req").unwrap();
    let dest = destination(&d, Transport::Tcp, &lease);
    // A prefill worker with another model's layout is refused before any byte moves.
    let other = layout("another-model");
    assert!(matches!(
        connect(&peers, &dest, &other, "req", 20, 0).await,
        Err(TransferError::LayoutMismatch(_))
    ));
    // Wrong number of blocks for the prompt.
    assert!(
        connect(&peers, &dest, &layout("m"), "req", 40, 0)
            .await
            .is_err()
    );

    // A transfer missing a layer fails at commit, on every transport, and fails the lease.
    for transport in [Transport::Tcp, Transport::Grpc, Transport::Shm] {
        let (lease, rx) = d.table.create(vec![3, 4], 20, "req").unwrap();
        let dest = destination(&d, transport, &lease);
        let sender = connect(&peers, &dest, &layout("m"), "req", 20, 0)
            .await
            .unwrap();
        let sender = send_all(sender, &layout("m"), 2, Some(1)).await.unwrap();
        assert!(
            sender.commit(FirstToken::new(1, 0.0)).await.is_err(),
            "{transport:?}"
        );
        if transport != Transport::Shm {
            assert!(
                rx.await.unwrap().is_err(),
                "{transport:?}: the waiting request learns why"
            );
        }
    }
    d.table.cancel(lease.token());
    drop(rx);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_lease_fences_every_transport() {
    let d = decode_side(16).await;
    let peers = d.peers(deployment());
    let l = layout("m");
    for transport in [Transport::Shm, Transport::Tcp, Transport::Grpc] {
        let blocks = vec![5, 6];
        let (lease, _rx) = d.table.create(blocks.clone(), 32, "req").unwrap();
        let dest = destination(&d, transport, &lease);
        let sender = connect(&peers, &dest, &l, "req", 32, 0).await.unwrap();
        let before: Vec<u8> = d.cache.block_layer_bytes(0, 5).unwrap().to_vec();
        assert_eq!(d.table.cancel(lease.token()), Some(blocks.clone()));
        let result = send_all(sender, &l, 2, None).await;
        match result {
            // Shared memory refuses to write at once (the owner tag is gone) ...
            Err(TransferError::Cancelled) => assert_eq!(transport, Transport::Shm),
            // ... the network transports learn it from the peer, at the latest at commit.
            Ok(sender) => assert!(
                sender.commit(FirstToken::new(1, 0.0)).await.is_err(),
                "{transport:?}"
            ),
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
/// say they read no device memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_ipc_without_a_device_pool_is_refused_up_front() {
    let d = decode_side(8).await;
    let peers = d.peers(deployment());
    let l = layout("m");
    let (lease, _rx) = d.table.create(vec![1], 10, "req").unwrap();
    for transport in [Transport::CudaIpc, Transport::Nccl] {
        let dest = destination(&d, transport, &lease);
        let err = match connect(&peers, &dest, &l, "req", 10, 0).await {
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

    let dest = destination(&d, Transport::Shm, &lease);
    let sender = connect(&peers, &dest, &l, "req", 10, 0).await.unwrap();
    // A host transport never reads device memory (and without CUDA no device pool can even
    // be named: `DeviceKv` has no value then).
    assert!(!sender.reads_device());
}

/// The deployment's credentials with mutual TLS: a fresh CA and one certificate for
/// 127.0.0.1 that every side uses.
fn deployment_with_tls() -> InternalAuth {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair, SanType};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut leaf = CertificateParams::new(Vec::<String>::new()).unwrap();
    leaf.subject_alt_names
        .push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
    let leaf = leaf.signed_by(&key, &ca, &ca_key).unwrap();
    let tls =
        tandem_auth::Tls::from_pem(&ca.pem(), &leaf.pem(), &key.serialize_pem(), None).unwrap();
    InternalAuth::new(
        Some(&Secret::new(&"transport-tests-secret-".repeat(2)).unwrap()),
        Some(tls),
        false,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn internal_tls_carries_grpc_and_tcp_transfers() {
    let auth = deployment_with_tls();
    let d = decode_side_with(
        8,
        Side {
            auth: auth.clone(),
            ..Side::default()
        },
    )
    .await;
    let l = layout("m");
    let peers = d.peers(auth);
    for transport in [Transport::Tcp, Transport::Grpc, Transport::Shm] {
        let (lease, rx) = d.table.create(vec![4, 5], 20, "req").unwrap();
        let sender = connect(
            &peers,
            &destination(&d, transport, &lease),
            &l,
            "req",
            20,
            0,
        )
        .await
        .unwrap();
        let sender = send_all(sender, &l, 2, None).await.unwrap();
        sender.commit(FirstToken::new(3, 0.0)).await.unwrap();
        assert!(rx.await.unwrap().is_ok(), "{transport:?}");
        assert_eq!(
            d.cache.block_layer_bytes(2, 5).unwrap(),
            &source(&l, 2, 1)[..]
        );
    }
    // Without a certificate, even holding the secret, nothing gets through.
    let (lease, _rx) = d.table.create(vec![1], 10, "req").unwrap();
    let err = connect(
        &d.peers(deployment()),
        &destination(&d, Transport::Grpc, &lease),
        &l,
        "req",
        10,
        0,
    )
    .await
    .err()
    .expect("plain gRPC to a TLS worker");
    assert!(matches!(err, TransferError::Connect(_)), "{err}");
}

/// The pool's bytes of `layer`, `block`, to check nothing was written.
fn snapshot(d: &DecodeSide, block: u32) -> Vec<Vec<u8>> {
    (0..3)
        .map(|layer| d.cache.block_layer_bytes(layer, block).unwrap().to_vec())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_goes_only_to_a_decode_worker_that_proves_the_secret() {
    // A service at the endpoint that answers GetInfo, but signed with another secret (an
    // impostor, or a worker of another deployment): refused before any byte moves.
    let impostor = decode_side_with(
        8,
        Side {
            auth: stranger(),
            guard_calls: false,
            ..Side::default()
        },
    )
    .await;
    let (lease, _rx) = impostor.table.create(vec![1], 10, "req").unwrap();
    let before = snapshot(&impostor, 1);
    for transport in [Transport::Shm, Transport::Tcp, Transport::Grpc] {
        let dest = destination(&impostor, transport, &lease);
        let peers = impostor.peers(deployment());
        let err = connect(&peers, &dest, &layout("m"), "req", 10, 0)
            .await
            .err()
            .expect("an impostor gets no KV");
        assert!(matches!(err, TransferError::Unauthenticated(_)), "{err}");
        assert!(err.to_string().contains("did not prove"), "{err}");
    }
    assert_eq!(snapshot(&impostor, 1), before);

    // A prefill worker without the secret is refused by a real decode worker.
    let d = decode_side(8).await;
    let (lease, _rx) = d.table.create(vec![1], 10, "req").unwrap();
    for auth in [stranger(), InternalAuth::none()] {
        let dest = destination(&d, Transport::Grpc, &lease);
        let err = connect(&d.peers(auth), &dest, &layout("m"), "req", 10, 0)
            .await
            .err()
            .expect("refused");
        assert!(matches!(err, TransferError::Unauthenticated(_)), "{err}");
    }
    assert_eq!(d.table.len(), 1, "the lease is untouched");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_without_the_secret_are_refused_and_fail_no_lease() {
    use tandem_proto::v1::decode_service_client::DecodeServiceClient;
    let d = decode_side(8).await;
    let (lease, mut rx) = d.table.create(vec![1], 10, "victim").unwrap();
    let mut raw = DecodeServiceClient::connect(d.endpoint.clone())
        .await
        .unwrap();
    let commit = KvCommit {
        lease: lease.token().as_bytes().to_vec(),
        kv_layout_hash: d.table.layout_hash().into(),
        first_token: 13,
        num_tokens: 10,
        transport: Transport::Grpc as i32,
        ..Default::default()
    };
    // Even holding the capability, a caller without the secret gets nowhere.
    let status = raw.commit_kv(commit.clone()).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated);
    let renew = RenewLeaseRequest {
        lease: lease.token().as_bytes().to_vec(),
    };
    assert_eq!(
        raw.renew_lease(renew).await.unwrap_err().code(),
        tonic::Code::Unauthenticated
    );
    let status = raw.get_info(InfoRequest::default()).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated);
    // A member of the deployment guessing capabilities: not found, naming nothing.
    let peers = d.peers(deployment());
    let mut member = peers.decode_client(&d.endpoint).unwrap();
    for guess in [vec![0u8; 16], vec![1u8; 16], Vec::new()] {
        let status = member
            .commit_kv(KvCommit {
                lease: guess,
                ..commit.clone()
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::NotFound);
        assert!(!status.message().contains("10"), "{}", status.message());
    }
    assert!(rx.try_recv().is_err(), "the victim's lease is still open");
    assert_eq!(d.table.len(), 1);
}

#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_memory_is_never_written_through_a_link_or_outside_its_folder() {
    let victim_dir = tempfile::tempdir().unwrap();
    let victim = victim_dir.path().join("victim");
    std::fs::write(&victim, vec![7u8; 4096]).unwrap();
    let holder = tempfile::tempdir().unwrap();
    let link = holder.path().join(format!("{POOL_PREFIX}evil-1"));
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    let outside = victim_dir.path().join(format!("{POOL_PREFIX}elsewhere-1"));
    std::fs::write(&outside, vec![7u8; 4096]).unwrap();
    for advertised in [link.clone(), outside.clone(), victim.clone()] {
        // A worker of the deployment (it signs with the secret) advertising a bad path: the
        // prefill side still refuses.
        let d = decode_side_with(
            8,
            Side {
                shm_path: Some(advertised.clone()),
                ..Side::default()
            },
        )
        .await;
        // The link sits in the decode side's own folder for the first case.
        if advertised == link {
            let inside = d.dir.path().join(format!("{POOL_PREFIX}evil-1"));
            std::os::unix::fs::symlink(&victim, &inside).unwrap();
        }
        let (lease, _rx) = d.table.create(vec![1], 10, "req").unwrap();
        let dest = destination(&d, Transport::Shm, &lease);
        let err = connect(&d.peers(deployment()), &dest, &layout("m"), "req", 10, 0)
            .await
            .err()
            .expect("refused");
        assert!(
            err.to_string().contains("refusing the shared-memory file"),
            "{err}"
        );
    }
    assert_eq!(std::fs::read(&victim).unwrap(), vec![7u8; 4096]);
    assert_eq!(std::fs::read(&outside).unwrap(), vec![7u8; 4096]);
}

mod raw_tcp {
    use std::time::{Duration, Instant};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::*;

    fn prefix(kind: u8, header_len: u32, payload_len: u64) -> Vec<u8> {
        let mut out = b"TKV2".to_vec();
        out.extend_from_slice(&[kind, 0, 0, 0]);
        out.extend_from_slice(&header_len.to_le_bytes());
        out.extend_from_slice(&payload_len.to_le_bytes());
        out
    }

    /// Reads until the peer closes, at most `limit`; returns what came and whether it closed.
    async fn drain(s: &mut TcpStream, limit: Duration) -> (Vec<u8>, bool) {
        let mut got = Vec::new();
        let deadline = Instant::now() + limit;
        let mut buf = [0u8; 4096];
        while Instant::now() < deadline {
            match tokio::time::timeout_at(deadline.into(), s.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return (got, true),
                Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
                Err(_) => break,
            }
        }
        (got, false)
    }

    fn quick() -> TcpLimits {
        TcpLimits {
            max_connections: 2,
            hello_timeout: Duration::from_millis(300),
            read_timeout: Duration::from_millis(300),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_header_claiming_a_huge_payload_is_refused_before_anything_is_read() {
        let d = decode_side(8).await;
        let mut s = TcpStream::connect(&d.kv_tcp_addr).await.unwrap();
        // The 20 bytes of the old attack: a frame header announcing 256 MiB.
        s.write_all(&prefix(1, 0, 256 << 20)).await.unwrap();
        let started = Instant::now();
        let (reply, closed) = drain(&mut s, Duration::from_secs(5)).await;
        assert!(closed, "the listener hangs up");
        assert!(started.elapsed() < Duration::from_secs(2));
        let text = String::from_utf8_lossy(&reply);
        assert!(text.contains("carries no payload"), "{text}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hello_without_the_secret_is_refused_and_the_lease_survives() {
        let d = decode_side(8).await;
        let (lease, mut rx) = d.table.create(vec![2], 10, "victim").unwrap();
        let mut s = TcpStream::connect(&d.kv_tcp_addr).await.unwrap();
        // Skip the challenge, answer with a made-up proof for the real lease.
        let mut header = Vec::new();
        header.extend_from_slice(&tandem_proto::PROTOCOL_VERSION.to_le_bytes());
        for field in [
            &lease.token().as_bytes()[..],
            d.table.layout_hash().as_bytes(),
            b"attacker",
            &[0u8; 32][..],
        ] {
            header.extend_from_slice(&(field.len() as u16).to_le_bytes());
            header.extend_from_slice(field);
        }
        let mut hello = prefix(1, header.len() as u32, 0);
        hello.extend_from_slice(&header);
        s.write_all(&hello).await.unwrap();
        let (reply, closed) = drain(&mut s, Duration::from_secs(5)).await;
        assert!(closed);
        let text = String::from_utf8_lossy(&reply);
        assert!(text.contains("does not prove"), "{text}");
        assert!(rx.try_recv().is_err(), "the lease is untouched");
        assert_eq!(d.table.len(), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn silent_and_surplus_connections_are_closed() {
        let d = decode_side_with(
            8,
            Side {
                limits: quick(),
                ..Side::default()
            },
        )
        .await;
        let mut first = TcpStream::connect(&d.kv_tcp_addr).await.unwrap();
        let mut second = TcpStream::connect(&d.kv_tcp_addr).await.unwrap();
        // Give the listener time to hand both their slots.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut third = TcpStream::connect(&d.kv_tcp_addr).await.unwrap();
        let (got, closed) = drain(&mut third, Duration::from_millis(200)).await;
        assert!(closed && got.is_empty(), "over the cap: closed at once");
        for s in [&mut first, &mut second] {
            let (got, closed) = drain(s, Duration::from_secs(3)).await;
            assert!(
                closed,
                "a silent connection is closed after the hello timeout"
            );
            assert!(String::from_utf8_lossy(&got).contains("no hello"));
        }
        // Slots are free again: a proper transfer still works.
        let (lease, rx) = d.table.create(vec![1], 10, "req").unwrap();
        let peers = d.peers(deployment());
        let sender = connect(
            &peers,
            &destination(&d, Transport::Tcp, &lease),
            &layout("m"),
            "req",
            10,
            0,
        )
        .await
        .unwrap();
        let sender = send_all(sender, &layout("m"), 1, None).await.unwrap();
        sender.commit(FirstToken::new(5, 0.0)).await.unwrap();
        assert!(rx.await.unwrap().is_ok());
    }
}
