//! KV transfer benchmark (issue 3), in one run:
//! 1. memory-copy rate (the floor: one copy of the KV bytes),
//! 2. throughput of each transport moving a 2048-token SmolLM2 prompt's KV (94 MB, 30 layers
//!    sent layer by layer as the engine does) into a decode-side lease table, as deployed
//!    (authenticated) and, interleaved, without credentials: the cost of authentication,
//! 3. TTFT of a 2048-token prompt through the router, disaggregated vs aggregated, at low load,
//! 4. the router's added latency: time to first token through router + decode worker vs the
//!    decode worker alone over gRPC.
//!
//! Run by `scripts/bench-transfer`, which builds the release binaries first. Prints a table,
//! then one JSON line. Flags: `--transports-only` (1-2 only); `--model M` (the model of 3-4,
//! default `smollm2`), `--tokens N` (the prompt's length, default 2048) and `--repeats N`
//! (transfers per transport, default 5), which the smoke run (`SMOKE=1`) sets to `tiny`, 256
//! and 2 so that it runs in seconds on debug builds. Everything runs as a deployment does: calls carry call tokens, the
//! decode side proves the secret before the first transfer, TCP transfers answer the
//! listener's challenge.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use tandem_auth::InternalAuth;
use tandem_e2e::{DecodeClient, Proc, decode_client, prefill_client, test_auth, wait_http_ok};
use tandem_kv::shm::{OwnerTags, POOL_PREFIX, file_identity, tags_path};
use tandem_kv::{KvCache, KvDtype, KvLayout, KvStorage};
use tandem_proto::v1::decode_service_server::DecodeServiceServer;
use tandem_proto::v1::*;
use tandem_transfer::{
    FirstToken, KvOnlyDecode, KvSender, LeaseTable, Peers, TcpLimits, connect, serve_tcp,
};
use tokio::net::TcpListener;

/// KV transfer rates, TTFT disaggregated and aggregated, and the latency the router adds.
#[derive(clap::Parser)]
struct Opts {
    /// The model the real binaries serve in 3-4.
    #[arg(long, default_value = "smollm2")]
    model: String,
    /// The prompt's length in tokens (a multiple of the 16-token block, at least 64).
    #[arg(long, default_value_t = 2048, value_parser = prompt_tokens)]
    tokens: usize,
    /// Best of how many runs, for each rate.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u16).range(1..))]
    repeats: u16,
    /// Measure 1-2 only (the copy floor and the transports).
    #[arg(long)]
    transports_only: bool,
}

/// A prompt length whole blocks fill: a multiple of 16, 64 to 65536 tokens.
fn prompt_tokens(text: &str) -> Result<usize, String> {
    let tokens: usize = text.parse().map_err(|e| format!("{e}"))?;
    if (64..=65536).contains(&tokens) && tokens.is_multiple_of(16) {
        Ok(tokens)
    } else {
        Err("a multiple of 16, from 64 to 65536".into())
    }
}

fn smollm2_layout() -> KvLayout {
    KvLayout {
        num_layers: 30,
        num_kv_heads: 3,
        head_dim: 64,
        block_size: 16,
        dtype: KvDtype::F32,
        model_fingerprint: "transfer-bench".into(),
    }
}

/// Best-of-N rate of copying `bytes` bytes between two buffers (bytes copied per second).
fn memcpy_rate(bytes: usize, repeats: usize) -> f64 {
    let src = vec![7u8; bytes];
    let mut dst = vec![0u8; bytes];
    let mut best = f64::MAX;
    for _ in 0..repeats {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        best = best.min(t.elapsed().as_secs_f64());
        std::hint::black_box(&dst);
    }
    bytes as f64 / best
}

/// Raw loopback TCP: one blocking stream, 4 MiB reads; the ceiling for the tcp transport.
fn loopback_tcp_rate(bytes: usize, repeats: usize) -> anyhow::Result<f64> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let reader = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        let mut buf = vec![0u8; 4 << 20];
        for _ in 0..repeats {
            let mut got = 0;
            while got < bytes {
                got += s.read(&mut buf)?;
            }
            s.write_all(&[1])?;
        }
        Ok(())
    });
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let data = vec![7u8; bytes];
    let mut best = f64::MAX;
    for _ in 0..repeats {
        let t = Instant::now();
        s.write_all(&data)?;
        let mut ack = [0u8];
        s.read_exact(&mut ack)?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    reader
        .join()
        .map_err(|_| anyhow::anyhow!("reader thread panicked"))??;
    Ok(bytes as f64 / best)
}

