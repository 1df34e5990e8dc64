//! What the launcher does with `TANDEM_*` variables: those of the shell that runs `tandem up`
//! (or `tandem plan`), and those a deployment file's `env` tables set.
//!
//! The deployment file is the one source of a deployment's settings: `tandem check` validates
//! it and `tandem plan` prints what `tandem up` starts, and neither may be contradicted by
//! whatever the launching shell exported. So every process starts from the launcher's
//! environment less every `TANDEM_*` variable ([`inherited`]), and a variable that the router
//! or a worker would read (`TANDEM_WEIGHTS=f32 tandem up`) is never dropped in silence:
//! `tandem up` refuses to start and names the file key that sets it ([`refuse_shell_settings`]).
//! The launcher's own variables (`TANDEM_CACHE`, `TANDEM_LOG_FORMAT`, …) are its own flags
//! ([`crate::cli`]), which it hands on to every process as flags: those reach the workers.
//!
//! Why refuse rather than pass such a variable on: a flag beats its variable, and the plan
//! writes only the flags whose values differ from a binary's defaults, so a passed variable
//! would take effect exactly where the file left the default and nowhere else; one variable
//! cannot say which of several workers it means; and `check` and `plan` would stop describing
//! what `up` starts. For the same reason a file's `env` table may not set a variable that a
//! file key sets ([`check_env_tables`]): the key is the one way to say it.
//!
//! Nothing here spells a flag or variable name. The variables are the binaries' own, read from
//! their clap definitions (`tandem-cli`), and which file key sets each is asked of the plan
//! itself ([`FileKeys`]): each key is changed in turn, and the flags and variables that change
//! in the processes it starts are the ones that key sets.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;

use clap::{Command, CommandFactory};
use tandem_cli::reference::env_names;
use tandem_cli::{DecodeArgs, PrefillArgs, RouterArgs};

use crate::config::{ConfigError, DeployConfig, ModelSection, RouterSection, WorkerSpec};
use crate::plan::{Plan, Role, plan};
use crate::security::SecuritySection;

/// Where in the deployment file a key lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Section {
    /// Keys before any section header.
    Top,
    Model,
    Router,
    Prefill,
    Decode,
    Security,
}

impl Section {
    fn is_worker(self) -> bool {
        matches!(self, Self::Prefill | Self::Decode)
    }

    fn header(self) -> &'static str {
        match self {
            Self::Top => "top level",
            Self::Model => "[model]",
            Self::Router => "[router]",
            Self::Prefill => "[[prefill]]",
            Self::Decode => "[[decode]]",
            Self::Security => "[security]",
        }
    }
}

