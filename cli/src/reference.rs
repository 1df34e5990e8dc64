//! The configuration reference, rendered from the binaries' clap definitions: one section per
//! command (subcommands included), one row per flag with its environment variable, default
//! and help. `docs/configuration.md` is this output; a test renders it again and compares, so
//! the page cannot drift from the flags.

use std::fmt::Write;

use clap::Command;

/// Markdown for `commands`, each under a `##` heading, after `preamble`.
pub fn render(preamble: &str, commands: &[Command]) -> String {
    let mut out = String::from(preamble.trim_end());
    out.push('\n');
    for command in commands {
        section(&mut out, command, command.get_name());
    }
    out
}

/// Every environment variable `command` (and its subcommands) reads through a flag.
pub fn env_names(command: &Command) -> Vec<String> {
    let mut out: Vec<String> = command
        .get_arguments()
        .filter_map(|a| a.get_env())
        .map(|e| e.to_string_lossy().into_owned())
        .collect();
    for sub in command.get_subcommands() {
        out.extend(env_names(sub));
    }
    out.sort();
    out.dedup();
    out
}

fn section(out: &mut String, command: &Command, path: &str) {
    let args: Vec<_> = command
        .get_arguments()
        .filter(|a| !matches!(a.get_id().as_str(), "help" | "version"))
        // Hidden arguments are listed only where the environment is their way in.
        .filter(|a| !a.is_hide_set() || a.get_env().is_some())
        .collect();
    let _ = writeln!(out, "\n## `{path}`\n");
    if let Some(about) = command.get_about() {
        let about = one_line(&about.to_string());
        let stop = if about.ends_with('.') { "" } else { "." };
        let _ = writeln!(out, "{about}{stop}\n");
    }
    if !args.is_empty() {
        out.push_str("| flag | environment | default | meaning |\n| --- | --- | --- | --- |\n");
        for a in args {
            let flag = match (a.get_long(), a.is_positional()) {
                (_, true) => format!("`<{}>`", a.get_id().as_str().to_uppercase()),
                (Some(_), false) if a.is_hide_set() => "(environment only)".to_string(),
                (Some(long), false) => match a.get_action().takes_values() {
                    true => format!("`--{long} <{}>`", value_name(a)),
                    false => format!("`--{long}`"),
                },
                (None, false) => String::new(),
            };
            let env = a
                .get_env()
                .map(|e| format!("`{}`", e.to_string_lossy()))
                .unwrap_or_default();
            let default = a
                .get_default_values()
                .iter()
                .map(|v| format!("`{}`", v.to_string_lossy()))
                .collect::<Vec<_>>()
                .join(", ");
            let mut help = a
                .get_help()
                .map(|h| one_line(&h.to_string()))
                .unwrap_or_default();
            let values: Vec<String> = a
                .get_possible_values()
                .iter()
                .filter(|v| !v.is_hide_set())
                .map(|v| format!("`{}`", v.get_name()))
                .collect();
            if !help.is_empty() && !help.ends_with('.') {
                help.push('.');
            }
            if !values.is_empty() && a.get_action().takes_values() {
                let _ = write!(help, " One of {}.", values.join(", "));
            }
            let _ = writeln!(
                out,
                "| {flag} | {env} | {default} | {} |",
                help.replace('|', "\\|")
            );
        }
    }
    for sub in command.get_subcommands() {
        if sub.get_name() != "help" {
            section(out, sub, &format!("{path} {}", sub.get_name()));
        }
    }
}

fn value_name(a: &clap::Arg) -> String {
    a.get_value_names()
        .and_then(|n| n.first())
        .map_or_else(|| a.get_id().as_str().to_uppercase(), |n| n.to_string())
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn rows_carry_flag_environment_default_and_values() {
        let page = render("# Reference", &[crate::PrefillArgs::command()]);
        assert!(
            page.starts_with("# Reference\n\n## `tandem-prefill`"),
            "{page}"
        );
        assert!(
            page.contains("| `--model <MODEL>` | `TANDEM_MODEL` | `smollm2` |"),
            "{page}"
        );
        assert!(page.contains("| `--log-format <LOG_FORMAT>` | `TANDEM_LOG_FORMAT` | `text` |"));
        assert!(page.contains("One of `text`, `json`."));
        // The secret has no flag anyone should use: it shows as environment only.
        assert!(
            page.contains("| (environment only) | `TANDEM_INTERNAL_SECRET` |"),
            "{page}"
        );
        assert!(env_names(&crate::PrefillArgs::command()).contains(&"TANDEM_ISA".to_string()));
    }
}
