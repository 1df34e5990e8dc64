//! The two worker binaries driven directly over gRPC (as the router drives them): the
//! disaggregated flow over every transport gives the aggregated tokens; cancellation and
//! lease expiry return every block; a decode worker's cached prefix is neither sent nor
//! recomputed (a prefill worker that lacks it reads it back), and a short uncached suffix runs
//! on the decode worker.

use std::time::{Duration, Instant};

use tandem_e2e::{DecodeClient, PrefillClient, Proc, decode_client, prefill_client};
use tandem_proto::v1::*;

struct Pair {
    decode: Proc,
    _prefill: Proc,
    d: DecodeClient,
    p: PrefillClient,
    info: WorkerInfo,
}

const COMMON: [&str; 4] = ["--model", "tiny", "--kv-budget-mb", "16"];

async fn start_pair() -> Pair {
    start_pair_with(&[]).await
}

/// Both workers with the common flags and `extra`.
async fn start_pair_with(extra: &[&str]) -> Pair {
    start_pair_each(extra, &[]).await
}

/// Both workers with the common flags and `extra`, the prefill worker with `prefill_extra`.
async fn start_pair_each(extra: &[&str], prefill_extra: &[&str]) -> Pair {
    // One compute thread each, unless `extra` says otherwise.
    let threads: &[&str] = if extra.contains(&"--threads") {
        &[]
    } else {
        &["--threads", "1"]
    };
    let args: Vec<&str> = COMMON.iter().chain(threads).chain(extra).copied().collect();
    let decode = Proc::start("tandem-decode", &args).unwrap();
    let prefill_args: Vec<&str> = args.iter().chain(prefill_extra).copied().collect();
    let prefill = Proc::start("tandem-prefill", &prefill_args).unwrap();
    let (d, info) = decode_client(&decode.endpoint(), Duration::from_secs(60))
        .await
        .unwrap();
    let (p, pinfo) = prefill_client(&prefill.endpoint(), Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(
        info.kv_layout_hash, pinfo.kv_layout_hash,
        "same model, same layout"
    );
    Pair {
        decode,
        _prefill: prefill,
        d,
        p,
        info,
    }
}

fn request(prompt: Vec<u32>, mode: Mode, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        request_id: format!("test-{}", prompt.len()),
        prompt,
        sampling: Some(SamplingParams::default()),
        stop: Some(StopParams {
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        }),
        mode: mode as i32,
        lease_ttl_ms: 0,
        local_prefill_below: 0,
        tpot_target_ms: 0,
        split_prompt_at: 0,
    }
}

fn prompt(i: u32, len: u32) -> Vec<u32> {
    (0..len).map(|j| 3 + (i * 31 + j * 7) % 250).collect()
}

/// Collects the token ids of a Generate stream (after the lease, if any).
async fn tokens(stream: &mut tonic::Streaming<GenerateEvent>) -> (Vec<u32>, Option<Finished>) {
    let mut out = Vec::new();
    while let Some(ev) = stream.message().await.unwrap() {
        match ev.event {
            Some(generate_event::Event::Token(t)) => out.push(t.id),
            Some(generate_event::Event::Finished(f)) => return (out, Some(f)),
            _ => {}
        }
    }
    (out, None)
}

/// Where a prefill worker is to write the KV of `lease`, granted by the pair's decode worker.
fn destination(pair: &Pair, lease: Lease, transport: Transport) -> KvDestination {
    KvDestination {
        transport: transport as i32,
        decode_endpoint: pair.decode.endpoint(),
        decode_instance: pair.info.instance_id.clone(),
        lease: lease.token,
        block_ids: lease.block_ids,
        kv_layout_hash: pair.info.kv_layout_hash.clone(),
        first_block: lease.cached_tokens / 16,
        ..KvDestination::default()
    }
}

