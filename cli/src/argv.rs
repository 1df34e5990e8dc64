//! Typed arguments back to a command line, for the launcher: it fills the very structures a
//! binary parses and [`to_args`] writes the flags, named by the binary's own clap definition.
//! No flag name is spelled anywhere else.
//!
//! The mapping goes through serde: each clap argument's id is its field's name, so the
//! serialized fields (flattened groups included) are looked up by id. Only values that differ
//! from the binary's defaults are written, so a command line says what the deployment chose.
//! Secret fields are never serialized ([`crate::InternalAuthArgs`] skips the secret): the
//! launcher passes secrets in the environment.

use std::collections::BTreeMap;

use clap::{ArgAction, CommandFactory, FromArgMatches};
use serde::Serialize;
use serde_json::Value;

/// Parses `args` (the binary name first) as `T`, ignoring every environment variable: what a
/// command line alone says, whatever the caller's environment holds.
pub fn parse_without_env<T: CommandFactory + FromArgMatches>(
    args: &[&str],
) -> Result<T, clap::Error> {
    let command = T::command().mut_args(|a| a.env(None));
    let matches = command.try_get_matches_from(args)?;
    T::from_arg_matches(&matches)
}

/// `T` with every default and nothing from the environment.
///
/// # Panics
/// If `T` has a required argument (none of tandem's binaries does; a test checks each).
pub fn defaults<T: CommandFactory + FromArgMatches>() -> T {
    let name = T::command().get_name().to_string();
    parse_without_env(&[name.as_str()]).unwrap_or_else(|e| {
        panic!("{name} cannot be built from its defaults alone: {e}");
    })
}

/// The flags that make `T`'s parser produce `value` (with no environment): every argument
/// whose value differs from its default, in the order the binary declares them.
pub fn to_args<T>(value: &T) -> Vec<String>
where
    T: Serialize + CommandFactory + FromArgMatches,
{
    let wanted = leaves(value);
    let default = leaves(&defaults::<T>());
    let command = T::command();
    let mut out = Vec::new();
    for arg in command.get_arguments() {
        let id = arg.get_id().as_str();
        let (Some(long), Some(v)) = (arg.get_long(), wanted.get(id)) else {
            continue;
        };
        if default.get(id) == Some(v) || v.is_null() {
            continue;
        }
        let flag = format!("--{long}");
        match (arg.get_action(), v) {
            (ArgAction::SetTrue, Value::Bool(true)) => out.push(flag),
            (ArgAction::SetTrue, _) => {}
            (_, Value::Array(items)) => match arg.get_value_delimiter() {
                Some(d) => out.extend([flag, join(items, d)]),
                None => {
                    for item in items {
                        out.extend([flag.clone(), scalar(item)]);
                    }
                }
            },
            (_, v) => out.extend([flag, scalar(v)]),
        }
    }
    out
}

/// Every serialized field of `value`, nested groups flattened, by name.
fn leaves<T: Serialize>(value: &T) -> BTreeMap<String, Value> {
    fn walk(v: Value, out: &mut BTreeMap<String, Value>) {
        if let Value::Object(fields) = v {
            for (k, v) in fields {
                match v {
                    Value::Object(_) => walk(v, out),
                    v => {
                        out.insert(k, v);
                    }
                }
            }
        }
    }
    let mut out = BTreeMap::new();
    // Argument structures are plain data: serializing one cannot fail.
    if let Ok(v) = serde_json::to_value(value) {
        walk(v, &mut out);
    }
    out
}

fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn join(items: &[Value], delimiter: char) -> String {
    items
        .iter()
        .map(scalar)
        .collect::<Vec<_>>()
        .join(&delimiter.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DecodeArgs, FallbackPolicy, LogFormat, PrefillArgs, RouterArgs, TransportArg};

    /// Every field set to something other than its default comes back from the command line
    /// `to_args` writes, for each binary.
    #[test]
    fn command_lines_round_trip_for_every_binary() {
        let mut prefill: PrefillArgs = defaults();
        prefill.model.model = "tiny".into();
        prefill.model.tokenizer = Some("/models/tok.json".into());
        prefill.engine.threads = Some(3);
        prefill.engine.kv_budget_mb = 77;
        prefill.engine.isa = Some("avx2".into());
        prefill.engine.compute = "exact".into();
        prefill.server.port = Some(7101);
        prefill.server.log.log_format = LogFormat::Json;
        prefill.server.auth.insecure_no_internal_auth = true;
        prefill.drain_timeout_s = 5;
        let argv = to_args(&prefill);
        let mut line = vec!["tandem-prefill"];
        line.extend(argv.iter().map(String::as_str));
        assert_eq!(
            parse_without_env::<PrefillArgs>(&line).unwrap(),
            prefill,
            "{argv:?}"
        );
        assert!(argv.contains(&"--log-format".into()) && argv.contains(&"json".into()));

        let mut decode: DecodeArgs = defaults();
        decode.kv_tcp_port = 7202;
        decode.no_shm = true;
        decode.caller_lease_share = 0.5;
        decode.engine.device = "cuda".into();
        decode.server.worker_id = Some("decode-0".into());
        let argv = to_args(&decode);
        let mut line = vec!["tandem-decode"];
        line.extend(argv.iter().map(String::as_str));
        assert_eq!(
            parse_without_env::<DecodeArgs>(&line).unwrap(),
            decode,
            "{argv:?}"
        );

        let mut router: RouterArgs = defaults();
        router.port = Some(8001);
        router.prefill = vec!["http://a:1".into(), "http://b:2".into()];
        router.decode = vec!["http://c:3".into()];
        router.transport = Some(TransportArg::CudaIpc);
        router.fallback = Some(FallbackPolicy::Error);
        router.routing = Some(crate::RoutingPolicy::RoundRobin);
        router.kv_overlap_weight = Some(0.5);
        router.agg_threshold = Some(0);
        let argv = to_args(&router);
        assert!(
            argv.windows(2)
                .any(|w| w == ["--prefill", "http://a:1,http://b:2"]),
            "{argv:?}"
        );
        let mut line = vec!["tandem-router"];
        line.extend(argv.iter().map(String::as_str));
        assert_eq!(
            parse_without_env::<RouterArgs>(&line).unwrap(),
            router,
            "{argv:?}"
        );
    }

    #[test]
    fn defaults_write_nothing_and_secrets_never_travel() {
        assert!(to_args(&defaults::<PrefillArgs>()).is_empty());
        assert!(to_args(&defaults::<DecodeArgs>()).is_empty());
        assert!(to_args(&defaults::<RouterArgs>()).is_empty());
        let mut router: RouterArgs = defaults();
        router.api_key = Some("k".repeat(40));
        router.internal.internal_secret = Some("s".repeat(40));
        let mut worker: DecodeArgs = defaults();
        worker.server.auth.internal_secret = Some("s".repeat(40));
        let line = format!("{:?} {:?}", to_args(&router), to_args(&worker));
        assert!(!line.contains("kkkk") && !line.contains("ssss"), "{line}");
    }
}
