//! The attack matrix: what strangers and members can do to the internal plane (gRPC
//! without or with a wrong secret, guessed lease capabilities while victims run, KV sent
//! toward a byte sink, oversized KV frame headers, shared-memory file modes, an endless
//! lease) and to the public plane (slowloris heads and bodies). Each attack is one row:
//! what was tried, what was expected, what happened, and whether every condition held.

use std::collections::BTreeSet;
use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tandem_auth::{InternalAuth, Secret};
use tandem_e2e::rss_kib;
use tandem_proto::v1::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::client::{Call, Outcome, REQUEST_TIMEOUT, Rng, prompt_text, token_prompt};
use crate::deployment::{
    Deployment, HTTP_TIMEOUT_MS, KV_HELLO_TIMEOUT_MS, MAX_LEASE_TTL_MS, random_secret, within,
};
use crate::report::{listed, parenthesized, secs};

/// One attack row.
pub struct Attack {
    pub what: String,
    pub expected: String,
    pub result: String,
    pub tried: usize,
    pub refused: usize,
    /// Every side condition held (no block reserved, victims intact, memory bounded, ...).
    pub ok: bool,
}

impl Attack {
    pub fn passed(&self) -> bool {
        self.ok && self.refused == self.tried
    }
}

/// Every attack, in the order of the table.
pub async fn run(dep: &Deployment) -> anyhow::Result<Vec<Attack>> {
    let mut attacks = vec![
        strangers(dep).await?,
        guessed_capabilities(dep).await?,
        prefill_to_sink(dep).await?,
        kv_port(dep).await?,
        shm_modes(dep).await?,
    ];
    let (heads, bodies) = slow_http(dep).await?;
    attacks.extend([heads, bodies, endless_lease(dep).await?]);
    Ok(attacks)
}

fn random_token() -> anyhow::Result<Vec<u8>> {
    Ok(tandem_auth::random_bytes::<16>()?.to_vec())
}

/// A disaggregated Generate asking the decode worker to hold its blocks forever.
fn endless_generate(request_id: &str, prompt_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        request_id: request_id.into(),
        prompt: token_prompt(prompt_tokens),
        sampling: Some(SamplingParams::default()),
        stop: Some(StopParams {
            max_tokens: 4,
            ignore_eos: true,
            ..Default::default()
        }),
        mode: Mode::Disaggregated as i32,
        lease_ttl_ms: u32::MAX,
        local_prefill_below: 0,
        tpot_target_ms: 0,
        split_prompt_at: 0,
    }
}

/// A stranger's call to `rpc`, and whether it was refused as unauthenticated.
async fn unauthenticated<T>(
    rpc: &'static str,
    call: impl Future<Output = Result<T, tonic::Status>>,
) -> anyhow::Result<(&'static str, bool)> {
    let answer = within(10, rpc, call).await?;
    Ok((
        rpc,
        matches!(answer, Err(s) if s.code() == tonic::Code::Unauthenticated),
    ))
}

async fn strangers(dep: &Deployment) -> anyhow::Result<Attack> {
    let wrong = InternalAuth::with_secret(&Secret::new(&random_secret()?)?);
    let mut tried = 0;
    let mut served = Vec::new();
    for (who, auth) in [("no secret", InternalAuth::none()), ("wrong secret", wrong)] {
        let mut d = dep.decode_as(&auth).await?;
        let mut p = dep.prefill_as(&auth).await?;
        let lease = random_token()?;
        let header = KvMessage {
            msg: Some(kv_message::Msg::Header(KvHeader {
                lease: lease.clone(),
                ..Default::default()
            })),
        };
        let commit = KvCommit {
            lease: lease.clone(),
            first_token: 42,
            ..Default::default()
        };
        let prefill = PrefillRequest {
            stop: None,
            request_id: "stranger".into(),
            prompt: vec![5; 10],
            ..Default::default()
        };
        let answers = [
            unauthenticated("Generate", d.generate(endless_generate("stranger", 16_000))).await?,
            unauthenticated("GetInfo", d.get_info(InfoRequest::default())).await?,
            unauthenticated("GetLoad", d.get_load(LoadRequest::default())).await?,
            unauthenticated("PushKv", d.push_kv(futures::stream::iter([header]))).await?,
            unauthenticated("CommitKv", d.commit_kv(commit)).await?,
            unauthenticated("RenewLease", d.renew_lease(RenewLeaseRequest { lease })).await?,
            unauthenticated("Prefill", p.prefill(prefill)).await?,
            unauthenticated("prefill GetInfo", p.get_info(InfoRequest::default())).await?,
            unauthenticated("prefill GetLoad", p.get_load(LoadRequest::default())).await?,
        ];
        tried += answers.len();
        served.extend(
            answers
                .iter()
                .filter(|(_, refused)| !refused)
                .map(|(rpc, _)| format!("{rpc} ({who})")),
        );
    }
    let refused = tried - served.len();
    let (_, used) = dep.wait_idle(Duration::from_millis(500)).await;
    Ok(Attack {
        what: "every internal RPC with no secret and with a wrong one, both workers (Generate: 16 000-token prompt, lease_ttl u32::MAX)".into(),
        expected: "UNAUTHENTICATED; no block reserved".into(),
        result: format!(
            "{refused}/{tried} UNAUTHENTICATED; blocks in use (prefill, decode) {used:?}{}",
            listed("; NOT refused: ", &served, ", ")
        ),
        tried,
        refused,
        ok: served.is_empty() && used == (0, 0),
    })
}

