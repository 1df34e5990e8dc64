//! Stream parsing per backend against a fake axum server emitting scripted chunks at scripted
//! times: TTFT and ITL time the token events the script says (never sooner than scripted:
//! timing assertions here are lower bounds and counts, which a slow machine cannot break), and
//! usage chunks, `[DONE]`, comment pings, errors mid-stream and non-200 answers are handled as
//! vLLM does.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_bench::backends::{Backend, NO_VALID_CHUNK, RequestInput, Target, send_request};
use tandem_bench::fake_server::{
    FakeServer, ReceivedRequest, ScriptedEvent, ScriptedResponse, chat_chunk, completion_chunk,
    done_chunk, tgi_event, usage_chunk,
};
use tandem_bench::metrics::RequestOutput;
use tokio::io::AsyncWriteExt;

/// Checks a request's timestamps against the script in the only way a slow machine cannot
/// break: the server sleeps at least each scripted delay before writing a chunk, and the
/// client can only see a chunk after it was written, so each token event arrives (counted
/// from the request's start) no sooner than the scripted time of the chunk that completes it.
/// `token_ms` holds those times, one per token event. A slow machine only delays arrivals, so
/// no upper bound holds; the count of token events pins which events were timed. Returns the
/// last token event's arrival (s).
fn assert_not_before(output: &RequestOutput, token_ms: &[u64], what: &str) -> f64 {
    assert_eq!(
        output.itl.len() + 1,
        token_ms.len(),
        "{what}: token events (TTFT and one ITL per later event)"
    );
    let mut arrival = output.ttft;
    for (k, &scripted) in token_ms.iter().enumerate() {
        if k > 0 {
            arrival += output.itl[k - 1];
        }
        assert!(
            arrival >= scripted as f64 / 1000.0,
            "{what}: token event {k} arrived {:.1} ms after the start, before its chunk was written at {scripted} ms",
            arrival * 1000.0
        );
    }
    arrival
}

fn script(status: u16, events: Vec<(u64, String)>) -> ScriptedResponse {
    ScriptedResponse {
        status,
        events: events
            .into_iter()
            .map(|(delay_ms, text)| ScriptedEvent::new(Duration::from_millis(delay_ms), text, 1))
            .collect(),
    }
}

async fn serve(response: ScriptedResponse) -> FakeServer {
    let responder = Arc::new(move |_: &ReceivedRequest| response.clone());
    FakeServer::start(responder)
        .await
        .expect("bind 127.0.0.1:0")
}

fn input() -> RequestInput {
    RequestInput {
        prompt: "w1 w2 w3".into(),
        prompt_len: 4,
        output_len: 3,
        model: "fake-model".into(),
        ignore_eos: false,
        logprobs: None,
        temperature: None,
        extra_body: None,
        request_id: Some("benchmark-serving0".into()),
        messages: None,
    }
}

async fn send(server: &FakeServer, backend: Backend, path: &str) -> RequestOutput {
    let target = Target {
        backend,
        url: format!("{}{path}", server.base_url()),
        headers: Default::default(),
    };
    let client = reqwest::Client::new();
    tokio::time::timeout(
        Duration::from_secs(10),
        send_request(&client, &target, &input(), Instant::now()),
    )
    .await
    .expect("request finished in time")
}

#[tokio::test]
async fn completions_ttft_itl_usage_and_pings_as_scripted() {
    let server = serve(script(
        200,
        vec![
            (100, completion_chunk("w1 ")),
            (20, ": ping\n\n".into()),
            (20, completion_chunk("w2 ")),
            (40, completion_chunk("")),
            (0, usage_chunk(4, 3)),
            (0, done_chunk()),
        ],
    ))
    .await;
    let output = send(&server, Backend::Openai, "/v1/completions").await;
    assert!(output.success, "{}", output.error);
    assert_eq!(output.generated_text, "w1 w2 ");
    assert_eq!(output.output_tokens, Some(3));
    assert_eq!(output.prompt_len, 4);
    // An empty-text chunk is still a token event; the ping is not one, so the second ITL
    // counts from the first token, not from the ping.
    let last = assert_not_before(&output, &[100, 140, 180], "completions");
    assert!(
        (output.latency - last).abs() < 1e-9,
        "latency {} ends at the last token event ({last})",
        output.latency
    );
    let requests = server.requests();
    assert_eq!(requests.len(), 1);
    assert_eq!(requests[0].path, "/v1/completions");
    assert_eq!(
        requests[0].header("x-request-id"),
        Some("benchmark-serving0")
    );
    assert_eq!(requests[0].body["max_tokens"], 3);
    assert_eq!(requests[0].body["stream"], true);
    server.shutdown().await;
}

