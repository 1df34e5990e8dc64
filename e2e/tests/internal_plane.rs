//! The internal plane as a stranger (or a careless insider) sees it: each row of the attack
//! table of the issue "Harden the serving plane", against the real worker binaries on
//! loopback. On the main branch before that issue every one of these succeeded.

use std::time::{Duration, Instant};

use tandem_auth::{InternalAuth, Secret};
use tandem_e2e::{
    DecodeClient, Deployment, DeploymentSpec, PrefillClient, Proc, channel, decode_client,
    greedy_completion, prefill_client, rss_kib, test_auth,
};
use tandem_proto::v1::decode_service_client::DecodeServiceClient;
use tandem_proto::v1::prefill_service_client::PrefillServiceClient;
use tandem_proto::v1::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const TINY: [&str; 6] = ["--model", "tiny", "--kv-budget-mb", "16", "--threads", "1"];
const WAIT: Duration = Duration::from_secs(120);

fn args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut all = TINY.to_vec();
    all.extend_from_slice(extra);
    all
}

/// Credentials of another deployment.
fn other_deployment() -> InternalAuth {
    InternalAuth::with_secret(&Secret::new("some-other-deployment-secret-987654321").unwrap())
}

async fn decode_as(endpoint: &str, auth: &InternalAuth) -> DecodeClient {
    DecodeServiceClient::new(channel(endpoint, auth).await.unwrap())
}

async fn prefill_as(endpoint: &str, auth: &InternalAuth) -> PrefillClient {
    PrefillServiceClient::new(channel(endpoint, auth).await.unwrap())
}