/// A member (holding the secret) guessing lease capabilities: 50 commits and 50 pushes,
/// each naming a random lease and everything else right.
async fn guess_capabilities(
    mut insider: tandem_e2e::DecodeClient,
    hash: String,
) -> anyhow::Result<Vec<Result<(), tonic::Status>>> {
    let mut answers = Vec::new();
    for i in 0..50u32 {
        let commit = KvCommit {
            lease: random_token()?,
            kv_layout_hash: hash.clone(),
            request_id: "guess".into(),
            first_token: 42,
            num_tokens: 40 + i % 40,
            transport: Transport::Shm as i32,
            ..Default::default()
        };
        let r = within(10, "CommitKv", insider.commit_kv(commit)).await?;
        answers.push(r.map(|_| ()));
        let payload = vec![0u8; 64];
        let header = KvHeader {
            lease: random_token()?,
            kv_layout_hash: hash.clone(),
            request_id: "guess".into(),
        };
        let blocks = KvBlocks {
            layer: 0,
            logical_blocks: vec![0],
            checksums: vec![tandem_transfer::crc32(&payload)],
            payload: payload.into(),
        };
        let push = [
            kv_message::Msg::Header(header),
            kv_message::Msg::Blocks(blocks),
        ]
        .map(|msg| KvMessage { msg: Some(msg) });
        let r = within(10, "PushKv", insider.push_kv(futures::stream::iter(push))).await?;
        answers.push(r.map(|_| ()));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(answers)
}

async fn guessed_capabilities(dep: &Deployment) -> anyhow::Result<Attack> {
    let victim = |i: usize, prompt: &str| Call {
        request_id: format!("victim-{i}"),
        ..Call::completion(prompt, 24, false)
    };
    let mut rng = Rng(11);
    let prompts: Vec<String> = (0..6).map(|i| prompt_text(&mut rng, 20 + 4 * i)).collect();
    // Greedy, so an untouched victim's text is the clean run's to the letter.
    let mut clean = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        match dep.router.run(&victim(i, p), REQUEST_TIMEOUT).await {
            Outcome::Ok { text, .. } => clean.push(text),
            other => bail!("a clean victim run failed: {other:?}"),
        }
    }
    let hash = dep.decode_info().await?.kv_layout_hash;
    let attacker = tokio::spawn(guess_capabilities(dep.decode().await?, hash));
    let victims: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let (router, call) = (dep.router.clone(), victim(i, p));
            tokio::spawn(async move { router.run(&call, REQUEST_TIMEOUT).await })
        })
        .collect();
    let (mut intact, mut disagg) = (0, 0);
    for (v, want) in victims.into_iter().zip(&clean) {
        if let Outcome::Ok {
            text,
            disaggregated,
            ..
        } = v.await?
        {
            intact += usize::from(&text == want);
            disagg += usize::from(disaggregated);
        }
    }
    let answers = attacker.await??;
    let tried = answers.len();
    let (mut refused, mut leaky) = (0, 0);
    let mut other_codes = Vec::new();
    let mut messages = BTreeSet::new();
    for a in &answers {
        let Err(s) = a else {
            other_codes.push("OK".to_string());
            continue;
        };
        let m = s.message();
        messages.insert(m.to_string());
        // A guess must learn nothing: no request id, no token or block count.
        let clean_message = !(m.contains("victim")
            || m.contains("tokens")
            || m.chars().any(|c| c.is_ascii_digit()));
        leaky += usize::from(!clean_message);
        if s.code() != tonic::Code::NotFound {
            other_codes.push(format!("{:?}", s.code()));
        } else if clean_message {
            refused += 1;
        }
    }
    other_codes.dedup();
    let (_, used) = dep.wait_idle(Duration::from_secs(2)).await;
    let quoted: Vec<String> = messages
        .iter()
        .take(3)
        .map(|m| format!("\"{m}\""))
        .collect();
    Ok(Attack {
        what: format!(
            "{tried} guessed CommitKv/PushKv as a member while {} victims run through the router",
            clean.len()
        ),
        expected:
            "NOT_FOUND naming no request (no id, no count); every victim's greedy text unchanged"
                .into(),
        result: format!(
            "{refused}/{tried} NOT_FOUND, {} distinct message(s): {}{}{}; {intact}/{} victims identical to the clean run ({disagg} disaggregated); blocks {used:?}",
            messages.len(),
            quoted.join(", "),
            if leaky > 0 {
                format!(", {leaky} messages name a request")
            } else {
                String::new()
            },
            listed(", other answers: ", &other_codes, ", "),
            clean.len()
        ),
        tried,
        refused,
        ok: refused == tried && intact == clean.len() && used == (0, 0),
    })
}