#[tokio::test]
async fn a_message_split_across_writes_is_timed_when_complete() {
    let chunk = completion_chunk("w1 ");
    let (head, tail) = chunk.split_at(20);
    let server = serve(script(
        200,
        vec![
            (30, head.to_string()),
            (50, tail.to_string()),
            (30, completion_chunk("w2 ")),
            (0, done_chunk()),
        ],
    ))
    .await;
    let output = send(&server, Backend::Openai, "/v1/completions").await;
    assert!(output.success, "{}", output.error);
    // The first token event is timed when its message is complete (80 ms), not at its head.
    assert_not_before(&output, &[80, 110], "split message");
    assert_eq!(output.output_tokens, None, "no usage chunk was sent");
    server.shutdown().await;
}

#[tokio::test]
async fn done_ends_the_stream_even_if_the_server_keeps_it_open() {
    // The late chunk is due long after `send`'s deadline: a client that waited past [DONE]
    // for the stream to end would fail that deadline, however fast or slow the machine.
    let server = serve(script(
        200,
        vec![
            (10, completion_chunk("w1 ")),
            (0, done_chunk()),
            (3_600_000, completion_chunk("late")),
        ],
    ))
    .await;
    let output = send(&server, Backend::Openai, "/v1/completions").await;
    assert!(output.success);
    assert_eq!(output.generated_text, "w1 ");
    assert_eq!(server.stats().tokens, 2, "the late chunk was never written");
    server.shutdown().await;
}

#[tokio::test]
async fn chat_role_chunk_sets_ttft() {
    let role = "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"}}]}\n\n";
    let server = serve(script(
        200,
        vec![
            (60, role.into()),
            (30, chat_chunk("w1 ")),
            (30, chat_chunk("w2 ")),
            (0, usage_chunk(4, 2)),
            (0, done_chunk()),
        ],
    ))
    .await;
    let output = send(&server, Backend::OpenaiChat, "/v1/chat/completions").await;
    assert!(output.success, "{}", output.error);
    // The role-only chunk is the first token event; vLLM's chat client also moves the end
    // of the latency to the usage chunk after the last token.
    let last = assert_not_before(&output, &[60, 90, 120], "chat");
    assert!(output.latency >= last, "latency {}", output.latency);
    assert_eq!(output.generated_text, "w1 w2 ");
    assert_eq!(output.output_tokens, Some(2));
    let body = &server.requests()[0].body;
    assert_eq!(body["messages"][0]["content"][0]["text"], "w1 w2 w3");
    assert_eq!(body["max_completion_tokens"], 3);
    server.shutdown().await;
}

#[tokio::test]
async fn tgi_events_each_count_and_the_last_carries_the_text() {
    let server = serve(script(
        200,
        vec![
            (50, tgi_event(1, "w1 ", None)),
            (0, ":\n\n".into()),
            (25, tgi_event(2, "w2", None)),
            (25, tgi_event(3, "</s>", Some("w1 w2"))),
        ],
    ))
    .await;
    let output = send(&server, Backend::Tgi, "/generate_stream").await;
    assert!(output.success, "{}", output.error);
    assert_eq!(output.generated_text, "w1 w2");
    // The EOS event is a token event too; the comment line is not.
    let last = assert_not_before(&output, &[50, 75, 100], "tgi");
    assert!((output.latency - last).abs() < 1e-9, "{}", output.latency);
    assert_eq!(output.output_tokens, None, "TGI output is re-tokenized");
    let body = &server.requests()[0].body;
    assert_eq!(body["inputs"], "w1 w2 w3");
    assert_eq!(body["parameters"]["max_new_tokens"], 3);
    server.shutdown().await;
}