/// A key of one section (in backticks, as messages show it) and a change to its value.
type Key<S> = (&'static str, fn(&mut S));

/// Keys of the deployment file that become flags or variables of the processes, each with a
/// change to a value the probe deployment does not have. `check_env_tables` and the shell
/// check rely on this list being complete; a test holds it to every flag the plan writes.
const TOP_KEYS: &[Key<DeployConfig>] = &[("`startup_timeout_s`", |c| c.startup_timeout_s += 60)];
const MODEL_KEYS: &[Key<ModelSection>] = &[
    ("`name`", |m| m.name = "tiny".into()),
    ("`weights`", |m| m.weights = "f32".into()),
    ("`kv_dtype`", |m| m.kv_dtype = "bf16".into()),
    ("`compute`", |m| m.compute = "exact".into()),
    ("`tokenizer`", |m| {
        m.tokenizer = Some("tokenizer.json".into())
    }),
    ("`cache_dir`", |m| m.cache_dir = Some("cache".into())),
];

const ROUTER_KEYS: &[Key<RouterSection>] = &[
    ("`host`", |r| r.host = "192.0.2.1".into()),
    ("`port`", |r| r.port = r.port.wrapping_add(1000)),
    ("`transport`", |r| r.transport = "grpc".into()),
    ("`agg_threshold`", |r| r.agg_threshold += 64),
    ("`routing`", |r| r.routing = Some("round-robin".into())),
    ("`elastic_threads`", |r| r.elastic_threads = true),
    ("`placement`", |r| r.placement = Some("slo".into())),
    ("`slo.ttft_ms`", |r| r.slo.ttft_ms = Some(123.0)),
    ("`slo.ttft_per_token_ms`", |r| {
        r.slo.ttft_per_token_ms = Some(0.5)
    }),
    ("`slo.tpot_ms`", |r| r.slo.tpot_ms = Some(33.0)),
];

/// In order of precedence: the key that sets a flag alone comes before one that also does.
const WORKER_KEYS: &[Key<WorkerSpec>] = &[
    ("`name`", |w| w.name = Some("probe".into())),
    ("`host`", |w| w.host = "192.0.2.1".into()),
    ("`kv_tcp_port`", |w| w.kv_tcp_port = Some(9)),
    ("`port`", |w| w.port = w.port.wrapping_add(1000)),
    ("`threads`", |w| {
        w.threads = Some(w.threads.unwrap_or(1) + 2)
    }),
    ("`kv_budget_mb`", |w| w.kv_budget_mb = Some(3)),
    ("`cpu_priority`", |w| w.cpu_priority = Some("idle".into())),
    ("`lend_slack`", |w| w.lend_slack = Some(true)),
    ("`max_batch_tokens`", |w| w.max_batch_tokens = Some(3)),
    ("`max_running`", |w| w.max_running = Some(3)),
    ("`prefix_caching`", |w| w.prefix_caching = Some(false)),
    ("`gpu`", |w| w.gpu = Some(0)),
    ("`mps_thread_percentage`", |w| {
        w.mps_thread_percentage = Some(50)
    }),
    ("`green_context_sms`", |w| w.green_context_sms = Some(8)),
];

const SECURITY_KEYS: &[Key<SecuritySection>] = &[
    ("`secret_file`", |s| s.secret_file = Some("secret".into())),
    ("`tls_ca`, `tls_cert` and `tls_key`", |s| {
        s.tls_ca = Some("ca.pem".into());
        s.tls_cert = Some("cert.pem".into());
        s.tls_key = Some("key.pem".into());
    }),
    ("`insecure`", |s| s.insecure = true),
];

/// A file key that sets a variable (or the flag that reads it).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Place {
    section: Section,
    /// The key, in backticks (or several that go together).
    key: &'static str,
}

/// Which variables each binary of a deployment reads, from their clap definitions.
#[derive(Debug, Clone)]
struct ProcessVariables {
    prefill: BTreeSet<String>,
    decode: BTreeSet<String>,
    router: BTreeSet<String>,
    /// The launcher's own: it reads them itself and passes their values on as flags.
    launcher: BTreeSet<String>,
}

impl ProcessVariables {
    fn read() -> Self {
        let names = |c: Command| env_names(&c).into_iter().collect();
        Self {
            prefill: names(PrefillArgs::command()),
            decode: names(DecodeArgs::command()),
            router: names(RouterArgs::command()),
            launcher: names(crate::cli::Cli::command()),
        }
    }

    /// The sections whose processes read `var` through a flag.
    fn readers(&self, var: &str) -> Vec<Section> {
        [
            (Section::Prefill, &self.prefill),
            (Section::Decode, &self.decode),
            (Section::Router, &self.router),
        ]
        .into_iter()
        .filter(|(_, names)| names.contains(var))
        .map(|(section, _)| section)
        .collect()
    }

    /// Whether `var` configures the router or a worker and the launcher does not read it.
    fn is_process_setting(&self, var: &str) -> bool {
        !self.launcher.contains(var) && !self.readers(var).is_empty()
    }

    fn command(role: Role) -> Command {
        match role {
            Role::Prefill => PrefillArgs::command(),
            Role::Decode => DecodeArgs::command(),
            Role::Router => RouterArgs::command(),
        }
    }
}

/// The deployment-file keys that set each process variable, found by asking the plan.
#[derive(Debug, Clone, Default)]
pub struct FileKeys {
    by_var: BTreeMap<String, Vec<Place>>,
}