/// A listener that keeps every byte sent to it for `for_how_long`.
async fn byte_sink(
    for_how_long: Duration,
) -> anyhow::Result<(String, tokio::task::JoinHandle<Vec<u8>>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let task = tokio::spawn(async move {
        let mut got = Vec::new();
        let deadline = tokio::time::Instant::now() + for_how_long;
        while let Ok(Ok((mut s, _))) = tokio::time::timeout_at(deadline, listener.accept()).await {
            let mut buf = [0u8; 4096];
            while let Ok(Ok(n @ 1..)) = tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
                got.extend_from_slice(&buf[..n]);
            }
        }
        got
    });
    Ok((format!("http://{addr}"), task))
}

async fn prefill_to_sink(dep: &Deployment) -> anyhow::Result<Attack> {
    let hash = dep.prefill_info().await?.kv_layout_hash;
    let mut p = dep.prefill().await?;
    let (sink, sunk) = byte_sink(Duration::from_secs(6)).await?;
    let transports = [Transport::Tcp, Transport::Shm, Transport::Grpc];
    let mut codes = Vec::new();
    for transport in transports {
        let request = PrefillRequest {
            stop: None,
            request_id: "ssrf".into(),
            prompt: vec![7; 40],
            sampling: Some(SamplingParams::default()),
            destination: Some(KvDestination {
                transport: transport as i32,
                decode_endpoint: sink.clone(),
                lease: random_token()?,
                block_ids: vec![1, 2, 3],
                kv_layout_hash: hash.clone(),
                ..Default::default()
            }),
        };
        match within(10, "Prefill toward the sink", p.prefill(request)).await? {
            Err(s) if s.code() == tonic::Code::Aborted => {}
            Err(s) => codes.push(format!("{:?}", s.code())),
            Ok(_) => codes.push("OK".into()),
        }
    }
    let (tried, refused) = (transports.len(), transports.len() - codes.len());
    let got = sunk.await?;
    let magic = got.windows(4).any(|w| w == b"TKV2" || w == b"TKV1");
    Ok(Attack {
        what: "Prefill as a member toward a byte sink (tcp, shm, grpc destinations)".into(),
        expected: "ABORTED; no KV frame (TKV2) at the sink".into(),
        result: format!(
            "{refused}/{tried} ABORTED{}; sink got {} bytes, KV magic: {}",
            parenthesized(&listed("others: ", &codes, ", ")),
            got.len(),
            if magic { "YES" } else { "none" }
        ),
        tried,
        refused,
        ok: refused == tried && !magic,
    })
}

