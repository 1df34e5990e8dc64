//! The deployment of the chaos rows: router, prefill worker and decode worker each on its
//! own "host" (a network namespace, `tandem_e2e::netns`), KV over raw TCP between the
//! workers, short leases so that a stalled transfer ends quickly; and a second router on the
//! same workers that runs everything aggregated, whose greedy texts are the reference every
//! answer of the disaggregated router is checked against.
//!
//! Like [`crate::deployment`], it reports what it sees and never decides a row.

use std::path::Path;
use std::time::{Duration, Instant};

use tandem_e2e::netns::{Host, Network};
use tandem_e2e::{DecodeClient, PrefillClient, Proc, decode_client_with, prefill_client_with};
use tandem_proto::v1::{LoadReport, LoadRequest};

use crate::client::{RouterClient, SERVED};
use crate::deployment::within;

const ROUTER_PORT: u16 = 8000;
const AGGREGATED_ROUTER_PORT: u16 = 8001;
const PREFILL_PORT: u16 = 7101;
const DECODE_PORT: u16 = 7201;
const KV_TCP_PORT: u16 = 7301;
/// The lease a reservation gets (router) and may get at most (decode worker): how long a KV
/// transfer may stall before its blocks are freed and the request placed again.
pub const LEASE_TIMEOUT: Duration = Duration::from_secs(3);

/// The three hosts and what runs on them.
pub struct ChaosHosts {
    /// Declared first, dropped last: the processes die before their namespaces go.
    pub router: RouterClient,
    pub aggregated: RouterClient,
    _processes: Vec<Proc>,
    decode: DecodeClient,
    prefill: PrefillClient,
    pub net: Network,
}

impl ChaosHosts {
    /// Starts the hosts and waits until the router sees both workers healthy.
    pub async fn start(bin_dir: &Path, model: &str) -> anyhow::Result<Self> {
        let net = Network::create(&["router", "decode", "prefill"])?;
        let (decode_addr, prefill_addr) = (
            net.host("decode")?.addr.to_string(),
            net.host("prefill")?.addr.to_string(),
        );
        let lease_ms = LEASE_TIMEOUT.as_millis().to_string();
        let kv_port = KV_TCP_PORT.to_string();
        // No prefix caching: the rows repeat a few prompts (their reference texts), and every
        // request must move its KV across the link under test.
        // The tiny model's blocks are 8 KiB, a real model's ~100x larger.
        let kv_mb = if model == "tiny" { "32" } else { "512" };
        let common = [
            "--model",
            model,
            "--kv-budget-mb",
            kv_mb,
            "--threads",
            "1",
            "--no-prefix-caching",
        ];
        let mut decode_args = common.to_vec();
        decode_args.extend([
            "--host",
            &decode_addr,
            "--advertise-host",
            &decode_addr,
            "--kv-tcp-port",
            &kv_port,
            "--no-shm",
            "--max-lease-ttl-ms",
            &lease_ms,
        ]);
        let mut prefill_args = common.to_vec();
        prefill_args.extend(["--host", &prefill_addr]);
        let mut processes = vec![
            net.start_executable(
                "decode",
                &bin_dir.join("tandem-decode"),
                DECODE_PORT,
                &decode_args,
            )?,
            net.start_executable(
                "prefill",
                &bin_dir.join("tandem-prefill"),
                PREFILL_PORT,
                &prefill_args,
            )?,
        ];
        let auth = tandem_e2e::test_auth();
        let (decode_url, prefill_url) = (
            net.url("decode", DECODE_PORT)?,
            net.url("prefill", PREFILL_PORT)?,
        );
        let (decode, _) = decode_client_with(&decode_url, Duration::from_secs(300), &auth).await?;
        let (prefill, _) =
            prefill_client_with(&prefill_url, Duration::from_secs(300), &auth).await?;
        let router_host = net.host("router")?.addr.to_string();
        let mut router_args = vec![
            "--host",
            &router_host,
            "--transport",
            "tcp",
            "--served-model-name",
            SERVED,
            "--health-interval-ms",
            "200",
            "--request-timeout-s",
            "60",
            "--lease-ttl-ms",
            &lease_ms,
            "--prefill",
            &prefill_url,
            "--decode",
            &decode_url,
        ];
        let router_bin = bin_dir.join("tandem-router");
        processes.push(net.start_executable("router", &router_bin, ROUTER_PORT, &router_args)?);
        router_args.extend(["--agg-threshold", "1000000000"]);
        processes.push(net.start_executable(
            "router",
            &router_bin,
            AGGREGATED_ROUTER_PORT,
            &router_args,
        )?);
        let router = RouterClient::at(&net.url("router", ROUTER_PORT)?)?;
        let aggregated = RouterClient::at(&net.url("router", AGGREGATED_ROUTER_PORT)?)?;
        for r in [&router, &aggregated] {
            wait_both_workers(r).await?;
        }
        Ok(Self {
            router,
            aggregated,
            _processes: processes,
            decode,
            prefill,
            net,
        })
    }

    pub fn host(&self, name: &str) -> anyhow::Result<&Host> {
        self.net.host(name)
    }

    /// Leases and KV blocks in use on (prefill, decode), summed per worker.
    pub async fn in_use(&self) -> anyhow::Result<(u32, u32)> {
        let used = |l: LoadReport| l.total_blocks.saturating_sub(l.free_blocks) + l.leases;
        let (mut p, mut d) = (self.prefill.clone(), self.decode.clone());
        let prefill = within(5, "prefill GetLoad", p.get_load(LoadRequest::default())).await??;
        let decode = within(5, "decode GetLoad", d.get_load(LoadRequest::default())).await??;
        Ok((used(prefill.into_inner()), used(decode.into_inner())))
    }

    /// Polls until neither worker holds a lease or a block, up to `limit`: how long that
    /// took, or None and the last counts.
    pub async fn wait_clean(&self, limit: Duration) -> (Option<Duration>, (u32, u32)) {
        let started = Instant::now();
        let mut last = (u32::MAX, u32::MAX);
        while started.elapsed() <= limit {
            if let Ok(used) = self.in_use().await {
                last = used;
                if used == (0, 0) {
                    return (Some(started.elapsed()), used);
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        (None, last)
    }
}

/// Waits (120 s at most) until `router` reports a healthy decode and prefill worker.
async fn wait_both_workers(router: &RouterClient) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let health = router.http.get(router.url("/health")).send().await;
        if let Ok(h) = health
            && let Ok(v) = h.json::<serde_json::Value>().await
            && v["decode_workers_healthy"] == 1
            && v["prefill_workers_healthy"] == 1
        {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the router at {} never saw both workers healthy",
            router.url("")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Why the chaos rows cannot run here (they need root, `ip` and iptables), or None.
pub fn unavailable() -> Option<String> {
    tandem_e2e::netns::unavailable().or_else(tandem_e2e::netem::unavailable)
}