impl FileKeys {
    /// Plans a small deployment, then again with each key changed, and records which
    /// variables (a flag's, or one set outright) each change touched.
    pub fn probe() -> Self {
        let base_cfg = DeployConfig::default_local(2);
        let mut keys = Self::default();
        let Ok(base) = plan(&base_cfg) else {
            return keys;
        };
        let mut probe =
            |section: Section, key: &'static str, change: &dyn Fn(&mut DeployConfig)| {
                let mut cfg = base_cfg.clone();
                change(&mut cfg);
                if let Ok(changed) = plan(&cfg) {
                    for var in changed_variables(&base, &changed) {
                        let places = keys.by_var.entry(var).or_default();
                        let place = Place { section, key };
                        if !places.contains(&place) {
                            places.push(place);
                        }
                    }
                }
            };
        for &(key, set) in TOP_KEYS {
            probe(Section::Top, key, &|c| set(c));
        }
        for &(key, set) in MODEL_KEYS {
            probe(Section::Model, key, &|c| set(&mut c.model));
        }
        for &(key, set) in ROUTER_KEYS {
            probe(Section::Router, key, &|c| set(&mut c.router));
        }
        for &(key, set) in WORKER_KEYS {
            probe(Section::Prefill, key, &|c| {
                c.prefill.iter_mut().for_each(set)
            });
            probe(Section::Decode, key, &|c| c.decode.iter_mut().for_each(set));
        }
        for &(key, set) in SECURITY_KEYS {
            probe(Section::Security, key, &|c| set(&mut c.security));
        }
        keys
    }

    /// "set `weights` in the file's [model] section", or `None` when no key sets `var`.
    pub fn advice(&self, var: &str) -> Option<String> {
        self.advice_in(var, None)
    }

    /// [`Self::advice`], for a variable met in `section`: its own keys if it has any there.
    fn advice_in(&self, var: &str, section: Option<Section>) -> Option<String> {
        let all = self.by_var.get(var)?;
        let own: Vec<&Place> = all.iter().filter(|p| Some(p.section) == section).collect();
        let places = if own.is_empty() {
            all.iter().collect()
        } else {
            own
        };
        let mut keys: Vec<&str> = Vec::new();
        let mut sections: Vec<Section> = Vec::new();
        for p in places {
            if !keys.contains(&p.key) {
                keys.push(p.key);
            }
            if !sections.contains(&p.section) {
                sections.push(p.section);
            }
        }
        Some(format!(
            "set {} in the file's {}",
            or_list(&keys),
            where_in_file(&sections)
        ))
    }
}

/// `a`, `a or b`, `a, b or c`.
fn or_list(items: &[&str]) -> String {
    match items {
        [] => String::new(),
        [one] => (*one).to_string(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    }
}

/// "[model] section", "[[prefill]] and [[decode]] entries".
fn where_in_file(sections: &[Section]) -> String {
    let workers: Vec<&str> = sections
        .iter()
        .filter(|s| s.is_worker())
        .map(|s| s.header())
        .collect();
    let mut parts: Vec<String> = sections
        .iter()
        .filter(|s| !s.is_worker())
        .map(|s| match s {
            Section::Top => "top level (before any section)".to_string(),
            _ => format!("{} section", s.header()),
        })
        .collect();
    if !workers.is_empty() {
        parts.push(format!("{} entries", workers.join(" and ")));
    }
    parts.join(" and ")
}

/// The variables whose value differs between two plans of the same processes: those of every
/// flag that changed (by the binary's clap definition) and those set outright.
fn changed_variables(base: &Plan, other: &Plan) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (a, b) in base.processes.iter().zip(&other.processes) {
        let (fa, fb) = (flags(&a.args), flags(&b.args));
        let command = ProcessVariables::command(a.role);
        for long in fa.keys().chain(fb.keys()) {
            if fa.get(long) == fb.get(long) {
                continue;
            }
            let env = command
                .get_arguments()
                .find(|arg| arg.get_long() == Some(*long))
                .and_then(|arg| arg.get_env());
            if let Some(env) = env {
                out.insert(env.to_string_lossy().into_owned());
            }
        }
        for var in a.env.keys().chain(b.env.keys()) {
            if a.env.get(var) != b.env.get(var) {
                out.insert(var.clone());
            }
        }
        // Secret values are drawn afresh for each plan: only their presence is compared.
        for var in a.secret_env.keys().chain(b.secret_env.keys()) {
            if a.secret_env.contains_key(var) != b.secret_env.contains_key(var) {
                out.insert(var.clone());
            }
        }
    }
    out
}

