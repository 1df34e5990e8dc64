//! Test support for tandem's end-to-end tests: start the real binaries (`tandem-prefill`,
//! `tandem-decode`, `tandem-router`) on free loopback ports, wait until they answer, and
//! stop them when the test ends (also on panic).
//!
//! The binaries live next to the test executable's `target/<profile>` folder. `cargo test`
//! only builds the binaries of a package that has integration tests of its own, so the first
//! lookup in a test process runs `cargo build --workspace --bins` for the same profile: the
//! binaries are then never missing nor stale (a no-op when they are fresh).
//! `TANDEM_E2E_NO_BUILD=1` skips that build (the binaries must then exist).
//!
//! Every process gets the deployment secret [`TEST_SECRET`] (as `tandem up` would give its
//! own), and the clients here sign their calls with it ([`test_auth`]); attack tests start
//! clients without it.
//!
//! `netns`: several hosts on one machine (network namespaces) for multi-host tests; `tools`:
//! the Python clients' interpreter; `hostile`: crafted hostile model files and a measured run
//! of a worker on each.

pub mod hostile;
pub mod netem;
pub mod netns;
mod tools;

pub use tools::{run_python_client, tools_python};

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tandem_auth::{AuthChannel, InternalAuth, LoadInternalAuth, Secret};
use tandem_proto::v1::decode_service_client::DecodeServiceClient;
use tandem_proto::v1::prefill_service_client::PrefillServiceClient;
use tandem_proto::v1::{InfoRequest, WorkerInfo};

/// The internal secret of every deployment the tests start.
pub const TEST_SECRET: &str = "e2e-test-deployment-secret-0123456789abcdef";

/// Credentials holding [`TEST_SECRET`].
pub fn test_auth() -> InternalAuth {
    InternalAuth::with_secret(&Secret::new(TEST_SECRET).expect("the test secret is long enough"))
}

/// A decode worker client that signs its calls with `auth`.
pub type DecodeClient = DecodeServiceClient<AuthChannel>;
/// A prefill worker client that signs its calls with `auth`.
pub type PrefillClient = PrefillServiceClient<AuthChannel>;

/// A channel to `endpoint` whose calls carry `auth`'s tokens (none for `InternalAuth::none`).
pub async fn channel(endpoint: &str, auth: &InternalAuth) -> anyhow::Result<AuthChannel> {
    let channel = auth.endpoint(endpoint)?.connect().await?;
    Ok(auth.channel(channel))
}

/// Path of a workspace binary built beside the tests (built first if missing or stale).
pub fn binary(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    // target/<profile>/deps/<test> → target/<profile>/<name>
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .context("test executable has no parent")?;
    build_binaries_once(dir)?;
    let path = dir.join(name);
    if !path.exists() {
        bail!(
            "{} not found: run `cargo build --workspace --bins` first",
            path.display()
        );
    }
    Ok(path)
}

/// Runs `cargo build --workspace --bins` once per test process, for the profile whose output
/// folder is `profile_dir`. Later calls return the first outcome.
fn build_binaries_once(profile_dir: &std::path::Path) -> anyhow::Result<()> {
    static OUTCOME: OnceLock<Result<(), String>> = OnceLock::new();
    let outcome = OUTCOME.get_or_init(|| {
        if std::env::var_os("TANDEM_E2E_NO_BUILD").is_some_and(|v| v == "1") {
            return Ok(());
        }
        let profile = profile_dir
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("debug")
            .to_string();
        let workspace = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("."));
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.current_dir(&workspace)
            .args(["build", "--workspace", "--bins", "--quiet"]);
        match profile.as_str() {
            "debug" => {}
            "release" => {
                cmd.arg("--release");
            }
            other => {
                cmd.args(["--profile", other]);
            }
        }
        // The binaries go where the tests look, even under a custom target folder.
        if let Some(target) = profile_dir.parent() {
            cmd.arg("--target-dir").arg(target);
        }
        match cmd.status() {
            Ok(s) if s.success() => Ok(()),
            Ok(s) => Err(format!("`cargo build --workspace --bins` failed ({s})")),
            Err(e) => Err(format!("could not run cargo to build the binaries: {e}")),
        }
    });
    outcome.clone().map_err(anyhow::Error::msg)
}

/// A free TCP port on 127.0.0.1 (the listener is closed right away, so a race is possible
/// but harmless in practice: tests retry startup on a bind failure).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(0)
}

/// A running child process, killed on drop.
#[derive(Debug)]
pub struct Proc {
    pub name: String,
    pub port: u16,
    child: Child,
}

impl Proc {
    /// Starts `binary` with `args` and `--port PORT` on a free port, holding the test
    /// deployment's secret.
    pub fn start(bin: &str, args: &[&str]) -> anyhow::Result<Self> {
        Self::start_with_env(bin, args, &[("TANDEM_INTERNAL_SECRET", TEST_SECRET)])
    }

