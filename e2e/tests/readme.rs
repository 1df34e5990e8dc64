//! The README's examples do what the README shows. This test reads README.md itself, takes
//! every example of its "Try it" section (the curl commands and the Python snippets), runs
//! each against a fresh deployment of the default model started by `tandem up` (as the
//! README's first command does, on free loopback ports), and compares what comes back with
//! the lines the README shows after each:
//!
//! - after a curl command that answers one JSON object, its `#` lines are that object with
//!   parts left out (`...`): every key and value shown must be there, arrays as long as shown;
//! - after a streaming one, each `# data:` line is one server-sent event, in order from the
//!   first; after a `# ... N more ...` line the rest are the last events, and N were skipped;
//! - after a Python snippet, `# prints:` is followed by what it prints, exactly.
//!
//! The examples are greedy, so their answers are reproducible. Changing an answer in the
//! README, or the server's behaviour under it, fails this test. Everything listens on
//! 127.0.0.1, every command runs under a time limit, and the examples are counted.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;
use tandem_e2e::{binary, free_port, tools_python};

/// How long the deployment may take to come up (the first run fetches the model).
const STARTUP: Duration = Duration::from_secs(300);
/// The time limit of each example.
const EXAMPLE: Duration = Duration::from_secs(120);
/// A value the README leaves out (`"key": ...`) matches anything.
const ANY: &str = "\u{0}any";

fn readme() -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../README.md");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A fenced code block of the "Try it" section: its language and lines, and the README line
/// it starts on (for messages).
struct Block {
    lang: String,
    lines: Vec<String>,
    at: usize,
}

fn try_it_blocks(readme: &str) -> Vec<Block> {
    let mut blocks = Vec::new();
    let mut in_section = false;
    let mut open: Option<Block> = None;
    for (i, line) in readme.lines().enumerate() {
        if open.is_none() && line.starts_with("## ") {
            in_section = line == "## Try it";
            continue;
        }
        if !in_section {
            continue;
        }
        if let Some(fence) = line.strip_prefix("```") {
            match open.take() {
                Some(block) => blocks.push(block),
                None => {
                    open = Some(Block {
                        lang: fence.trim().to_string(),
                        lines: Vec::new(),
                        at: i + 2,
                    })
                }
            }
        } else if let Some(block) = open.as_mut() {
            block.lines.push(line.to_string());
        }
    }
    assert!(
        open.is_none(),
        "README: a code block of \"Try it\" is not closed"
    );
    blocks
}

/// A curl command (its continuation lines joined as the shell would) and the lines shown
/// after it, without their `# `.
struct CurlExample {
    command: String,
    shown: Vec<String>,
    at: usize,
}

fn curl_examples(block: &Block) -> Vec<CurlExample> {
    let mut out: Vec<CurlExample> = Vec::new();
    let mut lines = block.lines.iter().enumerate();
    while let Some((i, line)) = lines.next() {
        let at = block.at + i;
        if line.starts_with("curl ") {
            let mut command = line.clone();
            while command.ends_with('\\') {
                command.pop();
                let (_, next) = lines.next().expect("a continued curl line");
                command.push_str(next.trim_start());
            }
            out.push(CurlExample {
                command,
                shown: Vec::new(),
                at,
            });
        } else if let Some(shown) = line.strip_prefix('#') {
            let example = out
                .last_mut()
                .unwrap_or_else(|| panic!("README:{at}: # before a curl"));
            example.shown.push(shown.trim().to_string());
        } else {
            assert!(
                line.trim().is_empty(),
                "README:{at}: not an example: {line}"
            );
        }
    }
    out
}

/// A Python snippet and what the README says it prints.
struct PythonExample {
    code: String,
    prints: String,
    at: usize,
}

