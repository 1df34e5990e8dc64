//! tandem across machines, on one machine: the router, a decode worker and a prefill worker
//! each in its own network namespace (`tandem_e2e::netns`), so every hop — router to
//! workers, prefill to decode's KV TCP port — crosses a real network between hosts that
//! share no loopback and no /dev/shm. Checks that requests run disaggregated over TCP, give
//! the same greedy output as aggregated serving, and survive concurrency; and that a router
//! finding its workers through `dns://` names (from its host's name table) does the same.
//!
//! Needs root and `ip`, so both tests are `#[ignore]`d with that reason: `.ci/run` runs them
//! (`cargo test -p tandem-e2e --test multihost -- --ignored`, as root), and without root they
//! fail saying so rather than pass without running.

use std::time::{Duration, Instant};
use tandem_auth::LoadInternalAuth;

use serde_json::Value;
use tandem_e2e::netns::Network;
use tandem_e2e::{
    Completion, Proc, decode_client_with, greedy_completion, prefill_client_with, wait_http_ok,
};

const DECODE_PORT: u16 = 7201;
const KV_TCP_PORT: u16 = 7301;
const PREFILL_PORT: u16 = 7101;
const MAX_TOKENS: u32 = 8;

async fn complete(client: &reqwest::Client, base: &str, prompt: &[u32]) -> Completion {
    let got = greedy_completion(client, base, prompt, MAX_TOKENS)
        .await
        .unwrap();
    assert_eq!(got.usage["completion_tokens"], MAX_TOKENS);
    got
}

/// Prompts of 1 to 61 tokens (byte-level ids of the tiny model), so that some span several
/// KV blocks.
fn prompts() -> Vec<Vec<u32>> {
    [1u32, 7, 23, 61]
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            (0..len)
                .map(|j| 3 + (j * 31 + i as u32 * 7) % 250)
                .collect()
        })
        .collect()
}

fn assert_disaggregated_tcp(got: &Completion, want: &str, what: &str) {
    assert_eq!(got.mode, "disaggregated", "{what}");
    assert_eq!(got.transport, "tcp", "{what}");
    assert!(got.kv_bytes > 0, "{what}: no KV bytes moved");
    assert_eq!(
        got.text, want,
        "{what}: output differs from aggregated serving"
    );
}