/// A command line's flags (`--name`) and the values after each.
fn flags(args: &[String]) -> BTreeMap<&str, Vec<&str>> {
    let mut out: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    let mut current = None;
    for arg in args {
        if let Some(long) = arg.strip_prefix("--") {
            out.entry(long).or_default();
            current = Some(long);
        } else if let Some(long) = current {
            out.entry(long).or_default().push(arg);
        }
    }
    out
}

/// What to write in the file instead of `var` (read by the processes of `readers`).
fn instead(keys: &FileKeys, var: &str, readers: &[Section]) -> String {
    keys.advice(var).unwrap_or_else(|| {
        format!(
            "no file key sets it: give it in the `env` table (or as a flag in `extra_args`) of the file's {}",
            where_in_file(readers)
        )
    })
}

/// Variables of the launcher's environment that the router or a worker would read, which
/// `tandem up` does not pass on.
#[derive(Debug)]
pub struct ShellSettings {
    /// One line per variable: its name and the file key to use (never its value).
    pub advice: Vec<String>,
    file_given: bool,
}

impl std::fmt::Display for ShellSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "`tandem up` configures its processes from the deployment file alone and does not pass on these variables of its environment:"
        )?;
        for line in &self.advice {
            writeln!(f, "{line}")?;
        }
        let file = if self.file_given {
            "the file"
        } else {
            "a deployment file (without one, `tandem up` runs the built-in deployment that `tandem plan` prints; deploy/local/cpu-1p1d.toml is a file to start from)"
        };
        write!(f, "put them in {file}, or unset them")
    }
}

impl std::error::Error for ShellSettings {}

/// Refuses the process settings among `vars` (the launcher's environment), naming for each
/// the file key that sets it. Empty values are ignored, as the binaries ignore them.
/// `file_given`: whether `tandem up` was given a deployment file.
pub fn refuse_shell_settings(
    vars: impl IntoIterator<Item = (OsString, OsString)>,
    file_given: bool,
) -> Result<(), ShellSettings> {
    let known = ProcessVariables::read();
    let set: BTreeSet<String> = vars
        .into_iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(k, _)| k.to_string_lossy().into_owned())
        .filter(|k| known.is_process_setting(k))
        .collect();
    if set.is_empty() {
        return Ok(());
    }
    let keys = FileKeys::probe();
    let advice = set
        .iter()
        .map(|var| format!("  {var}: {}", instead(&keys, var, &known.readers(var))))
        .collect();
    Err(ShellSettings { advice, file_given })
}

/// The environment every process starts from: `vars` (the launcher's) less every `TANDEM_*`
/// variable. What the launcher's own flags read reaches the processes as flags; the rest was
/// refused by [`refuse_shell_settings`] or configures nothing tandem runs.
pub fn inherited(
    vars: impl IntoIterator<Item = (OsString, OsString)>,
) -> Vec<(OsString, OsString)> {
    vars.into_iter()
        .filter(|(k, _)| !k.to_string_lossy().starts_with("TANDEM_"))
        .collect()
}