fn python_example(block: &Block) -> PythonExample {
    let marker = block
        .lines
        .iter()
        .position(|l| l.starts_with("# prints:"))
        .unwrap_or_else(|| panic!("README:{}: a Python example without `# prints:`", block.at));
    let mut prints: Vec<&str> = Vec::new();
    let first = block.lines[marker]["# prints:".len()..].trim();
    if !first.is_empty() {
        prints.push(first);
    }
    for line in &block.lines[marker + 1..] {
        let shown = line
            .strip_prefix("# ")
            .unwrap_or_else(|| panic!("README:{}: after `# prints:` only `# ` lines", block.at));
        prints.push(shown);
    }
    PythonExample {
        code: block.lines[..marker].join("\n"),
        prints: prints.join("\n"),
        at: block.at,
    }
}

/// The README's shorthand as JSON: a left-out value (`"key": ...`) becomes [`ANY`], and a
/// left-out member or element (`{..., "a": 1}`, `{"a": 1, ...}`) disappears with its comma.
fn pattern(shown: &str) -> Value {
    let chars: Vec<char> = shown.chars().collect();
    let mut out = String::new();
    let (mut i, mut in_string, mut escaped) = (0, false, false);
    while i < chars.len() {
        let c = chars[i];
        if in_string {
            out.push(c);
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
            i += 1;
        } else if chars[i..].starts_with(&['.', '.', '.']) {
            i += 3;
            match out.trim_end().chars().last() {
                Some(':') => out.push_str("\"\\u0000any\""),
                Some(',') => out.truncate(out.trim_end().len() - 1),
                _ => {
                    while chars.get(i).is_some_and(|c| c.is_whitespace()) {
                        i += 1;
                    }
                    if chars.get(i) == Some(&',') {
                        i += 1;
                    }
                }
            }
        } else {
            in_string = c == '"';
            out.push(c);
            i += 1;
        }
    }
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON with `...`: {shown}\n({e})"))
}

/// Whether `actual` has everything `pattern` shows; else where it differs.
fn check(pattern: &Value, actual: &Value, path: &str) -> Result<(), String> {
    match (pattern, actual) {
        (Value::String(s), _) if s == ANY => Ok(()),
        (Value::Object(want), Value::Object(got)) => want.iter().try_for_each(|(k, v)| {
            let at = format!("{path}.{k}");
            match got.get(k) {
                Some(g) => check(v, g, &at),
                None => Err(format!("{at}: missing")),
            }
        }),
        (Value::Array(want), Value::Array(got)) if want.len() == got.len() => want
            .iter()
            .zip(got)
            .enumerate()
            .try_for_each(|(i, (w, g))| check(w, g, &format!("{path}[{i}]"))),
        _ if pattern == actual => Ok(()),
        _ => Err(format!(
            "{path}: the README shows {pattern}, the server sent {actual}"
        )),
    }
}

/// Runs `cmd` with its output captured, killing it at `limit`.
fn run(mut cmd: Command, limit: Duration) -> (bool, String, String) {
    let mut child = cmd
        .env("NO_PROXY", "*")
        .env("no_proxy", "*")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let read = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        })
    };
    let stdout = read(Box::new(child.stdout.take().unwrap()));
    let stderr = read(Box::new(child.stderr.take().unwrap()));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("still running after {limit:?}: {cmd:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (
        status.success(),
        stdout.join().unwrap(),
        stderr.join().unwrap(),
    )
}

/// `tandem up` on a file that differs from the built-in deployment only in its ports, thread
/// counts and KV budgets; stopped with SIGTERM when dropped (the workers then remove their
/// shared-memory files).
struct Up {
    child: Child,
    port: u16,
    stderr: mpsc::Receiver<String>,
    _dir: tempfile::TempDir,
}

