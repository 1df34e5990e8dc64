//! Several "hosts" on one machine, for multi-host tests: one Linux network namespace per
//! host (`ip netns add`), joined by a bridge in a private /24 (`10.77.N.0/24`), with a veth
//! from the root namespace into the bridge so the test process reaches every host directly.
//! Processes run inside a host with `ip netns exec`, which also bind-mounts
//! `/etc/netns/NAME/hosts` over `/etc/hosts` for them: a per-host name table, which is how a
//! test gives a router DNS names.
//!
//! The bridge lives inside the first host's namespace, not in the root one: a fresh namespace
//! has no firewall rules, whereas the root namespace of a machine running Docker drops
//! bridged traffic in its FORWARD chain. Everything created (namespaces, links, name tables)
//! is removed on drop, also when a test panics; namespaces left by a killed earlier run are
//! swept when the next one starts.
//!
//! Needs root and iproute2's `ip`: the tests that use it are `#[ignore]`d with that reason,
//! `.ci/run` runs them (`--ignored`, as root), and [`Network::create_or_fail`] fails saying
//! what is missing rather than passing without running.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, bail};

use crate::{Proc, binary};

/// Prefix of every namespace this module creates: `tandem-e2e-<pid>-<seq>-<host>`.
const NETNS_PREFIX: &str = "tandem-e2e-";
/// The bridge inside the first host's namespace.
const BRIDGE: &str = "tbr0";
/// The last octet of the root namespace's address on the bridge.
const ROOT_OCTET: u8 = 254;

/// Networks made by this process so far (names must differ between tests of one binary).
static NETWORKS: AtomicU32 = AtomicU32::new(0);
/// Serialises creation, so that two tests do not pick the same free subnet.
static CREATING: Mutex<()> = Mutex::new(());

/// Why network namespaces cannot be used here, or None when they can be tried.
pub fn unavailable() -> Option<String> {
    match effective_uid() {
        Some(0) => {}
        Some(uid) => return Some(format!("not root (effective uid {uid})")),
        None => return Some("cannot read the effective uid from /proc/self/status".into()),
    }
    let ip = Command::new("ip")
        .arg("-V")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    match ip {
        Ok(s) if s.success() => None,
        Ok(s) => Some(format!("`ip -V` failed ({s})")),
        Err(e) => Some(format!("iproute2's `ip` is not installed ({e})")),
    }
}

fn effective_uid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(2)?.parse().ok()
}