async fn kv_port(dep: &Deployment) -> anyhow::Result<Attack> {
    let pid = dep.pids().decode.context("no decode worker")?;
    let addr = format!("127.0.0.1:{}", dep.ports.kv);
    let before = rss_kib(pid);
    // The old attack's 20 bytes: a frame header that claims 256 MiB.
    let mut frame = b"TKV2".to_vec();
    frame.extend_from_slice(&[1, 0, 0, 0]);
    frame.extend_from_slice(&0u32.to_le_bytes());
    frame.extend_from_slice(&(256u64 << 20).to_le_bytes());
    let mut conns = Vec::new();
    for i in 0..48 {
        let mut s = within(5, "connecting to the KV port", TcpStream::connect(&addr)).await??;
        if i < 32 {
            // The listener may already have closed it; that is the point.
            let _ = s.write_all(&frame).await;
        }
        conns.push(s);
    }
    let started = Instant::now();
    let closing: Vec<_> = conns
        .into_iter()
        .map(|mut s| {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let read =
                    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf)).await;
                read.is_ok().then(|| started.elapsed())
            })
        })
        .collect();
    let (mut closed, mut slowest) = (0, Duration::ZERO);
    for c in closing {
        if let Some(took) = c.await? {
            closed += 1;
            slowest = slowest.max(took);
        }
    }
    let after = rss_kib(pid);
    let growth = after.saturating_sub(before);
    let bounded = after < before + 8 * 1024;
    let in_time = slowest < Duration::from_millis(KV_HELLO_TIMEOUT_MS + 3_000);
    Ok(Attack {
        what: "32 connections to the decode KV port sending a frame header claiming 256 MiB, plus 16 silent ones".into(),
        expected: format!(
            "all closed within a few seconds (hello timeout {KV_HELLO_TIMEOUT_MS} ms); decode RSS growth < 8 MiB"
        ),
        result: format!(
            "{closed}/48 closed, the last after {}; decode RSS {before} → {after} KiB (+{growth} KiB)",
            secs(slowest)
        ),
        tried: 48,
        refused: closed,
        ok: closed == 48 && bounded && in_time,
    })
}

async fn shm_modes(dep: &Deployment) -> anyhow::Result<Attack> {
    let pool = PathBuf::from(dep.decode_info().await?.shm_path);
    let files = [pool.clone(), tandem_kv::shm::tags_path(&pool)];
    let mut private = 0;
    let mut modes = Vec::new();
    for f in &files {
        let mode = std::fs::metadata(f)
            .map(|m| m.permissions().mode() & 0o777)
            .with_context(|| format!("stat {}", f.display()))?;
        private += usize::from(mode == 0o600);
        let name = f.file_name().unwrap_or_default().to_string_lossy();
        modes.push(format!("{name} {mode:o}"));
    }
    let inside = pool.starts_with(dep.shm_dir());
    Ok(Attack {
        what: "the decode worker's shared-memory pool and tags files".into(),
        expected: "mode 0600, inside --shm-dir".into(),
        result: format!(
            "{}; inside --shm-dir: {}",
            modes.join(", "),
            if inside { "yes" } else { "NO" }
        ),
        tried: files.len(),
        refused: private,
        ok: private == files.len() && inside,
    })
}

/// Opens a connection to the router, sends `bytes`, and reads until it is closed: what it
/// answered and when it closed (None if it stayed open `limit`).
async fn raw_http(port: u16, bytes: &'static [u8], limit: Duration) -> (String, Option<Duration>) {
    let started = Instant::now();
    let attempt = async {
        let mut s = TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(bytes).await?;
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = s.read(&mut buf).await {
            got.extend_from_slice(&buf[..n]);
        }
        std::io::Result::Ok(got)
    };
    match tokio::time::timeout(limit, attempt).await {
        Ok(Ok(got)) => (
            String::from_utf8_lossy(&got).into_owned(),
            Some(started.elapsed()),
        ),
        Ok(Err(e)) => (format!("connect failed: {e}"), Some(started.elapsed())),
        Err(_) => (String::new(), None),
    }
}