impl Up {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (router, prefill, decode, kv) = (free_port(), free_port(), free_port(), free_port());
        let file = format!(
            "[model]\nname = \"smollm2\"\n[router]\nhost = \"127.0.0.1\"\nport = {router}\n\
             [[prefill]]\nport = {prefill}\nthreads = 1\nkv_budget_mb = 64\n\
             [[decode]]\nport = {decode}\nkv_tcp_port = {kv}\nthreads = 1\nkv_budget_mb = 64\n"
        );
        let path = dir.path().join("readme.toml");
        std::fs::write(&path, file).unwrap();
        let bin = binary("tandem").unwrap();
        let mut cmd = Command::new(&bin);
        // As from a clean shell: `tandem up` refuses worker settings in its environment.
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("TANDEM_") && k != "TANDEM_CACHE" {
                cmd.env_remove(k);
            }
        }
        let mut child = cmd
            .arg("up")
            .arg(&path)
            .arg("--bin-dir")
            .arg(bin.parent().unwrap())
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, stderr) = mpsc::channel();
        let err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let (up_tx, up_rx) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if line.starts_with("tandem is up") {
                    let _ = up_tx.send(());
                }
            }
        });
        let mut up = Self {
            child,
            port: router,
            stderr,
            _dir: dir,
        };
        if up_rx.recv_timeout(STARTUP).is_err() {
            let log: Vec<String> = up.stderr.try_iter().collect();
            let _ = up.child.kill();
            panic!(
                "tandem up did not come up within {STARTUP:?}:\n{}",
                log.join("\n")
            );
        }
        up
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The README's address, made this deployment's.
fn here(text: &str, port: u16, at: usize) -> String {
    assert!(
        text.contains("localhost:8000"),
        "README:{at}: the example does not go to localhost:8000"
    );
    text.replace("localhost:8000", &format!("127.0.0.1:{port}"))
}

/// Runs a curl example; its output as text.
fn curl(example: &CurlExample, port: u16) -> String {
    let command = here(&example.command, port, example.at).replacen(
        "curl ",
        &format!("curl --max-time {} ", EXAMPLE.as_secs()),
        1,
    );
    let mut cmd = Command::new("bash");
    cmd.args(["-c", &command]);
    let (ok, out, err) = run(cmd, EXAMPLE + Duration::from_secs(5));
    assert!(ok, "README:{}: {command}\n{err}", example.at);
    out
}

/// Compares one curl example's output with what the README shows after it.
fn check_curl(example: &CurlExample, out: &str) {
    let at = example.at;
    assert!(!example.shown.is_empty(), "README:{at}: shows no output");
    if !example.shown.iter().any(|l| l.starts_with("data:")) {
        let got: Value = serde_json::from_str(out)
            .unwrap_or_else(|e| panic!("README:{at}: the answer is not JSON ({e}): {out}"));
        let want = pattern(&example.shown.join(" "));
        if let Err(diff) = check(&want, &got, "") {
            panic!("README:{at}: {diff}\nthe whole answer: {got}");
        }
        return;
    }
    let events: Vec<&str> = out
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(str::trim)
        .collect();
    let gap = example.shown.iter().position(|l| l.starts_with("..."));
    let (head, tail) = match gap {
        Some(g) => (&example.shown[..g], &example.shown[g + 1..]),
        None => (&example.shown[..], &example.shown[..0]),
    };
    let shown = head.len() + tail.len();
    match gap {
        None => assert_eq!(events.len(), shown, "README:{at}: events: {out}"),
        Some(g) => {
            let skipped = events.len().checked_sub(shown).unwrap_or_else(|| {
                panic!(
                    "README:{at}: {} events, fewer than shown: {out}",
                    events.len()
                )
            });
            let line = &example.shown[g];
            if let Some(n) = line
                .split_whitespace()
                .zip(line.split_whitespace().skip(1))
                .find(|(_, more)| *more == "more" || more.starts_with("more,"))
                .and_then(|(n, _)| n.parse::<usize>().ok())
            {
                assert_eq!(
                    skipped, n,
                    "README:{at}: `{line}`, but {skipped} were: {out}"
                );
            }
        }
    }
    let pairs = head
        .iter()
        .zip(&events)
        .chain(tail.iter().rev().zip(events.iter().rev()));
    for (shown, event) in pairs {
        let shown = shown.strip_prefix("data:").unwrap_or_else(|| {
            panic!("README:{at}: a stream's lines are `# data:` or one `# ...`: {shown}")
        });
        let shown = shown.trim();
        if shown == "[DONE]" || *event == "[DONE]" {
            assert_eq!(shown, *event, "README:{at}");
            continue;
        }
        let got: Value = serde_json::from_str(event)
            .unwrap_or_else(|e| panic!("README:{at}: an event is not JSON ({e}): {event}"));
        if let Err(diff) = check(&pattern(shown), &got, "") {
            panic!("README:{at}: {diff}\nthe event: {got}");
        }
    }
}