struct Sink {
    table: Arc<LeaseTable>,
    endpoint: String,
    /// The folder of its shared pool, and the pool.
    dir: std::path::PathBuf,
    shm_path: std::path::PathBuf,
    _cache: KvCache,
}

/// A decode side that only receives KV, with `auth`'s credentials (`name` keeps two sinks'
/// pool files apart).
async fn sink(
    layout: &KvLayout,
    blocks: usize,
    auth: InternalAuth,
    name: &str,
) -> anyhow::Result<Sink> {
    let dir = std::path::Path::new("/dev/shm");
    let dir = if dir.is_dir() {
        dir.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    let path = dir.join(format!(
        "{POOL_PREFIX}transfer-bench-{name}-{}",
        std::process::id()
    ));
    let bytes = blocks * layout.block_bytes();
    let cache = KvCache::new(
        layout.clone(),
        blocks,
        KvStorage::create_shared(&path, bytes)?,
    )?;
    let tags = OwnerTags::create(&tags_path(&path), blocks)?;
    let table = Arc::new(LeaseTable::new(
        cache.block_writer(),
        layout.hash(),
        Some(tags),
    ));
    let grpc = TcpListener::bind("127.0.0.1:0").await?;
    let endpoint = format!("http://{}", grpc.local_addr()?);
    let kv = TcpListener::bind("127.0.0.1:0").await?;
    let (shm_device, shm_inode) = file_identity(&path)?;
    let info = WorkerInfo {
        worker_id: "transfer-bench".into(),
        role: Role::Decode as i32,
        kv_layout_hash: layout.hash(),
        shm_path: path.to_string_lossy().into(),
        shm_bytes: bytes as u64,
        shm_device,
        shm_inode,
        kv_tcp_port: u32::from(kv.local_addr()?.port()),
        total_blocks: blocks as u32,
        protocol_version: tandem_proto::PROTOCOL_VERSION,
        instance_id: vec![7; 16],
        ..WorkerInfo::default()
    };
    let svc = DecodeServiceServer::new(KvOnlyDecode {
        table: table.clone(),
        info,
        auth: auth.clone(),
    })
    .max_decoding_message_size(4 << 20);
    tokio::spawn(
        auth.server_builder()?
            .initial_stream_window_size(tandem_transfer::GRPC_STREAM_WINDOW)
            .initial_connection_window_size(tandem_transfer::GRPC_CONNECTION_WINDOW)
            .add_service(svc)
            .serve_with_incoming(
                tonic::transport::server::TcpIncoming::from(grpc).with_nodelay(Some(true)),
            ),
    );
    tokio::spawn(serve_tcp(
        kv,
        table.clone(),
        auth,
        TcpLimits::default(),
        std::future::pending(),
    ));
    Ok(Sink {
        table,
        endpoint,
        dir,
        shm_path: path,
        _cache: cache,
    })
}

/// Moves one `tokens`-token prompt's KV over `transport`; returns (bytes, seconds from the
/// first layer handed over to the commit's acknowledgement).
async fn transfer_once(
    sink: &Sink,
    source: &Arc<KvCache>,
    transport: Transport,
    peers: &Peers,
    tokens: usize,
) -> anyhow::Result<(u64, f64)> {
    let layout = source.layout().clone();
    let nblocks = tokens / layout.block_size;
    let blocks: Vec<u32> = (0..nblocks as u32).collect();
    let (lease, done) = sink.table.create(blocks.clone(), tokens, "bench")?;
    let dest = KvDestination {
        transport: transport as i32,
        decode_endpoint: sink.endpoint.clone(),
        lease: lease.token().as_bytes().to_vec(),
        block_ids: blocks,
        kv_layout_hash: layout.hash(),
        ..KvDestination::default()
    };
    let sender = connect(peers, &dest, &layout, "bench", tokens, 0).await?;
    let source = source.clone();
    let started = Instant::now();
    let sender: Box<dyn KvSender> =
        tokio::task::spawn_blocking(move || -> anyhow::Result<Box<dyn KvSender>> {
            let mut sender = sender;
            for layer in 0..layout.num_layers {
                let pieces: Vec<(u32, &[u8])> = (0..nblocks as u32)
                    .map(|b| source.block_layer_bytes(layer, b).map(|bytes| (b, bytes)))
                    .collect::<Result<_, _>>()?;
                sender.send_layer(layer, &pieces)?;
            }
            Ok(sender)
        })
        .await??;
    let stats = sender.commit(FirstToken::new(1, 0.0)).await?;
    let secs = started.elapsed().as_secs_f64();
    done.await?.map_err(|e| anyhow::anyhow!(e))?;
    Ok((stats.bytes, secs))
}

/// Time to the first streamed token of a completion through the router.
async fn router_ttft(client: &reqwest::Client, url: &str, prompt: &[u32]) -> anyhow::Result<f64> {
    let body = serde_json::json!({"prompt": prompt, "max_tokens": 2, "stream": true, "temperature": 0.0, "ignore_eos": true});
    let t = Instant::now();
    let resp = client.post(url).json(&body).send().await?;
    anyhow::ensure!(
        resp.status().is_success(),
        "router answered {}",
        resp.status()
    );
    let mut stream = resp.bytes_stream();
    let mut first = None;
    while let Some(chunk) = stream.next().await {
        if first.is_none() && String::from_utf8_lossy(&chunk?).contains("\"text\"") {
            first = Some(t.elapsed().as_secs_f64());
        }
    }
    // Read to the end so the next measurement starts on an idle worker.
    first.ok_or_else(|| anyhow::anyhow!("no token in the stream"))
}

/// Time to the first token of `prompt` through a router (`url`) and straight from its
/// decode worker over gRPC, `n` times each, interleaved.
async fn router_overhead(
    client: &reqwest::Client,
    url: &str,
    dclient: &mut DecodeClient,
    prompt: &[u32],
    n: usize,
) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    let mut via_router = Vec::new();
    let mut direct = Vec::new();
    for _ in 0..n {
        via_router.push(router_ttft(client, url, prompt).await?);
        let t = Instant::now();
        let mut stream = dclient
            .generate(GenerateRequest {
                request_id: "bench".into(),
                prompt: prompt.to_vec(),
                sampling: Some(SamplingParams::default()),
                stop: Some(StopParams {
                    max_tokens: 2,
                    ignore_eos: true,
                    ..Default::default()
                }),
                mode: Mode::Aggregated as i32,
                lease_ttl_ms: 0,
                local_prefill_below: 0,
                tpot_target_ms: 0,
                split_prompt_at: 0,
            })
            .await?
            .into_inner();
        while let Some(ev) = stream.message().await? {
            if matches!(ev.event, Some(generate_event::Event::Token(_))) {
                direct.push(t.elapsed().as_secs_f64());
                break;
            }
        }
        while stream.message().await?.is_some() {}
    }
    Ok((via_router, direct))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let opts: Opts = clap::Parser::parse();
    let (tokens, repeats) = (opts.tokens, usize::from(opts.repeats));
    // 1-2: transports in process.
    let layout = smollm2_layout();
    let nblocks = tokens / layout.block_size;
    let kv_bytes = nblocks * layout.block_bytes();
    let memcpy = memcpy_rate(kv_bytes, repeats);
    let loopback = loopback_tcp_rate(kv_bytes, repeats)?;
    let mut source = KvCache::with_budget(layout.clone(), kv_bytes)?;
    for layer in 0..layout.num_layers {
        for b in 0..nblocks as u32 {
            let fill: Vec<u8> = (0..layout.block_layer_bytes())
                .map(|i| ((i + layer + b as usize) % 251) as u8)
                .collect();
            source.write_block_layer_bytes(layer, b, &fill)?;
        }
    }
    let source = Arc::new(source);
    // As deployed (calls signed, the decode side proven, TCP hellos answered), and the same
    // transfers without credentials, interleaved: the cost of authentication alone.
    let sink_auth = sink(&layout, nblocks, test_auth(), "auth").await?;
    let sink_open = sink(&layout, nblocks, InternalAuth::none(), "open").await?;
    let peers_auth = Peers::new(test_auth(), Some(sink_auth.dir.clone()));
    let peers_open = Peers::new(InternalAuth::none(), Some(sink_open.dir.clone()));
    let mut rates = Vec::new();
    let mut auth_cost = Vec::new();
    for transport in [Transport::Shm, Transport::Tcp, Transport::Grpc] {
        let (mut best, mut best_open) = (f64::MAX, f64::MAX);
        let mut bytes = 0;
        for _ in 0..repeats {
            let (b, s) = transfer_once(&sink_auth, &source, transport, &peers_auth, tokens).await?;
            bytes = b;
            best = best.min(s);
            let (_, s) = transfer_once(&sink_open, &source, transport, &peers_open, tokens).await?;
            best_open = best_open.min(s);
        }
        rates.push((transport, bytes, best, bytes as f64 / best));
        // Throughput with authentication ÷ without.
        auth_cost.push((transport, best_open / best));
    }
    let rate = |t: Transport| rates.iter().find(|r| r.0 == t).map_or(0.0, |r| r.3);
    let authenticated = |t: Transport| auth_cost.iter().find(|r| r.0 == t).map_or(0.0, |r| r.1);
    if opts.transports_only {
        for (t, bytes, secs, r) in &rates {
            println!(
                "{}: {:.1} ms for {bytes} bytes, {:.2} GB/s ({:.2} of memcpy; {:.3} of the \
                 same without authentication)",
                tandem_transfer::transport_name(*t),
                secs * 1e3,
                r / 1e9,
                r / memcpy,
                authenticated(*t)
            );
        }
        return Ok(());
    }

    // 3-4: the real binaries on SmolLM2 (or --model).
    let model_args = ["--model", opts.model.as_str(), "--kv-budget-mb", "512"];
    let decode = Proc::start("tandem-decode", &model_args)?;
    let prefill = Proc::start("tandem-prefill", &model_args)?;
    let (mut dclient, _) = decode_client(&decode.endpoint(), Duration::from_secs(300)).await?;
    prefill_client(&prefill.endpoint(), Duration::from_secs(300)).await?;
    let workers = [
        "--prefill",
        &prefill.endpoint(),
        "--decode",
        &decode.endpoint(),
        "--transport",
        "shm",
    ];
    let disagg = Proc::start("tandem-router", &workers)?;
    let mut agg_args = workers.to_vec();
    agg_args.extend(["--agg-threshold", "1000000"]);
    let agg = Proc::start("tandem-router", &agg_args)?;
    let client = reqwest::Client::new();
    for r in [&disagg, &agg] {
        wait_http_ok(
            &format!("http://127.0.0.1:{}/health", r.port),
            Duration::from_secs(120),
        )
        .await?;
    }
    // Token ids inside SmolLM2's vocabulary, or inside any of 203 ids or more (the tiny
    // model's 259) for another model.
    let (first_id, ids) = if opts.model == "smollm2" {
        (100, 40_000)
    } else {
        (3, 200)
    };
    let long: Vec<u32> = (0..tokens as u32)
        .map(|i| first_id + (i * 7919) % ids)
        .collect();
    let url = |p: &Proc| format!("http://127.0.0.1:{}/v1/completions", p.port);
    router_ttft(&client, &url(&disagg), &long[..64]).await?; // warm-up
    let mut ttft_disagg = Vec::new();
    let mut ttft_agg = Vec::new();
    for _ in 0..3 {
        ttft_disagg.push(router_ttft(&client, &url(&disagg), &long).await?);
        ttft_agg.push(router_ttft(&client, &url(&agg), &long).await?);
    }
    let (td, ta) = (median(ttft_disagg), median(ttft_agg));

    // Router overhead: a short aggregated request via the router vs straight to the worker,
    // on SmolLM2 (or --model; realistic, but the forward pass's noise is in both) and on the tiny model
    // (forward pass ~1 ms, so the difference is the router's path).
    let short: Vec<u32> = long[..16].to_vec();
    let (via_router, direct) =
        router_overhead(&client, &url(&agg), &mut dclient, &short, 40).await?;
    drop((disagg, agg, prefill, decode));
    let tiny_decode = Proc::start(
        "tandem-decode",
        &["--model", "tiny", "--kv-budget-mb", "16"],
    )?;
    let (mut tiny_client, _) =
        decode_client(&tiny_decode.endpoint(), Duration::from_secs(60)).await?;
    let tiny_router = Proc::start("tandem-router", &["--decode", &tiny_decode.endpoint()])?;
    wait_http_ok(
        &format!("http://127.0.0.1:{}/health", tiny_router.port),
        Duration::from_secs(60),
    )
    .await?;
    let tiny_prompt: Vec<u32> = (3..19).collect();
    let (tiny_via, tiny_direct) = router_overhead(
        &client,
        &url(&tiny_router),
        &mut tiny_client,
        &tiny_prompt,
        100,
    )
    .await?;
    let (tv, td_) = (median(tiny_via), median(tiny_direct));
    let (vr, di) = (median(via_router), median(direct));

    println!("| measure | value |");
    println!("|---|---|");
    println!(
        "| memcpy of {:.1} MB | {:.2} GB/s |",
        kv_bytes as f64 / 1e6,
        memcpy / 1e9
    );
    println!(
        "| raw loopback TCP, one stream | {:.2} GB/s ({:.2} of memcpy) |",
        loopback / 1e9,
        loopback / memcpy
    );
    for (t, bytes, secs, r) in &rates {
        println!(
            "| {} transfer of a {tokens}-token SmolLM2 prompt ({:.1} MB) | {:.1} ms, {:.2} GB/s ({:.2} of memcpy; {:.3} of the same without authentication) |",
            tandem_transfer::transport_name(*t),
            *bytes as f64 / 1e6,
            secs * 1e3,
            r / 1e9,
            r / memcpy,
            authenticated(*t)
        );
    }
    println!(
        "| TTFT, {tokens}-token prompt, disaggregated (shm) | {:.0} ms |",
        td * 1e3
    );
    println!(
        "| TTFT, {tokens}-token prompt, aggregated | {:.0} ms |",
        ta * 1e3
    );
    println!(
        "| first token of a 16-token prompt: router + decode worker | {:.2} ms |",
        vr * 1e3
    );
    println!(
        "| first token of a 16-token prompt: decode worker over gRPC | {:.2} ms |",
        di * 1e3
    );
    println!(
        "| same on the tiny model: router + decode worker | {:.2} ms |",
        tv * 1e3
    );
    println!(
        "| same on the tiny model: decode worker over gRPC | {:.2} ms |",
        td_ * 1e3
    );
    let json = serde_json::json!({
        "kv_bytes": kv_bytes,
        "memcpy_gb_s": memcpy / 1e9,
        "loopback_tcp_gb_s": loopback / 1e9,
        "tcp_vs_loopback": rate(Transport::Tcp) / loopback,
        "shm_gb_s": rate(Transport::Shm) / 1e9,
        "tcp_gb_s": rate(Transport::Tcp) / 1e9,
        "grpc_gb_s": rate(Transport::Grpc) / 1e9,
        "shm_vs_memcpy": rate(Transport::Shm) / memcpy,
        "tcp_vs_memcpy": rate(Transport::Tcp) / memcpy,
        "grpc_vs_memcpy": rate(Transport::Grpc) / memcpy,
        "shm_auth_vs_open": authenticated(Transport::Shm),
        "tcp_auth_vs_open": authenticated(Transport::Tcp),
        "grpc_auth_vs_open": authenticated(Transport::Grpc),
        "ttft_disagg_ms": td * 1e3,
        "ttft_agg_ms": ta * 1e3,
        "ttft_disagg_vs_agg": td / ta,
        "router_added_ms": (tv - td_) * 1e3,
        "router_added_ms_smollm2": (vr - di) * 1e3,
    });
    println!("{json}");
    drop((tiny_router, tiny_decode));
    for sink in [&sink_auth, &sink_open] {
        let _ = std::fs::remove_file(&sink.shm_path);
        let _ = std::fs::remove_file(tags_path(&sink.shm_path));
    }
    Ok(())
}
