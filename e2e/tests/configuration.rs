//! docs/configuration.md is the binaries' own flag definitions, rendered: this test renders
//! them again and compares, so the page cannot drift from the code. It also holds every
//! `TANDEM_*` name in the repository (code, scripts, docs, manifests) to one of two lists: the
//! variables the binaries read through their flags, and the few read elsewhere, which the
//! page's preamble lists by hand. A variable named somewhere that nothing reads fails it.
//!
//! After changing a flag: `TANDEM_BLESS=1 cargo test -p tandem-e2e --test configuration`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use clap::{Command, CommandFactory};
use tandem_cli::reference::{env_names, render};

const MARKER: &str = "<!-- Everything below is generated from the binaries' flag definitions \
                      by e2e/tests/configuration.rs: do not edit it by hand. -->";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn commands() -> Vec<Command> {
    vec![
        tandem_deploy::cli::Cli::command(),
        tandem_cli::RouterArgs::command(),
        tandem_cli::PrefillArgs::command(),
        tandem_cli::DecodeArgs::command(),
        tandem_bench::cli::BenchArgs::command(),
    ]
}

#[test]
fn the_configuration_page_is_the_flags_rendered() {
    let path = root().join("docs/configuration.md");
    let page = std::fs::read_to_string(&path).expect("docs/configuration.md");
    let (preamble, _) = page.split_once(MARKER).expect("the page's marker line");
    let want = render(&format!("{preamble}{MARKER}\n"), &commands());
    if std::env::var_os("TANDEM_BLESS").is_some() {
        std::fs::write(&path, &want).expect("write");
        return;
    }
    assert!(
        page == want,
        "docs/configuration.md is out of date with the flags: run \
         `TANDEM_BLESS=1 cargo test -p tandem-e2e --test configuration` and commit it"
    );
}

/// Files whose text may name variables, skipping build output and caches.
fn text_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if !matches!(
                name.as_str(),
                "target" | ".git" | ".cache" | ".gpu-build" | "node_modules"
            ) {
                text_files(&path, out);
            }
        } else if [
            ".rs", ".md", ".sh", ".py", ".toml", ".yaml", ".yml", ".cpp", ".h",
        ]
        .iter()
        .any(|ext| name.ends_with(ext))
            || path
                .parent()
                .and_then(|p| p.file_name())
                .is_some_and(|d| d == "scripts" || d == ".ci")
        {
            out.push(path);
        }
    }
}

/// `TANDEM_[A-Z0-9_]+` tokens of `text` (a trailing `_` marks a prefix, not a name).
fn names_in(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("TANDEM_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        let preceded_by_word = rest[..i]
            .chars()
            .last()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        if !preceded_by_word && !name.ends_with('_') {
            out.push(name.to_string());
        }
        rest = &tail[end.max(1)..];
    }
    out
}

#[test]
fn every_variable_named_anywhere_is_read_somewhere() {
    let page = std::fs::read_to_string(root().join("docs/configuration.md")).expect("page");
    let (preamble, _) = page.split_once(MARKER).expect("marker");
    let mut known: BTreeSet<String> = commands().iter().flat_map(env_names).collect();
    // The preamble's table of variables read outside the flags.
    known.extend(
        preamble
            .lines()
            .filter(|l| l.starts_with("| `TANDEM_"))
            .flat_map(names_in),
    );
    let mut files = Vec::new();
    text_files(&root(), &mut files);
    let mut unknown = BTreeSet::new();
    for f in files {
        let Ok(text) = std::fs::read_to_string(&f) else {
            continue;
        };
        for name in names_in(&text) {
            if !known.contains(&name) {
                unknown.insert(format!(
                    "{name} ({})",
                    f.strip_prefix(root()).unwrap_or(&f).display()
                ));
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "named but read by no flag and not in docs/configuration.md's table: {unknown:#?}"
    );
}

/// The Kubernetes manifests configure each binary through the variables its flags read.
#[test]
fn kubernetes_manifests_set_only_variables_their_binary_reads() {
    for (file, command) in [
        ("router.yaml", tandem_cli::RouterArgs::command()),
        ("prefill.yaml", tandem_cli::PrefillArgs::command()),
        ("decode.yaml", tandem_cli::DecodeArgs::command()),
    ] {
        let text = std::fs::read_to_string(root().join("deploy/k8s").join(file)).expect(file);
        let reads: BTreeSet<String> = env_names(&command).into_iter().collect();
        for name in names_in(&text) {
            assert!(
                reads.contains(&name),
                "{file} sets {name}, which its binary does not read"
            );
        }
    }
}