/// Waits (60 s at most) until the router at `base` is ready with its decode and its prefill
/// worker healthy: `/health` is 200 as soon as a decode worker is, and a request sent before
/// the prefill worker is polled would fall back to aggregated.
async fn wait_for_both_workers(client: &reqwest::Client, base: &str) {
    wait_http_ok(&format!("{base}/health"), Duration::from_secs(60))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let health: Value = client
            .get(format!("{base}/health"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if health["decode_workers_healthy"] == 1 && health["prefill_workers_healthy"] == 1 {
            return;
        }
        assert!(Instant::now() < deadline, "{base}: {health}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A router in host `router` on `port`, with `args` after the common ones.
fn start_router(net: &Network, port: u16, args: &[&str]) -> Proc {
    let host = net.host("router").unwrap().addr.to_string();
    let mut all = vec![
        "--host",
        &host,
        "--transport",
        "tcp",
        "--served-model-name",
        "tandem",
        "--health-interval-ms",
        "200",
        "--request-timeout-s",
        "60",
    ];
    all.extend_from_slice(args);
    net.start("router", "tandem-router", port, &all).unwrap()
}

/// The decode and prefill workers in their hosts (credentials from `auth`: the test secret,
/// and internal TLS when the network's environment names its files), once both answer.
async fn start_workers(
    net: &Network,
    auth: &tandem_auth::InternalAuth,
) -> (Proc, Proc, String, String) {
    let decode_addr = net.host("decode").unwrap().addr;
    let prefill_addr = net.host("prefill").unwrap().addr;
    let worker_args = ["--model", "tiny", "--kv-budget-mb", "32", "--threads", "1"];
    let (decode_host, prefill_host) = (decode_addr.to_string(), prefill_addr.to_string());
    let kv_port = KV_TCP_PORT.to_string();
    let mut decode_args = worker_args.to_vec();
    decode_args.extend([
        "--host",
        &decode_host,
        "--advertise-host",
        &decode_host,
        "--kv-tcp-port",
        &kv_port,
        "--no-shm",
    ]);
    let mut prefill_args = worker_args.to_vec();
    prefill_args.extend(["--host", &prefill_host]);
    let decode = net
        .start("decode", "tandem-decode", DECODE_PORT, &decode_args)
        .unwrap();
    let prefill = net
        .start("prefill", "tandem-prefill", PREFILL_PORT, &prefill_args)
        .unwrap();
    let decode_url = net.url("decode", DECODE_PORT).unwrap();
    let prefill_url = net.url("prefill", PREFILL_PORT).unwrap();
    let (_, info) = decode_client_with(&decode_url, Duration::from_secs(120), auth)
        .await
        .unwrap();
    assert_eq!(info.advertise_host, decode_host);
    assert_eq!(info.kv_tcp_port, u32::from(KV_TCP_PORT));
    assert!(
        info.shm_path.is_empty(),
        "shm must be off: the hosts share no memory"
    );
    prefill_client_with(&prefill_url, Duration::from_secs(120), auth)
        .await
        .unwrap();
    (decode, prefill, decode_url, prefill_url)
}

/// Every hop between the hosts inside mutual TLS: gRPC to both workers and the raw TCP KV
/// stream. Requests still run disaggregated over TCP with the aggregated output, and a client
/// without a certificate gets nothing from a worker even holding the secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root and iproute2 (network namespaces); .ci/run runs it with --ignored"]
async fn mutual_tls_across_three_network_namespaces() {
    let mut net = Network::create_or_fail(&["router", "decode", "prefill"]);
    let dir = tempfile::tempdir().unwrap();
    let ips: Vec<std::net::IpAddr> = ["router", "decode", "prefill"]
        .iter()
        .map(|h| std::net::IpAddr::V4(net.host(h).unwrap().addr))
        .collect();
    let (ca, cert, key) = tandem_e2e::test_pki(dir.path(), &ips).unwrap();
    for (var, path) in [
        ("TANDEM_INTERNAL_TLS_CA", &ca),
        ("TANDEM_INTERNAL_TLS_CERT", &cert),
        ("TANDEM_INTERNAL_TLS_KEY", &key),
    ] {
        net.env
            .push((var.to_string(), path.to_string_lossy().into_owned()));
    }
    let auth = tandem_auth::InternalAuthArgs {
        internal_secret: Some(tandem_e2e::TEST_SECRET.to_string()),
        internal_tls_ca: Some(ca.clone()),
        internal_tls_cert: Some(cert),
        internal_tls_key: Some(key),
        ..Default::default()
    }
    .load()
    .unwrap();
    // Declared after `net`, so dropped (killed) before the namespaces are deleted.
    let (_decode, _prefill, decode_url, prefill_url) = start_workers(&net, &auth).await;
    let listed = ["--prefill", &prefill_url, "--decode", &decode_url];
    let _router = start_router(&net, 8000, &listed);
    let mut aggregated_args = listed.to_vec();
    aggregated_args.extend(["--agg-threshold", "1000000000"]);
    let _aggregated_router = start_router(&net, 8001, &aggregated_args);
    let [base, aggregated_base] = [8000, 8001].map(|port| net.url("router", port).unwrap());
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    for b in [&base, &aggregated_base] {
        wait_for_both_workers(&client, b).await;
    }
    for (i, p) in prompts().iter().enumerate() {
        let want = complete(&client, &aggregated_base, p).await.text;
        let got = complete(&client, &base, p).await;
        assert_disaggregated_tcp(&got, &want, &format!("over mTLS, prompt {i}"));
    }
    // Plain gRPC with the secret, from outside the deployment's TLS: refused.
    let plain = tandem_auth::InternalAuth::with_secret(
        &tandem_auth::Secret::new(tandem_e2e::TEST_SECRET).unwrap(),
    );
    let refused = tokio::time::timeout(
        Duration::from_secs(10),
        decode_client_with(&decode_url, Duration::from_secs(2), &plain),
    )
    .await;
    assert!(
        !matches!(refused, Ok(Ok(_))),
        "a client without TLS reached the decode worker"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root and iproute2 (network namespaces); .ci/run runs it with --ignored"]
async fn disaggregated_across_three_network_namespaces() {
    let mut net = Network::create_or_fail(&["router", "decode", "prefill"]);
    let decode_addr = net.host("decode").unwrap().addr;
    let prefill_addr = net.host("prefill").unwrap().addr;
    net.set_hosts_file(
        "router",
        &[
            (decode_addr, "decode.tandem.test"),
            (prefill_addr, "prefill.tandem.test"),
        ],
    )
    .unwrap();
    // Declared after `net`, so dropped (killed) before the namespaces are deleted.
    let (_decode, _prefill, decode_url, prefill_url) =
        start_workers(&net, &tandem_e2e::test_auth()).await;
    let listed = ["--prefill", &prefill_url, "--decode", &decode_url];
    let _static_router = start_router(&net, 8000, &listed);
    let mut aggregated_args = listed.to_vec();
    aggregated_args.extend(["--agg-threshold", "1000000000"]);
    let _aggregated_router = start_router(&net, 8001, &aggregated_args);
    let prefill_name = format!("dns://prefill.tandem.test:{PREFILL_PORT}");
    let decode_name = format!("dns://decode.tandem.test:{DECODE_PORT}");
    let _dns_router = start_router(
        &net,
        8002,
        &[
            "--prefill",
            &prefill_name,
            "--decode",
            &decode_name,
            "--dns-refresh-ms",
            "500",
        ],
    );
    let [static_base, aggregated_base, dns_base] =
        [8000, 8001, 8002].map(|port| net.url("router", port).unwrap());
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    for base in [&static_base, &aggregated_base, &dns_base] {
        wait_for_both_workers(&client, base).await;
    }

    let prompts = prompts();
    let mut reference = Vec::new();
    for p in &prompts {
        let got = complete(&client, &aggregated_base, p).await;
        assert_eq!(got.mode, "aggregated");
        assert_eq!(got.kv_bytes, 0);
        reference.push(got.text);
    }
    for (base, router) in [(&static_base, "listed"), (&dns_base, "dns")] {
        for (i, p) in prompts.iter().enumerate() {
            let got = complete(&client, base, p).await;
            let what = format!("{router} router, prompt {i} ({} tokens)", p.len());
            assert_disaggregated_tcp(&got, &reference[i], &what);
        }
        // All prompts at once, twice over.
        let concurrent = prompts
            .iter()
            .chain(&prompts)
            .map(|p| complete(&client, base, p));
        let results = futures::future::join_all(concurrent).await;
        for (i, got) in results.iter().enumerate() {
            let what = format!("{router} router, concurrent request {i}");
            assert_disaggregated_tcp(got, &reference[i % prompts.len()], &what);
        }
    }
    let metrics = client
        .get(format!("{dns_base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let discovered =
        format!("tandem_router_worker_healthy{{worker=\"{decode_url}\",role=\"decode\"}} 1");
    assert!(
        metrics.contains(&discovered),
        "{discovered} not in the metrics"
    );
}