/// Refuses an `env` table entry that a file key sets (the flag the key writes would win over
/// it wherever the key is not left at its default, so which one holds would depend on the
/// value): the key is the one way to say it.
pub fn check_env_tables(cfg: &DeployConfig) -> Result<(), ConfigError> {
    let router = (Section::Router, "router".to_string(), &cfg.router.env);
    let workers = [
        (Section::Prefill, "prefill", &cfg.prefill),
        (Section::Decode, "decode", &cfg.decode),
    ]
    .into_iter()
    .flat_map(|(section, role, ws)| {
        ws.iter()
            .enumerate()
            .map(move |(i, w)| (section, format!("{role}[{i}]"), &w.env))
    });
    let mut keys = None;
    for (section, what, env) in std::iter::once(router).chain(workers) {
        for var in env.keys().filter(|k| k.starts_with("TANDEM_")) {
            let keys = keys.get_or_insert_with(FileKeys::probe);
            if let Some(advice) = keys.advice_in(var, Some(section)) {
                return Err(ConfigError::Invalid(format!(
                    "{what}.env sets {var}: {advice} instead"
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_cli::parse_without_env;

    fn vars(pairs: &[(&str, &str)]) -> Vec<(OsString, OsString)> {
        pairs
            .iter()
            .map(|(k, v)| (OsString::from(k), OsString::from(v)))
            .collect()
    }

    #[test]
    fn a_worker_setting_in_the_shell_is_refused_naming_its_file_key() {
        let err = refuse_shell_settings(
            vars(&[
                ("PATH", "/usr/bin"),
                ("TANDEM_WEIGHTS", "f32"),
                ("TANDEM_ISA", "avx2"),
                ("TANDEM_API_KEY", "k3y-k3y-k3y"),
            ]),
            true,
        )
        .unwrap_err();
        let text = err.to_string();
        assert_eq!(err.advice.len(), 3, "{text}");
        assert!(
            text.contains("  TANDEM_WEIGHTS: set `weights` in the file's [model] section\n"),
            "{text}"
        );
        assert!(
            text.contains("  TANDEM_ISA: no file key sets it: give it in the `env` table (or as a flag in `extra_args`) of the file's [[prefill]] and [[decode]] entries"),
            "{text}"
        );
        assert!(
            text.contains("TANDEM_API_KEY: no file key sets it")
                && text.contains("[router] section"),
            "{text}"
        );
        assert!(
            text.contains("put them in the file, or unset them"),
            "{text}"
        );
        // Names only: a value may be a secret.
        assert!(!text.contains("f32") && !text.contains("k3y"), "{text}");
        let builtin = refuse_shell_settings(vars(&[("TANDEM_WEIGHTS", "f32")]), false)
            .unwrap_err()
            .to_string();
        assert!(builtin.contains("`tandem plan` prints"), "{builtin}");
    }

    #[test]
    fn the_launchers_own_unrelated_and_empty_variables_pass() {
        // TANDEM_CACHE and TANDEM_LOG_FORMAT are `tandem up` flags, handed on as flags.
        let shell = vars(&[
            ("HOME", "/home/u"),
            ("TANDEM_CACHE", "/var/cache/tandem"),
            ("TANDEM_LOG_FORMAT", "json"),
            ("TANDEM_BIN_DIR", "/opt/tandem"),
            ("TANDEM_E2E_NO_BUILD", "1"),
            ("TANDEM_THREADS", ""),
        ]);
        refuse_shell_settings(shell.clone(), true).unwrap();
        assert_eq!(inherited(shell), vars(&[("HOME", "/home/u")]));
    }

    #[test]
    fn the_plan_names_the_key_of_each_variable() {
        let keys = FileKeys::probe();
        let advice = |var: &str| keys.advice(var).unwrap_or_else(|| format!("{var}: none"));
        for (var, want) in [
            ("TANDEM_MODEL", "set `name` in the file's [model] section"),
            (
                "TANDEM_KV_DTYPE",
                "set `kv_dtype` in the file's [model] section",
            ),
            (
                "TANDEM_KV_BUDGET_MB",
                "set `kv_budget_mb` in the file's [[prefill]] and [[decode]] entries",
            ),
            (
                "TANDEM_NO_PREFIX_CACHING",
                "set `prefix_caching` in the file's [[prefill]] and [[decode]] entries",
            ),
            (
                "TANDEM_KV_TCP_PORT",
                "set `kv_tcp_port` or `port` in the file's [[decode]] entries",
            ),
            (
                "TANDEM_DEVICE",
                "set `gpu`, `mps_thread_percentage` or `green_context_sms` in the file's [[prefill]] and [[decode]] entries",
            ),
            (
                "TANDEM_ROUTER_TRANSPORT",
                "set `transport` in the file's [router] section",
            ),
            (
                "TANDEM_ROUTER_PREFILL",
                "set `host` or `port` in the file's [[prefill]] entries",
            ),
            (
                "TANDEM_INTERNAL_SECRET",
                "set `secret_file` or `insecure` in the file's [security] section",
            ),
            (
                "TANDEM_INTERNAL_TLS_KEY",
                "set `tls_ca`, `tls_cert` and `tls_key` in the file's [security] section",
            ),
        ] {
            assert_eq!(advice(var), want, "{var}");
        }
        assert_eq!(keys.advice("TANDEM_ISA"), None);
        assert_eq!(keys.advice("TANDEM_ROUTER_MAX_CONNECTIONS"), None);
    }

    /// Every flag a plan writes for the router or a worker has a file key, unless the launcher
    /// sets it from its own flags: no setting is reachable only through an `env` table.
    #[test]
    fn every_flag_the_plan_writes_has_a_file_key() {
        let known = ProcessVariables::read();
        let keys = FileKeys::probe();
        let mut cfg = DeployConfig::from_toml(
            "[model]\nname = \"tiny\"\nweights = \"q8_0\"\nkv_dtype = \"bf16\"\ntokenizer = \"t.json\"\n[router]\nrouting = \"load\"\n[gpu]\ncount = 1\nsms = 132\n[[prefill]]\nport = 7101\ngreen_context_sms = 8\nprefix_caching = false\nmax_running = 4\nmax_batch_tokens = 64\n[[decode]]\nport = 7201\nhost = \"0.0.0.0\"\ngpu = 0\nthreads = 2\nkv_budget_mb = 16\n",
        )
        .unwrap();
        cfg.model.cache_dir = Some("/c".into());
        cfg.log_format = tandem_cli::LogFormat::Json;
        for p in plan(&cfg).unwrap().processes {
            let command = ProcessVariables::command(p.role);
            for long in flags(&p.args).keys() {
                let arg = command
                    .get_arguments()
                    .find(|a| a.get_long() == Some(*long))
                    .unwrap();
                let var = arg.get_env().unwrap().to_string_lossy().into_owned();
                assert!(
                    known.launcher.contains(&var) || keys.advice(&var).is_some(),
                    "{}: --{long} ({var}) has no file key",
                    p.name
                );
            }
        }
    }

    /// The key the refusal names is the one that sets the variable: written in the file, it
    /// reaches the worker's command line.
    #[test]
    fn the_named_key_reaches_the_workers() {
        let err = refuse_shell_settings(vars(&[("TANDEM_WEIGHTS", "f32")]), true).unwrap_err();
        assert!(err.advice[0].contains("`weights` in the file's [model] section"));
        let cfg = DeployConfig::from_toml(
            "[model]\nweights = \"f32\"\n[[prefill]]\nport = 7101\n[[decode]]\nport = 7201\n",
        )
        .unwrap();
        for p in plan(&cfg).unwrap().processes {
            let mut line = vec![p.binary];
            line.extend(p.args.iter().map(String::as_str));
            match p.role {
                Role::Prefill => assert_eq!(
                    parse_without_env::<PrefillArgs>(&line)
                        .unwrap()
                        .model
                        .weights,
                    "f32"
                ),
                Role::Decode => assert_eq!(
                    parse_without_env::<DecodeArgs>(&line)
                        .unwrap()
                        .model
                        .weights,
                    "f32"
                ),
                Role::Router => {}
            }
        }
    }

    #[test]
    fn an_env_table_may_not_set_what_a_key_sets() {
        let with = |table: &str| {
            DeployConfig::from_toml(&format!("[[decode]]\nport = 7201\n[decode.env]\n{table}\n"))
                .unwrap()
        };
        let err = check_env_tables(&with("TANDEM_WEIGHTS = \"f32\""))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "decode[0].env sets TANDEM_WEIGHTS: set `weights` in the file's [model] section instead"
        );
        let err = check_env_tables(&with("TANDEM_INTERNAL_SECRET_FILE = \"/s\""))
            .unwrap_err()
            .to_string();
        assert!(err.contains("`secret_file`"), "{err}");
        let err = check_env_tables(&with("TANDEM_MAX_RUNNING = \"3\""))
            .unwrap_err()
            .to_string();
        assert!(
            err.ends_with("set `max_running` in the file's [[decode]] entries instead"),
            "the table's own section: {err}"
        );
        // What no key sets is the env table's to set.
        check_env_tables(&with("TANDEM_ISA = \"avx2\"\nRUST_LOG = \"debug\"")).unwrap();
    }
}