fn generate(prompt_len: usize, mode: Mode, lease_ttl_ms: u32) -> GenerateRequest {
    GenerateRequest {
        request_id: "attack".into(),
        prompt: (0..prompt_len).map(|i| 3 + (i % 200) as u32).collect(),
        sampling: Some(SamplingParams::default()),
        stop: Some(StopParams {
            max_tokens: 4,
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

async fn used_blocks(d: &mut DecodeClient) -> u32 {
    let l = d
        .get_load(LoadRequest::default())
        .await
        .unwrap()
        .into_inner();
    l.total_blocks - l.free_blocks
}

async fn wait_blocks(d: &mut DecodeClient, want: u32, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let used = used_blocks(d).await;
        if used == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{used} blocks in use, not {want}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Asserts that a stranger's call `what` was refused as unauthenticated.
fn refused<T>(what: &str, r: Result<T, tonic::Status>) {
    match r {
        Ok(_) => panic!("a stranger's {what} was served"),
        Err(s) => assert_eq!(s.code(), tonic::Code::Unauthenticated, "{what}: {s}"),
    }
}

fn random_token() -> Vec<u8> {
    tandem_auth::random_bytes::<16>().unwrap().to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_get_nothing_from_the_workers() {
    let decode = Proc::start("tandem-decode", &TINY).unwrap();
    let prefill = Proc::start("tandem-prefill", &TINY).unwrap();
    let (mut d, _) = decode_client(&decode.endpoint(), WAIT).await.unwrap();
    prefill_client(&prefill.endpoint(), WAIT).await.unwrap();
    for stranger in [InternalAuth::none(), other_deployment()] {
        let mut sd = decode_as(&decode.endpoint(), &stranger).await;
        // The attack that took every KV block: huge reservations with an endless lease.
        for _ in 0..2 {
            let r = sd
                .generate(generate(16_000, Mode::Disaggregated, u32::MAX))
                .await;
            refused("Generate", r);
        }
        let r = sd.get_info(InfoRequest::default()).await;
        refused("GetInfo", r);
        let r = sd.get_load(LoadRequest::default()).await;
        refused("GetLoad", r);
        let lease = random_token();
        let r = sd
            .renew_lease(RenewLeaseRequest {
                lease: lease.clone(),
            })
            .await;
        refused("RenewLease", r);
        let r = sd
            .commit_kv(KvCommit {
                lease: lease.clone(),
                first_token: 42,
                ..Default::default()
            })
            .await;
        refused("CommitKv", r);
        let header = KvMessage {
            msg: Some(kv_message::Msg::Header(KvHeader {
                lease,
                ..Default::default()
            })),
        };
        let r = sd.push_kv(futures::stream::iter([header])).await;
        refused("PushKv", r);
        let r = sd.open_nccl(OpenNcclRequest::default()).await;
        refused("OpenNccl", r);
        let r = sd
            .pull_kv(PullKvRequest {
                lease: random_token(),
                to_block: 1,
                ..Default::default()
            })
            .await;
        refused("PullKv", r);
        let mut sp = prefill_as(&prefill.endpoint(), &stranger).await;
        let r = sp
            .prefill(PrefillRequest {
                stop: None,
                request_id: "attack".into(),
                prompt: vec![5; 10],
                ..Default::default()
            })
            .await;
        refused("Prefill", r);
        let r = sp.get_info(InfoRequest::default()).await;
        refused("prefill GetInfo", r);
    }
    assert_eq!(used_blocks(&mut d).await, 0, "no block was reserved");
    // Health stays open (Kubernetes probes send no credentials) and reveals only that.
    let mut health = tonic_health::pb::health_client::HealthClient::new(
        channel(&decode.endpoint(), &InternalAuth::none())
            .await
            .unwrap(),
    );
    let status = health
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        status.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
}

/// A decode worker whose callers may hold half its pool in reservations, for at most 400 ms
/// each, waiting `reserve_wait_ms` for room; and a first lease over 1000 of its blocks
/// (16 000 tokens) that asked for an endless wait and is never fed. Returns the worker, a
/// client, the pool's blocks, the lease's stream (its Lease event read) and when it was asked.
async fn half_share_decode_with_a_lease(
    reserve_wait_ms: &str,
) -> (
    Proc,
    DecodeClient,
    u32,
    tonic::Streaming<GenerateEvent>,
    Instant,
) {
    let decode = Proc::start(
        "tandem-decode",
        &args(&[
            "--max-lease-ttl-ms",
            "400",
            "--caller-lease-share",
            "0.5",
            "--reserve-wait-ms",
            reserve_wait_ms,
        ]),
    )
    .unwrap();
    let (mut d, info) = decode_client(&decode.endpoint(), WAIT).await.unwrap();
    let started = Instant::now();
    let mut first = d
        .generate(generate(16_000, Mode::Disaggregated, u32::MAX))
        .await
        .unwrap()
        .into_inner();
    let lease = first.message().await.unwrap().unwrap();
    assert!(matches!(lease.event, Some(generate_event::Event::Lease(_))));
    (decode, d, info.total_blocks, first, started)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_of_the_deployment_is_held_to_the_lease_caps() {
    // No wait for room: past its share, a reservation is refused at once.
    let (_decode, mut d, total, mut first, started) = half_share_decode_with_a_lease("0").await;
    // A second one would pass half the pool: refused, naming the cap.
    let second = d
        .generate(generate(16_000, Mode::Disaggregated, u32::MAX))
        .await
        .unwrap_err();
    assert_eq!(second.code(), tonic::Code::ResourceExhausted, "{second}");
    assert!(second.message().contains("may hold at most"), "{second}");
    assert!(used_blocks(&mut d).await <= total / 2);
    // Others still get served meanwhile.
    let mut agg = d
        .generate(generate(100, Mode::Aggregated, 0))
        .await
        .unwrap()
        .into_inner();
    let mut tokens = 0;
    while let Some(ev) = agg.message().await.unwrap() {
        if matches!(ev.event, Some(generate_event::Event::Token(_))) {
            tokens += 1;
        }
    }
    assert_eq!(tokens, 4);
    let expired = first.message().await.unwrap_err();
    assert_eq!(expired.code(), tonic::Code::DeadlineExceeded, "{expired}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the lease was cut at the worker's maximum, not the caller's u32::MAX ms"
    );
    wait_blocks(&mut d, 0, Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_past_the_callers_share_waits_for_room_instead_of_failing() {
    let (_decode, mut d, total, mut first, started) = half_share_decode_with_a_lease("20000").await;
    let share = total / 2;
    // A second one would pass half the pool: it waits (a burst of long prompts must queue,
    // not fail) and gets its lease once the first one's blocks come back.
    let mut d2 = d.clone();
    let second = tokio::spawn(async move {
        d2.generate(generate(16_000, Mode::Disaggregated, 300))
            .await
    });
    let expired = first.message().await.unwrap_err();
    assert_eq!(expired.code(), tonic::Code::DeadlineExceeded, "{expired}");
    let mut second = second
        .await
        .unwrap()
        .expect("granted once there is room")
        .into_inner();
    let lease = second.message().await.unwrap().unwrap();
    assert!(matches!(lease.event, Some(generate_event::Event::Lease(_))));
    assert!(
        started.elapsed() >= Duration::from_millis(350),
        "the second lease came before the first one ended"
    );
    // A prompt that needs more than the share can never fit: refused at once, not after the
    // wait, naming the cap.
    let asked = Instant::now();
    let too_big = d
        .generate(generate(
            (share as usize + 20) * 16,
            Mode::Disaggregated,
            300,
        ))
        .await
        .unwrap_err();
    assert_eq!(too_big.code(), tonic::Code::ResourceExhausted, "{too_big}");
    assert!(too_big.message().contains("may hold at most"), "{too_big}");
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "refused only after waiting"
    );
    drop(second);
    wait_blocks(&mut d, 0, Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guessed_commits_and_pushes_fail_and_every_victim_finishes() {
    let dep = Deployment::start(&DeploymentSpec::default()).await.unwrap();
    let client = reqwest::Client::new();
    let base = dep.url("");
    let prompts: Vec<Vec<u32>> = (0..6u32)
        .map(|i| {
            (0..40 + 7 * i)
                .map(|j| 3 + (i * 13 + j * 5) % 250)
                .collect()
        })
        .collect();
    let mut clean = Vec::new();
    for p in &prompts {
        clean.push(greedy_completion(&client, &base, p, 24).await.unwrap().text);
    }
    // An insider (holding the secret) guessing capabilities, and a stranger, while the
    // victims run. The insider gets everything else right (the layout hash), so only the
    // capability stands in the way.
    let decode = dep.decode[0].endpoint();
    let (_, info) = decode_client(&decode, WAIT).await.unwrap();
    let layout_hash = info.kv_layout_hash;
    let attacker = tokio::spawn(async move {
        let mut insider = decode_as(&decode, &test_auth()).await;
        let mut stranger = decode_as(&decode, &InternalAuth::none()).await;
        let (mut from_insider, mut from_stranger) = (Vec::new(), Vec::new());
        for i in 0..150u32 {
            let commit = KvCommit {
                lease: random_token(),
                kv_layout_hash: layout_hash.clone(),
                first_token: 42,
                num_tokens: 40 + i % 40,
                transport: Transport::Shm as i32,
                ..Default::default()
            };
            from_insider.push(insider.commit_kv(commit.clone()).await.unwrap_err());
            from_stranger.push(stranger.commit_kv(commit).await.unwrap_err());
            // Reading a victim's cached prefix back takes its capability too.
            let pull = PullKvRequest {
                lease: random_token(),
                kv_layout_hash: layout_hash.clone(),
                request_id: "attack".into(),
                from_block: 0,
                to_block: 1 + i % 4,
            };
            from_insider.push(insider.pull_kv(pull.clone()).await.unwrap_err());
            from_stranger.push(stranger.pull_kv(pull).await.unwrap_err());
            let payload = vec![0u8; 64];
            let push = [
                KvMessage {
                    msg: Some(kv_message::Msg::Header(KvHeader {
                        lease: random_token(),
                        kv_layout_hash: layout_hash.clone(),
                        request_id: "attack".into(),
                    })),
                },
                KvMessage {
                    msg: Some(kv_message::Msg::Blocks(KvBlocks {
                        layer: 0,
                        logical_blocks: vec![0],
                        checksums: vec![crc32(&payload)],
                        payload: payload.into(),
                    })),
                },
            ];
            from_insider.push(
                insider
                    .push_kv(futures::stream::iter(push))
                    .await
                    .unwrap_err(),
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        (from_insider, from_stranger)
    });
    let victims: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (client, base, p) = (client.clone(), base.clone(), p.clone());
            tokio::spawn(async move { greedy_completion(&client, &base, &p, 24).await })
        })
        .collect();
    for (victim, want) in victims.into_iter().zip(&clean) {
        let got = victim.await.unwrap().expect("a victim failed");
        assert_eq!(&got.text, want, "an attacker changed a victim's text");
        assert_eq!(got.mode, "disaggregated");
    }
    let (from_insider, from_stranger) = attacker.await.unwrap();
    // The insider finds no lease, and learns nothing about anyone's request; the stranger is
    // not even let in. No victim failed (above).
    for status in &from_insider {
        assert_eq!(status.code(), tonic::Code::NotFound, "{status}");
        assert!(
            !status.message().contains(|c: char| c.is_ascii_digit()),
            "{}",
            status.message()
        );
    }
    for status in &from_stranger {
        assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status}");
    }
}

fn crc32(bytes: &[u8]) -> u32 {
    tandem_transfer::crc32(bytes)
}

/// Counts every byte sent to it by anyone, on a listener of its own.
async fn byte_sink() -> (String, tokio::task::JoinHandle<Vec<u8>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(8);
        while let Ok(Ok((mut s, _))) =
            tokio::time::timeout_at(deadline.into(), listener.accept()).await
        {
            let mut buf = [0u8; 4096];
            while let Ok(Ok(n)) = tokio::time::timeout_at(deadline.into(), s.read(&mut buf)).await {
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&buf[..n]);
            }
        }
        got
    });
    (format!("http://{addr}"), task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefill_worker_sends_kv_only_to_verified_decode_workers() {
    let prefill = Proc::start("tandem-prefill", &TINY).unwrap();
    let (mut p, pinfo) = prefill_client(&prefill.endpoint(), WAIT).await.unwrap();
    // A decode worker of another deployment (another secret).
    let foreign = Proc::start_with_env(
        "tandem-decode",
        &TINY,
        &[(
            "TANDEM_INTERNAL_SECRET",
            "some-other-deployment-secret-987654321",
        )],
    )
    .unwrap();
    let (mut fd, _) =
        tandem_e2e::decode_client_with(&foreign.endpoint(), WAIT, &other_deployment())
            .await
            .unwrap();
    let (sink, sunk) = byte_sink().await;
    for (endpoint, transport) in [
        (sink.clone(), Transport::Tcp),
        (sink.clone(), Transport::Shm),
        (foreign.endpoint(), Transport::Tcp),
        (foreign.endpoint(), Transport::Grpc),
    ] {
        let refused = p
            .prefill(PrefillRequest {
                stop: None,
                request_id: "ssrf".into(),
                prompt: vec![7; 40],
                sampling: Some(SamplingParams::default()),
                destination: Some(KvDestination {
                    transport: transport as i32,
                    decode_endpoint: endpoint.clone(),
                    lease: random_token(),
                    block_ids: vec![1, 2, 3],
                    kv_layout_hash: pinfo.kv_layout_hash.clone(),
                    ..Default::default()
                }),
            })
            .await
            .unwrap_err();
        // A decode-side failure (ABORTED): the router would not hold it against the prefill
        // worker.
        assert_eq!(
            refused.code(),
            tonic::Code::Aborted,
            "{endpoint}: {refused}"
        );
    }
    let got = sunk.await.unwrap();
    let magic = got.windows(4).any(|w| w == b"TKV2" || w == b"TKV1");
    assert!(!magic, "KV frames reached a stranger's address");
    assert!(
        got.len() < 4096,
        "{} bytes reached a stranger's address (a GetInfo attempt is a few hundred)",
        got.len()
    );
    assert_eq!(used_blocks(&mut fd).await, 0);
}

#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_memory_behind_a_link_or_outside_its_folder_is_never_written() {
    use std::os::unix::fs::MetadataExt;
    use tandem_kv::shm::POOL_PREFIX;
    use tandem_transfer::{KvOnlyDecode, LeaseTable};
    let shm = std::path::Path::new("/dev/shm");
    if !shm.is_dir() {
        eprintln!("SKIP: no /dev/shm");
        return;
    }
    let prefill = Proc::start("tandem-prefill", &TINY).unwrap();
    let (mut p, pinfo) = prefill_client(&prefill.endpoint(), WAIT).await.unwrap();
    let layout = pinfo.kv_layout.clone().unwrap();
    let block_bytes =
        (layout.num_layers * layout.num_kv_heads * layout.head_dim * layout.block_size * 2 * 4)
            as u64;
    let dir = tempfile::tempdir().unwrap();
    let victim = dir.path().join("victim");
    let precious = vec![0x5au8; (4 * block_bytes) as usize];
    std::fs::write(&victim, &precious).unwrap();
    let link = shm.join(format!("{POOL_PREFIX}evil-{}", std::process::id()));
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    let meta = std::fs::metadata(&victim).unwrap();
    for advertised in [link.clone(), victim.clone()] {
        // An insider's fake decode worker (it signs with the secret) that advertises the
        // link, or the victim itself, with the victim's very inode.
        let engine_layout = tandem_kv::KvLayout {
            num_layers: layout.num_layers as usize,
            num_kv_heads: layout.num_kv_heads as usize,
            head_dim: layout.head_dim as usize,
            block_size: layout.block_size as usize,
            dtype: tandem_kv::KvDtype::F32,
            model_fingerprint: layout.model_fingerprint.clone(),
        };
        let cache =
            tandem_kv::KvCache::with_budget(engine_layout.clone(), 4 * block_bytes as usize)
                .unwrap();
        let table = std::sync::Arc::new(LeaseTable::new(
            cache.block_writer(),
            pinfo.kv_layout_hash.clone(),
            None,
        ));
        let (lease, _rx) = table.create(vec![0, 1, 2], 40, "victim").unwrap();
        let info = WorkerInfo {
            role: Role::Decode as i32,
            kv_layout_hash: pinfo.kv_layout_hash.clone(),
            transports: vec![Transport::Shm as i32],
            shm_path: advertised.to_string_lossy().into(),
            shm_bytes: meta.len(),
            shm_device: meta.dev(),
            shm_inode: meta.ino(),
            protocol_version: tandem_proto::PROTOCOL_VERSION,
            instance_id: vec![9; 16],
            ..Default::default()
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let auth = test_auth();
        let svc = decode_service_server::DecodeServiceServer::new(KvOnlyDecode {
            table,
            info,
            auth: auth.clone(),
        });
        let server = tokio::spawn(
            auth.server_builder()
                .unwrap()
                .add_service(svc)
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
        );
        let refused = p
            .prefill(PrefillRequest {
                stop: None,
                request_id: "symlink".into(),
                prompt: vec![7; 40],
                sampling: Some(SamplingParams::default()),
                destination: Some(KvDestination {
                    transport: Transport::Shm as i32,
                    decode_endpoint: endpoint,
                    lease: lease.token().as_bytes().to_vec(),
                    block_ids: lease.blocks.clone(),
                    kv_layout_hash: pinfo.kv_layout_hash.clone(),
                    ..Default::default()
                }),
            })
            .await
            .unwrap_err();
        assert!(
            refused
                .message()
                .contains("refusing the shared-memory file"),
            "{}: {refused}",
            advertised.display()
        );
        server.abort();
    }
    let _ = std::fs::remove_file(&link);
    assert_eq!(
        std::fs::read(&victim).unwrap(),
        precious,
        "the victim file changed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kv_port_allocates_nothing_for_strangers() {
    let decode = Proc::start(
        "tandem-decode",
        &args(&[
            "--kv-tcp-hello-timeout-ms",
            "500",
            "--kv-tcp-max-connections",
            "64",
        ]),
    )
    .unwrap();
    let (_d, info) = decode_client(&decode.endpoint(), WAIT).await.unwrap();
    let addr = format!("127.0.0.1:{}", info.kv_tcp_port);
    let before = rss_kib(decode.pid());
    // The old attack's 20 bytes: a frame header that claims 256 MiB, as a hello and as a
    // blocks frame; and connections that send nothing at all.
    let frame = |kind: u8| {
        let mut f = b"TKV2".to_vec();
        f.extend_from_slice(&[kind, 0, 0, 0]);
        f.extend_from_slice(&0u32.to_le_bytes());
        f.extend_from_slice(&(256u64 << 20).to_le_bytes());
        f
    };
    let mut conns = Vec::new();
    for i in 0..30 {
        let mut s = TcpStream::connect(&addr).await.unwrap();
        match i % 3 {
            0 => s.write_all(&frame(1)).await.unwrap(),
            1 => s.write_all(&frame(2)).await.unwrap(),
            _ => {}
        }
        conns.push(s);
    }
    let started = Instant::now();
    for mut s in conns {
        let mut buf = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await;
        assert!(
            matches!(read, Ok(Ok(_)) | Ok(Err(_))),
            "a connection was still open after 5 s"
        );
    }
    assert!(started.elapsed() < Duration::from_secs(4));
    let after = rss_kib(decode.pid());
    assert!(
        after < before + 8 * 1024,
        "the decode worker grew from {before} KiB to {after} KiB"
    );
}

/// Sends `sig` to `pid` with kill(1).
fn signal(pid: u32, sig: &str) {
    let status = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

async fn wait_exit(p: &mut Proc, within: Duration) {
    let deadline = Instant::now() + within;
    while !p.exited() {
        assert!(Instant::now() < deadline, "{} did not exit", p.name);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_memory_files_are_private_and_never_outlive_their_worker() {
    use std::os::unix::fs::PermissionsExt;
    let shm = std::path::Path::new("/dev/shm");
    let dir = if shm.is_dir() {
        tempfile::tempdir_in(shm).unwrap()
    } else {
        tempfile::tempdir().unwrap()
    };
    let dir_arg = dir.path().to_string_lossy().to_string();
    let worker = |dir: &str| Proc::start("tandem-decode", &args(&["--shm-dir", dir])).unwrap();
    let files = |info: &WorkerInfo| {
        let pool = std::path::PathBuf::from(&info.shm_path);
        let tags = tandem_kv::shm::tags_path(&pool);
        [pool, tags]
    };
    // Private while it runs; gone after SIGTERM.
    let mut first = worker(&dir_arg);
    let (_, info) = decode_client(&first.endpoint(), WAIT).await.unwrap();
    for f in files(&info) {
        let mode = std::fs::metadata(&f).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{}: {mode:o}", f.display());
    }
    signal(first.pid(), "-TERM");
    wait_exit(&mut first, Duration::from_secs(20)).await;
    for f in files(&info) {
        assert!(!f.exists(), "{} outlived SIGTERM", f.display());
    }
    // kill -9 leaves them; the next worker to start in the folder removes them.
    let mut second = worker(&dir_arg);
    let (_, crashed) = decode_client(&second.endpoint(), WAIT).await.unwrap();
    second.kill();
    assert!(files(&crashed).iter().all(|f| f.exists()));
    let third = worker(&dir_arg);
    let (_, info) = decode_client(&third.endpoint(), WAIT).await.unwrap();
    for f in files(&crashed) {
        assert!(!f.exists(), "{} of a dead worker was left", f.display());
    }
    assert!(files(&info).iter().all(|f| f.exists()));
    drop(third);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn internal_mutual_tls_carries_a_deployment() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = tandem_e2e::test_pki(dir.path(), &[]).unwrap();
    let path = |p: &std::path::Path| p.to_string_lossy().to_string();
    let spec = DeploymentSpec {
        env: vec![
            ("TANDEM_INTERNAL_TLS_CA".into(), path(&ca)),
            ("TANDEM_INTERNAL_TLS_CERT".into(), path(&cert)),
            ("TANDEM_INTERNAL_TLS_KEY".into(), path(&key)),
        ],
        ..DeploymentSpec::default()
    };
    let dep = Deployment::start(&spec).await.unwrap();
    let client = reqwest::Client::new();
    let done = greedy_completion(&client, &dep.url(""), &[5, 6, 7, 8], 8)
        .await
        .unwrap();
    assert_eq!(done.mode, "disaggregated");
    // A client that speaks plain HTTP/2, even with the secret, gets no answer.
    let endpoint = dep.decode[0].endpoint();
    let plain = tonic::transport::Endpoint::from_shared(endpoint.clone())
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await;
    if let Ok(ch) = plain {
        let mut c = DecodeServiceClient::new(test_auth().channel(ch));
        assert!(c.get_load(LoadRequest::default()).await.is_err());
    }
    // Nor does one with the right CA but no client certificate.
    let no_cert = tonic::transport::Endpoint::from_shared(endpoint.replace("http://", "https://"))
        .unwrap()
        .tls_config(tonic::transport::ClientTlsConfig::new().ca_certificate(
            tonic::transport::Certificate::from_pem(std::fs::read(&ca).unwrap()),
        ))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await;
    if let Ok(ch) = no_cert {
        let mut c = DecodeServiceClient::new(test_auth().channel(ch));
        assert!(c.get_load(LoadRequest::default()).await.is_err());
    }
}
