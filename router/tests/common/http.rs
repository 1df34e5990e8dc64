//! The tests' client side: an HTTP client with a bounded timeout, the requests most tests
//! send, and readers of what comes back (headers, SSE payloads, `/metrics` series).

use std::time::Duration;

use serde_json::{Value, json};

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .expect("client")
}

pub async fn post(url: &str, path: &str, body: Value) -> reqwest::Response {
    client()
        .post(format!("{url}{path}"))
        .json(&body)
        .send()
        .await
        .expect("request")
}

pub async fn get(url: &str, path: &str) -> reqwest::Response {
    client()
        .get(format!("{url}{path}"))
        .send()
        .await
        .expect("request")
}

/// `GET` of a JSON body.
pub async fn get_json(url: &str, path: &str) -> Value {
    get(url, path).await.json().await.expect("a JSON body")
}

/// `POST /v1/completions` of "Hello" for `max_tokens` tokens: what most tests send.
pub async fn complete(url: &str, max_tokens: u32) -> reqwest::Response {
    post(
        url,
        "/v1/completions",
        json!({"prompt": "Hello", "max_tokens": max_tokens}),
    )
    .await
}

pub fn header<'a>(r: &'a reqwest::Response, name: &str) -> &'a str {
    r.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

/// The `data` payloads of an SSE body (`data:` with or without a space).
pub fn sse_payloads(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let e = e.trim();
            let rest = e
                .strip_prefix("data:")
                .unwrap_or_else(|| panic!("not a data event: {e:?}"));
            rest.strip_prefix(' ').unwrap_or(rest).to_string()
        })
        .collect()
}

/// The payloads of an SSE body as JSON, but for a final `[DONE]`.
pub fn sse_json(body: &str) -> Vec<Value> {
    let mut events = sse_payloads(body);
    if events.last().is_some_and(|e| e == "[DONE]") {
        events.pop();
    }
    events
        .iter()
        .map(|e| serde_json::from_str(e).unwrap_or_else(|err| panic!("{e:?}: {err}")))
        .collect()
}

/// The value of one series in the router's `/metrics`, or None when the series is absent.
pub async fn series(router_url: &str, name: &str) -> Option<f64> {
    let text = get(router_url, "/metrics").await.text().await.unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
}

/// A counter's value (0 before its first increment).
pub async fn metric_value(router_url: &str, name: &str) -> f64 {
    series(router_url, name).await.unwrap_or(0.0)
}