fn check_python(python: &Path, example: &PythonExample, port: u16) {
    let code = here(&example.code, port, example.at);
    let mut cmd = Command::new(python);
    cmd.args(["-c", &code]);
    let (ok, out, err) = run(cmd, EXAMPLE);
    assert!(ok, "README:{}: the snippet failed:\n{err}", example.at);
    assert_eq!(
        out.trim_end_matches('\n'),
        example.prints,
        "README:{}: what the snippet prints",
        example.at
    );
}

/// The README says what asking the first example again shows: the decode worker's prefix
/// cache held this many of its prompt tokens, and one block moved.
fn check_asked_again(readme: &str, first: &CurlExample, port: u16) {
    let claim = "`usage.tandem.decode_cached_tokens` says ";
    let start = readme
        .find(claim)
        .expect("README: the sentence on asking again")
        + claim.len();
    let held: u64 = readme[start..]
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|n| n.parse().ok())
        .expect("a number of tokens");
    let again: Value = serde_json::from_str(&curl(first, port)).unwrap();
    let tandem = &again["usage"]["tandem"];
    assert_eq!(tandem["decode_cached_tokens"], held, "asked again: {again}");
    assert_eq!(
        tandem["kv_blocks"], 1,
        "asked again, only the last block moves: {again}"
    );
}

#[test]
fn the_readme_examples_print_what_the_readme_shows() {
    let readme = readme();
    let blocks = try_it_blocks(&readme);
    let curls: Vec<CurlExample> = blocks
        .iter()
        .filter(|b| b.lang.is_empty())
        .flat_map(curl_examples)
        .collect();
    let pythons: Vec<PythonExample> = blocks
        .iter()
        .filter(|b| b.lang == "python")
        .map(python_example)
        .collect();
    for b in &blocks {
        assert!(
            b.lang.is_empty() || b.lang == "python",
            "README:{}: a `{}` block in \"Try it\" that this test cannot run",
            b.at,
            b.lang
        );
    }
    // A README that lost its examples must not pass quietly; nor may this test run long.
    assert!(
        (3..=8).contains(&curls.len()) && (2..=4).contains(&pythons.len()),
        "README \"Try it\": {} curl and {} Python examples",
        curls.len(),
        pythons.len()
    );
    let python = tools_python(&["openai", "text_generation"]);

    let up = Up::start();
    // The first example runs first on the fresh deployment: its KV numbers assume no cache.
    for (i, example) in curls.iter().enumerate() {
        let out = curl(example, up.port);
        check_curl(example, &out);
        if i == 0 {
            check_asked_again(&readme, example, up.port);
        }
    }
    for example in &pythons {
        check_python(&python, example, up.port);
    }
}

#[test]
fn the_readme_shorthand_is_checked_strictly() {
    let got: Value = serde_json::json!({
        "id": "x", "choices": [{"index": 0, "message": {"content": "Paris."}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "tandem": {"mode": "disaggregated", "kv_bytes": 10}}
    });
    let ok = r#"{..., "choices": [{..., "message": {"content": "Paris."}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, ..., "tandem": {"mode": "disaggregated", "kv_bytes": ...}}}"#;
    assert_eq!(check(&pattern(ok), &got, ""), Ok(()));
    for wrong in [
        r#"{..., "choices": [{"message": {"content": "Lyon."}}]}"#,
        r#"{"usage": {"tandem": {"kv_bytes": 11}}, ...}"#,
        r#"{"choices": [], ...}"#,
        r#"{"model": ..., ...}"#,
    ] {
        assert!(check(&pattern(wrong), &got, "").is_err(), "{wrong}");
    }
    // `...` inside a string is text, not an ellipsis.
    assert_eq!(
        pattern(r#"{"a": "x...y", ...}"#),
        serde_json::json!({"a": "x...y"})
    );
}