/// Runs `ip ARGS`, failing with its stderr.
fn ip(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .with_context(|| format!("running ip {}", args.join(" ")))?;
    if !out.status.success() {
        bail!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// One host: a namespace and its address on the bridge.
#[derive(Debug, Clone)]
pub struct Host {
    pub name: String,
    pub netns: String,
    pub addr: Ipv4Addr,
}

/// Hosts joined by a bridge; removed on drop.
#[derive(Debug)]
pub struct Network {
    pub hosts: Vec<Host>,
    /// The third octet N of 10.77.N.0/24.
    pub subnet: u8,
    /// Prefix of interface names in the root namespace (they must be unique there).
    link_tag: String,
    /// What to undo on drop, in creation order.
    namespaces: Vec<String>,
    root_link: Option<String>,
    hosts_dirs: Vec<PathBuf>,
    /// Extra environment of every process started in the network (e.g. internal TLS files).
    pub env: Vec<(String, String)>,
}

impl Network {
    /// Creates the hosts named `names` (the first one holds the bridge), or fails the test
    /// saying why namespaces cannot be used here.
    pub fn create_or_fail(names: &[&str]) -> Self {
        let why = match unavailable() {
            Some(why) => why,
            None => match Self::create(names) {
                Ok(net) => return net,
                Err(e) => format!("cannot set up network namespaces: {e:#}"),
            },
        };
        panic!("this test needs network namespaces, but {why}");
    }

    /// Creates the hosts named `names`; the first one holds the bridge.
    pub fn create(names: &[&str]) -> anyhow::Result<Self> {
        if names.is_empty() || names.len() > 100 {
            bail!("between 1 and 100 hosts");
        }
        let _creating = CREATING.lock().unwrap_or_else(|p| p.into_inner());
        sweep_stale_namespaces();
        let pid = std::process::id();
        let seq = NETWORKS.fetch_add(1, Ordering::Relaxed) % 100;
        let mut net = Network {
            hosts: Vec::new(),
            subnet: free_subnet(pid + seq)?,
            // At most 15 bytes with the longest suffix ("h99"): te + 7-digit pid + 2 + 3.
            link_tag: format!("te{pid}x{seq}"),
            namespaces: Vec::new(),
            root_link: None,
            hosts_dirs: Vec::new(),
            env: Vec::new(),
        };
        for (i, name) in names.iter().enumerate() {
            let netns = format!("{NETNS_PREFIX}{pid}-{seq}-{name}");
            ip(&["netns", "add", &netns])?;
            net.namespaces.push(netns.clone());
            ip(&["-n", &netns, "link", "set", "lo", "up"])?;
            let octet = u8::try_from(i + 1).context("too many hosts")?;
            net.hosts.push(Host {
                name: (*name).to_string(),
                netns,
                addr: Ipv4Addr::new(10, 77, net.subnet, octet),
            });
        }
        let hub = net.hosts[0].netns.clone();
        ip(&["-n", &hub, "link", "add", BRIDGE, "type", "bridge"])?;
        ip(&[
            "-n",
            &hub,
            "addr",
            "add",
            &net.cidr(net.hosts[0].addr),
            "dev",
            BRIDGE,
        ])?;
        ip(&["-n", &hub, "link", "set", BRIDGE, "up"])?;
        for i in 1..net.hosts.len() {
            let host = net.hosts[i].clone();
            let (hub_end, host_end) = (
                format!("{}h{i}", net.link_tag),
                format!("{}n{i}", net.link_tag),
            );
            ip(&[
                "link", "add", &hub_end, "type", "veth", "peer", "name", &host_end,
            ])?;
            ip(&["link", "set", &host_end, "netns", &host.netns])?;
            net.attach_to_bridge(&hub_end)?;
            ip(&[
                "-n",
                &host.netns,
                "addr",
                "add",
                &net.cidr(host.addr),
                "dev",
                &host_end,
            ])?;
            ip(&["-n", &host.netns, "link", "set", &host_end, "up"])?;
        }
        let (root_end, hub_end) = (format!("{}r", net.link_tag), format!("{}rp", net.link_tag));
        ip(&[
            "link", "add", &root_end, "type", "veth", "peer", "name", &hub_end,
        ])?;
        net.root_link = Some(root_end.clone());
        net.attach_to_bridge(&hub_end)?;
        let root_addr = Ipv4Addr::new(10, 77, net.subnet, ROOT_OCTET);
        ip(&["addr", "add", &net.cidr(root_addr), "dev", &root_end])?;
        ip(&["link", "set", &root_end, "up"])?;
        Ok(net)
    }

    /// Moves `link` (in the root namespace) into the first host and onto the bridge.
    fn attach_to_bridge(&self, link: &str) -> anyhow::Result<()> {
        let hub = &self.hosts[0].netns;
        ip(&["link", "set", link, "netns", hub])?;
        ip(&["-n", hub, "link", "set", link, "master", BRIDGE])?;
        ip(&["-n", hub, "link", "set", link, "up"])?;
        Ok(())
    }

    fn cidr(&self, addr: Ipv4Addr) -> String {
        format!("{addr}/24")
    }

    /// The host called `name`.
    pub fn host(&self, name: &str) -> anyhow::Result<&Host> {
        self.hosts
            .iter()
            .find(|h| h.name == name)
            .with_context(|| format!("no host called {name}"))
    }

    /// `http://ADDR:PORT` of a host.
    pub fn url(&self, name: &str, port: u16) -> anyhow::Result<String> {
        Ok(format!("http://{}:{port}", self.host(name)?.addr))
    }

    /// Gives the processes started in `name` this name table (their `/etc/hosts`).
    pub fn set_hosts_file(
        &mut self,
        name: &str,
        entries: &[(Ipv4Addr, &str)],
    ) -> anyhow::Result<()> {
        let dir = PathBuf::from("/etc/netns").join(&self.host(name)?.netns);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        if !self.hosts_dirs.contains(&dir) {
            self.hosts_dirs.push(dir.clone());
        }
        let mut text = String::from("127.0.0.1 localhost\n");
        for (addr, host_name) in entries {
            text.push_str(&format!("{addr} {host_name}\n"));
        }
        std::fs::write(dir.join("hosts"), text).context("writing the hosts file")?;
        Ok(())
    }

    /// Starts workspace binary `bin` inside host `name` with `args` and `--port PORT`.
    pub fn start(&self, name: &str, bin: &str, port: u16, args: &[&str]) -> anyhow::Result<Proc> {
        self.start_executable(name, &binary(bin)?, port, args)
    }

    /// [`Self::start`] for the executable at `path` (a benchmark names its binaries' folder).
    pub fn start_executable(
        &self,
        name: &str,
        path: &std::path::Path,
        port: u16,
        args: &[&str],
    ) -> anyhow::Result<Proc> {
        let host = self.host(name)?;
        let bin = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        let mut cmd = Command::new("ip");
        // `ip netns exec` enters the namespace and then execs the binary, so the child is the
        // binary itself and killing it kills the worker.
        cmd.args(["netns", "exec", &host.netns])
            .arg(path)
            .args(args)
            .args(["--port", &port.to_string()]);
        cmd.env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
        );
        // The hosts are one deployment: they share its secret (and, beyond loopback, the
        // workers would refuse to listen without one).
        cmd.env("TANDEM_INTERNAL_SECRET", crate::TEST_SECRET);
        cmd.envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        // The router logs on stdout, the workers on stderr: keep both, at RUST_LOG's level
        // (warn unless set), so that a failing test shows what the hosts said.
        cmd.stdout(Stdio::inherit()).stderr(Stdio::inherit());
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {bin} in {}", host.netns))?;
        Ok(Proc {
            name: format!("{bin}@{name}"),
            port,
            child,
        })
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        // Deleting a namespace removes the links inside it, bridge included; the root end of
        // a veth goes with its peer, and is deleted here too in case a peer never moved.
        if let Some(link) = self.root_link.take() {
            let _ = ip(&["link", "del", &link]);
        }
        for netns in self.namespaces.drain(..).rev() {
            if let Err(e) = ip(&["netns", "del", &netns]) {
                eprintln!("cleanup: {e:#}");
            }
        }
        for i in 1..=self.hosts.len() {
            // Links that failed before moving into a namespace are still in the root one.
            let _ = Command::new("ip")
                .args(["link", "del", &format!("{}h{i}", self.link_tag)])
                .stderr(Stdio::null())
                .status();
        }
        for dir in self.hosts_dirs.drain(..) {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A /24 in 10.77.0.0/16 that no interface or route of the root namespace uses, starting
/// from one derived from `pid` so that concurrent runs rarely collide.
fn free_subnet(pid: u32) -> anyhow::Result<u8> {
    let addrs = ip(&["-4", "-o", "addr", "show"])?;
    let routes = ip(&["-4", "route", "show"])?;
    let start = (pid % 250) as u8;
    (0..250u8)
        .map(|k| start.wrapping_add(k) % 250 + 1)
        .find(|n| {
            let prefix = format!("10.77.{n}.");
            !addrs.contains(&prefix) && !routes.contains(&prefix)
        })
        .context("no free 10.77.N.0/24")
}

/// Deletes namespaces (and name tables) of earlier runs whose process is gone, e.g. after
/// a test was killed before its drop guard ran.
fn sweep_stale_namespaces() {
    let Ok(list) = ip(&["netns", "list"]) else {
        return;
    };
    for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
        let Some(rest) = name.strip_prefix(NETNS_PREFIX) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid == std::process::id() || PathBuf::from(format!("/proc/{pid}")).exists() {
            continue;
        }
        let _ = ip(&["netns", "del", name]);
        let _ = std::fs::remove_dir_all(PathBuf::from("/etc/netns").join(name));
    }
}