/// Slowloris on the router: heads that never end, and bodies far shorter than announced.
async fn slow_http(dep: &Deployment) -> anyhow::Result<(Attack, Attack)> {
    let router = dep.pids().router.context("no router")?;
    let before = rss_kib(router);
    let half: &'static [u8] =
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n";
    let slow: &'static [u8] = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{\"prompt\":";
    let limit = Duration::from_millis(HTTP_TIMEOUT_MS + 8_000);
    let port = dep.ports.router;
    let heads: Vec<_> = (0..61)
        .map(|_| tokio::spawn(raw_http(port, half, limit)))
        .collect();
    let bodies: Vec<_> = (0..20)
        .map(|_| tokio::spawn(raw_http(port, slow, limit)))
        .collect();
    let bound = Duration::from_millis(HTTP_TIMEOUT_MS + 3_000);
    let (mut heads_closed, mut heads_slowest) = (0, Duration::ZERO);
    for h in heads {
        if let (_, Some(took)) = h.await? {
            heads_slowest = heads_slowest.max(took);
            heads_closed += usize::from(took < bound);
        }
    }
    let (mut timed_out, mut bodies_slowest, mut answers) = (0, Duration::ZERO, Vec::new());
    let want = format!("did not arrive within {HTTP_TIMEOUT_MS} ms");
    for b in bodies {
        let (reply, took) = b.await?;
        if let Some(took) = took {
            bodies_slowest = bodies_slowest.max(took);
            if took < bound && reply.starts_with("HTTP/1.1 408") && reply.contains(&want) {
                timed_out += 1;
            } else {
                answers.push(reply.lines().next().unwrap_or("(nothing)").to_string());
            }
        }
    }
    answers.dedup();
    let after = rss_kib(router);
    let heads = Attack {
        what: "61 half-sent HTTP requests (the head never ends)".into(),
        expected: format!("closed by the header timeout ({HTTP_TIMEOUT_MS} ms)"),
        result: format!(
            "{heads_closed}/61 closed, the last after {}; router RSS {before} → {after} KiB",
            secs(heads_slowest)
        ),
        tried: 61,
        refused: heads_closed,
        ok: heads_closed == 61,
    };
    let bodies = Attack {
        what: "20 slow bodies (10 of 1 000 000 announced bytes)".into(),
        expected: format!("408 after the body timeout ({HTTP_TIMEOUT_MS} ms)"),
        result: format!(
            "{timed_out}/20 got 408 naming the timeout, the last after {}{}",
            secs(bodies_slowest),
            listed("; other answers: ", &answers, " | ")
        ),
        tried: 20,
        refused: timed_out,
        ok: timed_out == 20,
    };
    Ok((heads, bodies))
}

async fn endless_lease(dep: &Deployment) -> anyhow::Result<Attack> {
    let mut d = dep.decode().await?;
    let started = Instant::now();
    let mut stream = within(10, "Generate", d.generate(endless_generate("endless", 64)))
        .await??
        .into_inner();
    let first = within(10, "the lease", stream.message()).await??;
    let leased = matches!(
        first,
        Some(GenerateEvent {
            event: Some(generate_event::Event::Lease(_))
        })
    );
    let held = dep.blocks_in_use().await?;
    let end = tokio::time::timeout(Duration::from_secs(30), stream.message()).await;
    let took = started.elapsed();
    let code = match &end {
        Ok(Err(s)) => format!("{:?}", s.code()),
        Ok(Ok(_)) => "an event instead of an error".into(),
        Err(_) => "still open after 30 s".into(),
    };
    let cut = matches!(&end, Ok(Err(s)) if s.code() == tonic::Code::DeadlineExceeded);
    let (freed, used) = dep.wait_idle(Duration::from_secs(2)).await;
    let in_time = took < Duration::from_millis(MAX_LEASE_TTL_MS + 2_000);
    Ok(Attack {
        what: "a member's Generate asking an endless lease (lease_ttl u32::MAX ms), no KV sent"
            .into(),
        expected: format!(
            "cut at the worker's maximum ({MAX_LEASE_TTL_MS} ms) with DEADLINE_EXCEEDED; blocks freed"
        ),
        result: format!(
            "lease granted: {}, holding {} blocks; ended with {code} after {}; blocks {used:?}{}",
            if leased { "yes" } else { "no" },
            held.1,
            secs(took),
            freed.map_or(" (not freed within 2 s)".into(), |d| format!(
                " {} later",
                secs(d)
            ))
        ),
        tried: 1,
        refused: usize::from(cut && in_time),
        ok: leased && cut && in_time && freed.is_some(),
    })
}