#[tokio::test]
async fn non_200_answers_fail_with_the_reason_phrase() {
    for (status, reason) in [
        (500, "Internal Server Error"),
        (404, "Not Found"),
        (429, "Too Many Requests"),
    ] {
        let server = serve(script(status, vec![(0, "{\"error\":\"no\"}".into())])).await;
        for (backend, path) in [
            (Backend::Openai, "/v1/completions"),
            (Backend::OpenaiChat, "/v1/chat/completions"),
            (Backend::Tgi, "/generate_stream"),
        ] {
            let output = send(&server, backend, path).await;
            assert!(!output.success);
            assert_eq!(output.error, reason);
        }
        server.shutdown().await;
    }
}

#[tokio::test]
async fn errors_mid_stream_are_handled_as_vllm_does() {
    let error_event =
        "data: {\"error\":{\"message\":\"engine died\",\"code\":500}}\n\n".to_string();
    // After tokens: the error event is ignored and the request counts as a success.
    let server = serve(script(
        200,
        vec![(5, completion_chunk("w1 ")), (5, error_event.clone())],
    ))
    .await;
    let output = send(&server, Backend::Openai, "/v1/completions").await;
    assert!(output.success);
    assert_eq!(output.generated_text, "w1 ");
    server.shutdown().await;
    // Before any token: no TTFT, so vLLM's failure text.
    let server = serve(script(200, vec![(5, error_event), (0, done_chunk())])).await;
    let output = send(&server, Backend::Openai, "/v1/completions").await;
    assert!(!output.success);
    assert_eq!(output.error, NO_VALID_CHUNK);
    server.shutdown().await;
    // Malformed JSON is an exception in vLLM: a failed request, never a panic.
    let server = serve(script(
        200,
        vec![
            (5, completion_chunk("w1 ")),
            (5, "data: {\"choices\": [\n\n".into()),
        ],
    ))
    .await;
    let output = send(&server, Backend::Openai, "/v1/completions").await;
    assert!(!output.success);
    assert!(
        output.error.starts_with("JSONDecodeError"),
        "{}",
        output.error
    );
    server.shutdown().await;
    // TGI error event last: KeyError on generated_text.
    let server = serve(script(
        200,
        vec![
            (5, tgi_event(1, "w1", None)),
            (5, "data:{\"error\":\"overloaded\"}\n\n".into()),
        ],
    ))
    .await;
    let output = send(&server, Backend::Tgi, "/generate_stream").await;
    assert!(!output.success);
    assert!(output.error.contains("generated_text"), "{}", output.error);
    server.shutdown().await;
    // An empty 200 stream.
    let server = serve(script(200, vec![])).await;
    assert_eq!(
        send(&server, Backend::Openai, "/v1/completions")
            .await
            .error,
        NO_VALID_CHUNK
    );
    assert!(
        !send(&server, Backend::Tgi, "/generate_stream")
            .await
            .success
    );
    server.shutdown().await;
}

#[tokio::test]
async fn a_connection_cut_mid_stream_or_refused_fails_the_request() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut buffer = vec![0u8; 65536];
        let _ = tokio::io::AsyncReadExt::read(&mut socket, &mut buffer).await;
        let chunk = completion_chunk("w1 ");
        let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
        let body = format!("{:x}\r\n{chunk}\r\n", chunk.len());
        socket.write_all(head.as_bytes()).await.unwrap();
        socket.write_all(body.as_bytes()).await.unwrap();
        socket.flush().await.unwrap();
        // Close without the terminating zero-length chunk.
    });
    let target = Target {
        backend: Backend::Openai,
        url: format!("http://{addr}/v1/completions"),
        headers: Default::default(),
    };
    let client = reqwest::Client::new();
    let output = send_request(&client, &target, &input(), Instant::now()).await;
    server.await.unwrap();
    assert!(!output.success);
    assert!(!output.error.is_empty());
    // Nobody listening.
    let target = Target {
        url: format!("http://{addr}/v1/completions"),
        ..target
    };
    let output = send_request(&client, &target, &input(), Instant::now()).await;
    assert!(!output.success);
    assert!(
        output.error.starts_with("ClientConnectorError"),
        "{}",
        output.error
    );
}