/// An aggregated request on the pair's decode worker: its tokens and finish.
async fn aggregated(
    pair: &mut Pair,
    prompt: Vec<u32>,
    max_tokens: u32,
) -> (Vec<u32>, Option<Finished>) {
    let mut stream = pair
        .d
        .generate(request(prompt, Mode::Aggregated, max_tokens))
        .await
        .unwrap()
        .into_inner();
    tokens(&mut stream).await
}

/// A disaggregated request that must get a lease: its tokens, finish and prefill answer.
async fn disaggregated(
    pair: &mut Pair,
    prompt: Vec<u32>,
    transport: Transport,
    max_tokens: u32,
) -> (Vec<u32>, Finished, PrefillResponse) {
    let req = request(prompt, Mode::Disaggregated, max_tokens);
    let (first, toks, fin, prefill) = disaggregated_request(pair, req, transport).await;
    assert!(
        matches!(first, generate_event::Event::Lease(_)),
        "first event must be the lease"
    );
    (toks, fin, prefill.expect("a prefill answer"))
}

async fn used_blocks(d: &mut DecodeClient) -> u32 {
    let l = d
        .get_load(LoadRequest::default())
        .await
        .unwrap()
        .into_inner();
    l.total_blocks - l.free_blocks
}

async fn wait_blocks_free(d: &mut DecodeClient, within: Duration) -> Duration {
    let start = Instant::now();
    loop {
        if used_blocks(d).await == 0 {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < within,
            "blocks still in use after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_equals_aggregated_over_every_transport() {
    let mut pair = start_pair().await;
    assert!(pair.info.transports.contains(&(Transport::Shm as i32)));
    assert!(pair.info.tokenizer.is_some());
    for (i, len) in [1u32, 15, 16, 17, 64, 200].into_iter().enumerate() {
        let p = prompt(i as u32, len);
        let (want, fin) = aggregated(&mut pair, p.clone(), 12).await;
        assert_eq!(want.len(), 12);
        assert_eq!(fin.unwrap().kv_bytes, 0);
        for transport in [Transport::Grpc, Transport::Tcp, Transport::Shm] {
            let (got, fin, pre) = disaggregated(&mut pair, p.clone(), transport, 12).await;
            assert_eq!(got, want, "prompt of {len} over {transport:?}");
            assert_eq!(fin.transport, transport as i32);
            assert!(
                fin.kv_bytes > 0 && fin.kv_bytes == pre.kv_bytes,
                "{} vs {}",
                fin.kv_bytes,
                pre.kv_bytes
            );
            assert_eq!(pre.first_token, want[0]);
        }
    }
    wait_blocks_free(&mut pair.d, Duration::from_secs(2)).await;
}

/// A disaggregated request's first event and outcome: the lease (or the local prefill) the
/// decode worker answered with, the tokens, the finish, and the prefill's answer if any.
async fn disaggregated_request(
    pair: &mut Pair,
    req: GenerateRequest,
    transport: Transport,
) -> (
    generate_event::Event,
    Vec<u32>,
    Finished,
    Option<PrefillResponse>,
) {
    let prompt = req.prompt.clone();
    let mut stream = pair.d.generate(req).await.unwrap().into_inner();
    let first = stream.message().await.unwrap().unwrap().event.unwrap();
    let prefill = match &first {
        generate_event::Event::Lease(lease) => {
            let dest = destination(pair, lease.clone(), transport);
            Some(
                pair.p
                    .prefill(PrefillRequest {
                        stop: None,
                        request_id: "p".into(),
                        prompt,
                        sampling: Some(SamplingParams::default()),
                        destination: Some(dest),
                    })
                    .await
                    .unwrap()
                    .into_inner(),
            )
        }
        generate_event::Event::Local(_) => None,
        other => panic!("unexpected first event {other:?}"),
    };
    let (toks, fin) = tokens(&mut stream).await;
    (first, toks, fin.unwrap(), prefill)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_prefix_on_the_decode_worker_is_not_sent_again() {
    let mut pair = start_pair().await;
    let first_turn = prompt(9, 100);
    let (want, fin) = aggregated(&mut pair, first_turn.clone(), 12).await;
    assert_eq!(fin.unwrap().cached_tokens, 0);
    // The decode worker computed the prompt itself: 6 of its 7 blocks are cached there, so a
    // disaggregated run of it moves one block; the tokens are the same. The prefill worker
    // lacks those 6 blocks the first time: it reads them back from the decode worker
    // (PullKv) instead of computing them, and has them cached from then on.
    for (i, transport) in [Transport::Tcp, Transport::Shm, Transport::Grpc]
        .into_iter()
        .enumerate()
    {
        let (first, got, fin, pre) = disaggregated_request(
            &mut pair,
            request(first_turn.clone(), Mode::Disaggregated, 12),
            transport,
        )
        .await;
        let generate_event::Event::Lease(lease) = first else {
            panic!("no local prefill without local_prefill_below");
        };
        assert_eq!((lease.cached_tokens, lease.block_ids.len()), (96, 1));
        assert_eq!(got, want, "{transport:?}");
        let pre = pre.unwrap();
        let block_bytes = pre.kv_bytes;
        assert_eq!(fin.kv_bytes, block_bytes);
        assert!(block_bytes > 0);
        assert_eq!(pre.cached_tokens, 96, "{transport:?}");
        let pulled = if i == 0 { 6 } else { 0 };
        assert_eq!(
            (pre.pulled_tokens, pre.pulled_bytes),
            (pulled * 16, pulled as u64 * block_bytes),
            "{transport:?}"
        );
        eprintln!("{transport:?}: one block of {block_bytes} bytes moved instead of 7");
    }
    // The next turn: the first turn, its answer, and a new message. The decode worker holds
    // the first turn's blocks (and the answer's full ones): only the rest moves.
    let mut second_turn = first_turn.clone();
    second_turn.extend(&want);
    second_turn.extend(prompt(10, 40));
    let (want2, _) = aggregated(&mut pair, second_turn.clone(), 8).await;
    let mut req = request(second_turn.clone(), Mode::Disaggregated, 8);
    req.request_id = "turn-2".into();
    let (first, got, _, pre) = disaggregated_request(&mut pair, req, Transport::Tcp).await;
    let generate_event::Event::Lease(lease) = first else {
        panic!("expected a lease");
    };
    // The prefill worker held the first turn's 6 blocks and reads the rest of the prefix.
    let pre = pre.unwrap();
    assert_eq!(pre.cached_tokens, lease.cached_tokens);
    assert_eq!(pre.pulled_tokens, lease.cached_tokens - 96);
    let blocks = second_turn.len().div_ceil(16);
    assert_eq!(
        lease.cached_tokens as usize,
        (second_turn.len() - 1) / 16 * 16,
        "the aggregated run cached every full block"
    );
    assert_eq!(
        lease.block_ids.len(),
        blocks - lease.cached_tokens as usize / 16
    );
    assert_eq!(got, want2);

    // Below local_prefill_below uncached tokens, the decode worker runs the suffix itself.
    let mut req = request(first_turn.clone(), Mode::Disaggregated, 12);
    req.local_prefill_below = 8;
    let (first, got, fin, pre) = disaggregated_request(&mut pair, req, Transport::Tcp).await;
    assert_eq!(
        first,
        generate_event::Event::Local(LocalPrefill { cached_tokens: 96 })
    );
    assert!(pre.is_none());
    assert_eq!(got, want);
    assert_eq!((fin.kv_bytes, fin.cached_tokens), (0, 96));
    // ... and above it, the suffix is prefilled elsewhere as usual.
    let mut req = request(first_turn.clone(), Mode::Disaggregated, 12);
    req.local_prefill_below = 4;
    let (first, got, _, _) = disaggregated_request(&mut pair, req, Transport::Tcp).await;
    assert!(matches!(first, generate_event::Event::Lease(_)));
    assert_eq!(got, want);
    wait_blocks_free(&mut pair.d, Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_told_not_to_pull_computes_the_prefix_it_lacks() {
    let mut pair = start_pair_each(&[], &["--no-prefix-pull"]).await;
    let p = prompt(12, 100);
    let (want, _) = aggregated(&mut pair, p.clone(), 6).await;
    let (got, _, pre) = disaggregated(&mut pair, p.clone(), Transport::Tcp, 6).await;
    assert_eq!(got, want);
    assert_eq!(
        (pre.cached_tokens, pre.pulled_tokens, pre.pulled_bytes),
        (0, 0, 0),
        "computed, not read back"
    );
    // It cached what it computed: the next run finds it there.
    let (got, _, pre) = disaggregated(&mut pair, p, Transport::Tcp, 6).await;
    assert_eq!(got, want);
    assert_eq!((pre.cached_tokens, pre.pulled_tokens), (96, 0));
    wait_blocks_free(&mut pair.d, Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_received_from_a_prefill_worker_serves_the_next_request() {
    let mut pair = start_pair().await;
    let p = prompt(11, 70);
    let (first, want, _, pre) = disaggregated_request(
        &mut pair,
        request(p.clone(), Mode::Disaggregated, 6),
        Transport::Shm,
    )
    .await;
    let generate_event::Event::Lease(lease) = first else {
        panic!("expected a lease");
    };
    assert_eq!((lease.cached_tokens, lease.block_ids.len()), (0, 5));
    let all_bytes = pre.unwrap().kv_bytes;
    // The received blocks were cached on the decode worker: the same prompt moves one block.
    let (first, got, _, pre) = disaggregated_request(
        &mut pair,
        request(p.clone(), Mode::Disaggregated, 6),
        Transport::Shm,
    )
    .await;
    let generate_event::Event::Lease(lease) = first else {
        panic!("expected a lease");
    };
    assert_eq!(lease.cached_tokens, 64);
    assert_eq!(got, want);
    let pre = pre.unwrap();
    assert_eq!(pre.kv_bytes * 5, all_bytes, "one block of five");
    assert_eq!(pre.cached_tokens, 64, "the prefill worker's own cache hit");
    // The load report lists the blocks by name for a router that asks.
    let report = pair
        .d
        .get_load(LoadRequest {
            block_events_after: Some(u64::MAX),
            ..LoadRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    let events = report.block_events.expect("block events");
    assert!(events.snapshot);
    assert!(
        events.stored.len() >= 4 * 16,
        "{} bytes",
        events.stored.len()
    );
    let none = pair
        .d
        .get_load(LoadRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(none.block_events.is_none());
    wait_blocks_free(&mut pair.d, Duration::from_secs(2)).await;
}

/// The router's elastic thread planner rides on GetLoad: the count reaches the engine (the
/// report says so), is clamped to the team, 0 keeps it, and tokens do not depend on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_planned_compute_threads_reach_the_engine() {
    let mut pair = start_pair_with(&["--threads", "2"]).await;
    let load = |n: u32| LoadRequest {
        compute_threads: n,
        ..LoadRequest::default()
    };
    let report = pair.d.get_load(load(0)).await.unwrap().into_inner();
    assert_eq!((report.compute_threads, report.max_compute_threads), (2, 2));
    let p = prompt(5, 90);
    let (want, _) = aggregated(&mut pair, p.clone(), 8).await;
    let report = pair.d.get_load(load(1)).await.unwrap().into_inner();
    assert_eq!((report.compute_threads, report.max_compute_threads), (1, 2));
    let (got, _) = aggregated(&mut pair, p.clone(), 8).await;
    assert_eq!(got, want, "one thread or two, the same tokens");
    let report = pair.d.get_load(load(0)).await.unwrap().into_inner();
    assert_eq!(report.compute_threads, 1, "0 keeps the count");
    let report = pair.d.get_load(load(64)).await.unwrap().into_inner();
    assert_eq!(report.compute_threads, 2, "clamped to the team");
    let report = pair.p.get_load(load(1)).await.unwrap().into_inner();
    assert_eq!((report.compute_threads, report.max_compute_threads), (1, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_and_expired_leases_return_their_blocks() {
    let mut pair = start_pair().await;
    assert_eq!(used_blocks(&mut pair.d).await, 0);
    // A reservation whose stream is dropped before any KV arrives.
    let mut stream = pair
        .d
        .generate(request(prompt(1, 100), Mode::Disaggregated, 8))
        .await
        .unwrap()
        .into_inner();
    let _lease = stream.message().await.unwrap().unwrap();
    assert!(used_blocks(&mut pair.d).await > 0);
    drop(stream);
    let took = wait_blocks_free(&mut pair.d, Duration::from_secs(1)).await;
    eprintln!("cancelled reservation freed in {took:?}");

    // A lease that expires: no prefill ever comes.
    let mut req = request(prompt(2, 50), Mode::Disaggregated, 8);
    req.lease_ttl_ms = 300;
    let mut stream = pair.d.generate(req).await.unwrap().into_inner();
    let _lease = stream.message().await.unwrap().unwrap();
    let err = stream.message().await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err}");
    wait_blocks_free(&mut pair.d, Duration::from_secs(1)).await;

    // A running aggregated request cancelled mid-stream.
    let mut stream = pair
        .d
        .generate(request(prompt(3, 30), Mode::Aggregated, 2000))
        .await
        .unwrap()
        .into_inner();
    for _ in 0..3 {
        stream.message().await.unwrap().unwrap();
    }
    drop(stream);
    let took = wait_blocks_free(&mut pair.d, Duration::from_secs(1)).await;
    eprintln!("cancelled stream freed in {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_precise_codes() {
    let mut pair = start_pair().await;
    let cases = [
        (
            request(vec![], Mode::Aggregated, 4),
            tonic::Code::InvalidArgument,
        ),
        (
            request(vec![3, 9999], Mode::Aggregated, 4),
            tonic::Code::InvalidArgument,
        ),
        (
            request(vec![3; 10], Mode::Aggregated, 0),
            tonic::Code::InvalidArgument,
        ),
        (
            request(vec![3; 40_000], Mode::Disaggregated, 4_000),
            tonic::Code::InvalidArgument,
        ),
    ];
    for (req, code) in cases {
        let err = pair.d.generate(req).await.unwrap_err();
        assert_eq!(err.code(), code, "{err}");
    }
    // A destination with another layout is refused by the prefill worker.
    let err = pair
        .p
        .prefill(PrefillRequest {
            stop: None,
            request_id: "x".into(),
            prompt: vec![3, 4],
            sampling: None,
            destination: Some(KvDestination {
                transport: Transport::Tcp as i32,
                kv_layout_hash: "not-this-one".into(),
                block_ids: vec![0],
                ..Default::default()
            }),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
    assert_eq!(used_blocks(&mut pair.d).await, 0);
}

/// CPU workers advertise no device transport, refuse to open an NCCL link, and a prefill
/// asked to send over one fails at once with the reason; the reservation is returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_transports_are_refused_by_cpu_workers() {
    let mut pair = start_pair().await;
    for t in [Transport::CudaIpc, Transport::Nccl] {
        assert!(!pair.info.transports.contains(&(t as i32)), "{t:?}");
    }
    let refused = pair
        .d
        .open_nccl(OpenNcclRequest {
            prefill_id: "p".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    assert!(refused.message().contains("runs on the CPU"), "{refused:?}");

    for transport in [Transport::CudaIpc, Transport::Nccl] {
        let p = prompt(1, 40);
        let mut stream = pair
            .d
            .generate(request(p.clone(), Mode::Disaggregated, 4))
            .await
            .unwrap()
            .into_inner();
        let Some(generate_event::Event::Lease(lease)) =
            stream.message().await.unwrap().unwrap().event
        else {
            panic!("first event must be the lease");
        };
        let dest = KvDestination {
            transport: transport as i32,
            decode_endpoint: pair.decode.endpoint(),
            lease: lease.token,
            block_ids: lease.block_ids,
            kv_layout_hash: pair.info.kv_layout_hash.clone(),
            ..Default::default()
        };
        let err = pair
            .p
            .prefill(PrefillRequest {
                stop: None,
                request_id: "p".into(),
                prompt: p,
                sampling: Some(SamplingParams::default()),
                destination: Some(dest),
            })
            .await
            .unwrap_err();
        let why = err.message().to_lowercase();
        assert!(
            why.contains("cuda") || why.contains("nccl") || why.contains("device"),
            "{transport:?}: {err:?}"
        );
        drop(stream);
        wait_blocks_free(&mut pair.d, Duration::from_secs(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_precision_kv_crosses_every_transport_at_half_the_bytes() {
    // Without prefix caching, so that every run moves the whole prompt.
    let mut full = start_pair_with(&["--no-prefix-caching"]).await;
    let mut half = start_pair_with(&["--kv-dtype", "bf16", "--no-prefix-caching"]).await;
    assert_ne!(full.info.kv_layout_hash, half.info.kv_layout_hash);
    let p = prompt(3, 40);
    let (_, f32_fin, _) = disaggregated(&mut full, p.clone(), Transport::Tcp, 8).await;
    let (want, _) = aggregated(&mut half, p.clone(), 8).await;
    for transport in [Transport::Grpc, Transport::Tcp, Transport::Shm] {
        let (got, fin, _) = disaggregated(&mut half, p.clone(), transport, 8).await;
        assert_eq!(got, want, "bf16 KV over {transport:?}");
        assert_eq!(2 * fin.kv_bytes, f32_fin.kv_bytes, "{transport:?}");
    }
    wait_blocks_free(&mut half.d, Duration::from_secs(2)).await;
}

/// A prefill worker whose KV layout differs (another KV dtype; another model: here the tiny
/// model with a sliding window, which the layout hash covers as it covers families) is
/// refused by the decode worker's lease before any byte moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_with_different_kv_layouts_refuse_each_other() {
    let mut pair = start_pair().await;
    let f16: Vec<&str> = COMMON
        .iter()
        .chain(&["--kv-dtype", "f16"])
        .copied()
        .collect();
    let windowed = [
        "--model",
        "dummy:tiny-window",
        "--kv-budget-mb",
        "16",
        "--threads",
        "1",
    ];
    for args in [&f16[..], &windowed[..]] {
        let other = Proc::start("tandem-prefill", args).unwrap();
        let (mut other_client, other_info) =
            prefill_client(&other.endpoint(), Duration::from_secs(60))
                .await
                .unwrap();
        assert_ne!(
            other_info.kv_layout_hash, pair.info.kv_layout_hash,
            "{args:?}"
        );
        let p = prompt(4, 20);
        let mut stream = pair
            .d
            .generate(request(p.clone(), Mode::Disaggregated, 4))
            .await
            .unwrap()
            .into_inner();
        let Some(generate_event::Event::Lease(lease)) =
            stream.message().await.unwrap().unwrap().event
        else {
            panic!("first event must be the lease");
        };
        let err = other_client
            .prefill(PrefillRequest {
                stop: None,
                request_id: "mixed".into(),
                prompt: p,
                sampling: Some(SamplingParams::default()),
                destination: Some(destination(&pair, lease, Transport::Tcp)),
            })
            .await
            .unwrap_err();
        assert!(err.message().contains("layout"), "{args:?}: {err:?}");
        drop(stream);
        wait_blocks_free(&mut pair.d, Duration::from_secs(5)).await;
    }
}