    /// [`Proc::start`] with this environment instead of the test secret.
    pub fn start_with_env(bin: &str, args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<Self> {
        let port = free_port();
        let mut cmd = Command::new(binary(bin)?);
        cmd.args(args).arg("--port").arg(port.to_string());
        cmd.env_remove("TANDEM_INTERNAL_SECRET");
        cmd.envs(env.iter().copied());
        cmd.env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
        );
        cmd.stdout(Stdio::null()).stderr(Stdio::inherit());
        let child = cmd.spawn().with_context(|| format!("starting {bin}"))?;
        Ok(Self {
            name: bin.to_string(),
            port,
            child,
        })
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills the process at once (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Whether the process has exited.
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Waits until a decode worker answers `GetInfo` (with the test secret).
pub async fn decode_client(
    endpoint: &str,
    timeout: Duration,
) -> anyhow::Result<(DecodeClient, WorkerInfo)> {
    decode_client_with(endpoint, timeout, &test_auth()).await
}

/// [`decode_client`] with these credentials.
pub async fn decode_client_with(
    endpoint: &str,
    timeout: Duration,
    auth: &InternalAuth,
) -> anyhow::Result<(DecodeClient, WorkerInfo)> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(channel) = channel(endpoint, auth).await {
            let mut c = DecodeServiceClient::new(channel);
            if let Ok(info) = c
                .get_info(InfoRequest {
                    include_tokenizer: true,
                    challenge: Vec::new(),
                })
                .await
            {
                return Ok((c, info.into_inner()));
            }
        }
        if Instant::now() > deadline {
            bail!("decode worker at {endpoint} did not answer within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until a prefill worker answers `GetInfo` (with the test secret).
pub async fn prefill_client(
    endpoint: &str,
    timeout: Duration,
) -> anyhow::Result<(PrefillClient, WorkerInfo)> {
    prefill_client_with(endpoint, timeout, &test_auth()).await
}

/// [`prefill_client`] with these credentials.
pub async fn prefill_client_with(
    endpoint: &str,
    timeout: Duration,
    auth: &InternalAuth,
) -> anyhow::Result<(PrefillClient, WorkerInfo)> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(channel) = channel(endpoint, auth).await {
            let mut c = PrefillServiceClient::new(channel);
            if let Ok(info) = c
                .get_info(InfoRequest {
                    include_tokenizer: false,
                    challenge: Vec::new(),
                })
                .await
            {
                return Ok((c, info.into_inner()));
            }
        }
        if Instant::now() > deadline {
            bail!("prefill worker at {endpoint} did not answer within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until `GET url` answers 2xx.
pub async fn wait_http_ok(url: &str, timeout: Duration) -> anyhow::Result<()> {
    let client = reqwest::Client::new();
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(r) = client.get(url).send().await
            && r.status().is_success()
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{url} did not answer 2xx within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What one greedy `/v1/completions` call came back with.
#[derive(Debug, Clone)]
pub struct Completion {
    pub text: String,
    /// The response's `logprobs` (each token's, with two alternatives).
    pub logprobs: serde_json::Value,
    pub usage: serde_json::Value,
    /// The `x-tandem-mode`, `x-tandem-transport` and `x-tandem-kv-bytes` headers.
    pub mode: String,
    pub transport: String,
    pub kv_bytes: u64,
}

/// A greedy completion of `prompt` (token ids) through the router at `base`, exactly
/// `max_tokens` long (`ignore_eos`), with its logprobs and two alternatives per token (the
/// first token's come from the prefill worker in disaggregated mode). A status other than
/// 200 is an error with the body.
pub async fn greedy_completion(
    client: &reqwest::Client,
    base: &str,
    prompt: &[u32],
    max_tokens: u32,
) -> anyhow::Result<Completion> {
    let body = serde_json::json!({
        "model": "tandem", "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0.0, "ignore_eos": true, "logprobs": 2,
    });
    let resp = client
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await?;
    let status = resp.status();
    if status != reqwest::StatusCode::OK {
        bail!(
            "{base}: {status}: {}",
            resp.text().await.unwrap_or_default()
        );
    }
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let (mode, transport) = (header("x-tandem-mode"), header("x-tandem-transport"));
    let kv_bytes = header("x-tandem-kv-bytes").parse().unwrap_or(0);
    let v: serde_json::Value = resp.json().await?;
    Ok(Completion {
        text: v["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        logprobs: v["choices"][0]["logprobs"].clone(),
        usage: v["usage"].clone(),
        mode,
        transport,
        kv_bytes,
    })
}

/// A router and its workers, all real binaries on loopback.
#[derive(Debug)]
pub struct Deployment {
    pub prefill: Vec<Proc>,
    pub decode: Vec<Proc>,
    pub router: Proc,
    pub model: String,
}

/// What to start.
#[derive(Debug, Clone)]
pub struct DeploymentSpec {
    pub model: String,
    pub transport: String,
    pub prefill: usize,
    pub decode: usize,
    pub kv_budget_mb: usize,
    pub router_args: Vec<String>,
    pub worker_args: Vec<String>,
    /// Extra environment of every process (beside the test secret).
    pub env: Vec<(String, String)>,
}

impl Default for DeploymentSpec {
    fn default() -> Self {
        Self {
            model: "tiny".into(),
            transport: "shm".into(),
            prefill: 1,
            decode: 1,
            kv_budget_mb: 32,
            router_args: Vec::new(),
            worker_args: Vec::new(),
            env: Vec::new(),
        }
    }
}

impl DeploymentSpec {
    /// The credentials the deployment's processes hold: the test secret, and internal TLS
    /// when the environment names its files.
    pub fn auth(&self) -> anyhow::Result<InternalAuth> {
        let var = |name: &str| {
            self.env
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| PathBuf::from(v))
        };
        let args = tandem_auth::InternalAuthArgs {
            internal_secret: Some(TEST_SECRET.to_string()),
            internal_tls_ca: var("TANDEM_INTERNAL_TLS_CA"),
            internal_tls_cert: var("TANDEM_INTERNAL_TLS_CERT"),
            internal_tls_key: var("TANDEM_INTERNAL_TLS_KEY"),
            ..Default::default()
        };
        Ok(args.load()?)
    }
}

impl Deployment {
    /// Starts the workers, then the router, and waits until the router is healthy.
    pub async fn start(spec: &DeploymentSpec) -> anyhow::Result<Self> {
        let budget = spec.kv_budget_mb.to_string();
        let mut args: Vec<&str> = vec![
            "--model",
            &spec.model,
            "--kv-budget-mb",
            &budget,
            "--threads",
            "1",
        ];
        args.extend(spec.worker_args.iter().map(String::as_str));
        let mut env: Vec<(&str, &str)> = vec![("TANDEM_INTERNAL_SECRET", TEST_SECRET)];
        env.extend(spec.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        let prefill = (0..spec.prefill)
            .map(|_| Proc::start_with_env("tandem-prefill", &args, &env))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let decode = (0..spec.decode)
            .map(|_| Proc::start_with_env("tandem-decode", &args, &env))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let auth = spec.auth()?;
        for d in &decode {
            decode_client_with(&d.endpoint(), Duration::from_secs(300), &auth).await?;
        }
        for p in &prefill {
            prefill_client_with(&p.endpoint(), Duration::from_secs(300), &auth).await?;
        }
        let router =
            Self::router_with_env(&prefill, &decode, &spec.transport, &spec.router_args, &env)?;
        wait_http_ok(
            &format!("http://127.0.0.1:{}/health", router.port),
            Duration::from_secs(60),
        )
        .await?;
        Ok(Self {
            prefill,
            decode,
            router,
            model: spec.model.clone(),
        })
    }

    /// Starts a router over `prefill` and `decode` workers.
    pub fn router_for(
        prefill: &[Proc],
        decode: &[Proc],
        transport: &str,
        extra: &[String],
    ) -> anyhow::Result<Proc> {
        Self::router_with_env(
            prefill,
            decode,
            transport,
            extra,
            &[("TANDEM_INTERNAL_SECRET", TEST_SECRET)],
        )
    }

    /// [`Deployment::router_for`] with this environment.
    pub fn router_with_env(
        prefill: &[Proc],
        decode: &[Proc],
        transport: &str,
        extra: &[String],
        env: &[(&str, &str)],
    ) -> anyhow::Result<Proc> {
        let join = |ps: &[Proc]| ps.iter().map(Proc::endpoint).collect::<Vec<_>>().join(",");
        let decode_urls = join(decode);
        let prefill_urls = join(prefill);
        let mut args: Vec<&str> = vec![
            "--decode",
            &decode_urls,
            "--transport",
            transport,
            "--health-interval-ms",
            "200",
            "--served-model-name",
            "tandem",
        ];
        if !prefill.is_empty() {
            args.extend(["--prefill", &prefill_urls]);
        }
        args.extend(extra.iter().map(String::as_str));
        Proc::start_with_env("tandem-router", &args, env)
    }

    /// A second router over the same workers that runs everything aggregated.
    pub async fn aggregated_router(&self) -> anyhow::Result<Proc> {
        let r = Self::router_for(
            &self.prefill,
            &self.decode,
            "shm",
            &["--agg-threshold".into(), "1000000000".into()],
        )?;
        wait_http_ok(
            &format!("http://127.0.0.1:{}/health", r.port),
            Duration::from_secs(60),
        )
        .await?;
        Ok(r)
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.router.port)
    }
}

/// KV blocks in use on a worker (decode or prefill), from its `GetLoad`.
pub async fn blocks_in_use(endpoint: &str, decode: bool) -> anyhow::Result<u32> {
    use tandem_proto::v1::LoadRequest;
    let channel = channel(endpoint, &test_auth()).await?;
    let load = if decode {
        DecodeServiceClient::new(channel)
            .get_load(LoadRequest::default())
            .await?
            .into_inner()
    } else {
        PrefillServiceClient::new(channel)
            .get_load(LoadRequest::default())
            .await?
            .into_inner()
    };
    Ok(load.total_blocks - load.free_blocks + load.leases)
}

/// Resident memory of a process, in KiB (Linux; 0 where it cannot be read).
/// Mappings at least this large are a worker's KV pools (its own, and a decode worker's
/// shared one it writes into): allocated whole at startup, resident as blocks are first used.
pub const KV_POOL_MAPPING_KIB: u64 = 256 * 1024;

/// Resident KiB of `pid` outside its KV pools (mappings of [`KV_POOL_MAPPING_KIB`] or more,
/// from `/proc/PID/smaps`): what grows if the process allocates, not as its fixed-size pools
/// warm up. 0 when the process is gone.
pub fn rss_outside_kv_pools_kib(pid: u32) -> u64 {
    let Ok(smaps) = std::fs::read_to_string(format!("/proc/{pid}/smaps")) else {
        return 0;
    };
    let kib = |line: &str, key: &str| -> Option<u64> {
        line.strip_prefix(key)?
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()
    };
    let (mut total, mut size) = (0, 0);
    for line in smaps.lines() {
        if let Some(s) = kib(line, "Size:") {
            size = s;
        } else if let Some(r) = kib(line, "Rss:")
            && size < KV_POOL_MAPPING_KIB
        {
            total += r;
        }
    }
    total
}

pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// A test CA and one certificate (with its key) for `localhost`, 127.0.0.1 and `ips`, as
/// PEM files in `dir`: `(ca, cert, key)` paths. Every process of a test deployment may use
/// the same certificate as server and as client.
pub fn test_pki(
    dir: &std::path::Path,
    ips: &[std::net::IpAddr],
) -> anyhow::Result<(PathBuf, PathBuf, PathBuf)> {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair, SanType};
    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca.self_signed(&ca_key)?;
    let key = KeyPair::generate()?;
    let mut leaf = CertificateParams::new(vec!["localhost".to_string()])?;
    leaf.subject_alt_names
        .push(SanType::IpAddress("127.0.0.1".parse()?));
    for ip in ips {
        leaf.subject_alt_names.push(SanType::IpAddress(*ip));
    }
    let leaf = leaf.signed_by(&key, &ca, &ca_key)?;
    let paths = (
        dir.join("ca.pem"),
        dir.join("cert.pem"),
        dir.join("key.pem"),
    );
    std::fs::write(&paths.0, ca.pem())?;
    std::fs::write(&paths.1, leaf.pem())?;
    std::fs::write(&paths.2, key.serialize_pem())?;
    Ok(paths)
}

/// A prompt's KV as a prefill worker ships it: per layer, `(logical block, bytes)`.
pub type PromptKv = Vec<Vec<(u32, Vec<u8>)>>;

/// The prompt's KV and its greedy first token, computed by a local engine as a prefill
/// worker computes them (for the workers' in-process tests).
pub fn local_prefill(
    model: &std::sync::Arc<tandem_engine::Model>,
    tokenizer: &tandem_text::TextTokenizer,
    prompt: &[u32],
) -> (PromptKv, u32) {
    use tandem_engine::{Engine, EngineConfig, SamplingParams, StopParams};
    let mut engine =
        Engine::new(model.clone(), tokenizer.clone(), EngineConfig::default()).expect("engine");
    let stop = StopParams {
        max_tokens: 1,
        ignore_eos: true,
        ..Default::default()
    };
    engine
        .add_request(prompt.to_vec(), SamplingParams::greedy(), stop)
        .expect("request");
    let mut layers = vec![Vec::new(); model.config().num_hidden_layers];
    let out = engine
        .step_with(&mut |layer, cache, chunks| {
            for c in chunks {
                for lb in c.logical_blocks() {
                    let bytes = cache.block_layer_bytes(layer, c.blocks[lb]).expect("block");
                    layers[layer].push((lb as u32, bytes.to_vec()));
                }
            }
        })
        .expect("prefill");
    (layers, out[0].token)
}
