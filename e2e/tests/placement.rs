//! SLO placement on a real deployment (`--placement slo`): every request's tokens and
//! logprobs are what the aggregated engine gives whatever placement it got; the workers
//! report fitted cost models; the router exports its targets, placements, prediction errors
//! and SLO attainment, says what it learned in `/info`, and takes per-request targets from
//! headers (refusing bad ones with the header's name); with room in the TTFT target, prompts
//! are split between the prefill and the decode worker, token for token the same.

use std::time::Duration;

use futures::StreamExt;
use serde_json::{Value, json};
use tandem_e2e::{Completion, Deployment, DeploymentSpec, greedy_completion};
use tandem_proto::v1::LoadRequest;
use tandem_proto::v1::decode_service_client::DecodeServiceClient;
use tandem_proto::v1::prefill_service_client::PrefillServiceClient;

/// Prompts of 1 to 300 tokens, as token ids.
fn prompts(n: u32) -> Vec<Vec<u32>> {
    (0..n)
        .map(|i| {
            let len = 1 + (i * 53 + i * i * 7) % 300;
            (0..len).map(|j| 3 + (i * 97 + j * 13) % 250).collect()
        })
        .collect()
}

async fn run_all(base: &str, prompts: &[Vec<u32>], concurrency: usize) -> Vec<Completion> {
    let client = reqwest::Client::new();
    futures::stream::iter(
        prompts
            .iter()
            .map(|p| async { greedy_completion(&client, base, p, 12).await.unwrap() }),
    )
    .buffered(concurrency)
    .collect()
    .await
}

/// The sum of a family's series on `/metrics` whose labels contain every one of `labels`.
fn metric_sum(text: &str, family: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let name = series.split('{').next()?;
            (name == family && labels.iter().all(|want| series.contains(want)))
                .then(|| value.parse::<f64>().ok())
                .flatten()
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slo_placement_keeps_every_token_and_learns_from_its_predictions() {
    // Without prefix caching: the reference run would leave every prompt in the decode
    // worker's cache, and the prefill worker would read them back instead of computing them
    // (its fit would see too few prompt tokens to price one).
    let spec = DeploymentSpec {
        worker_args: vec!["--no-prefix-caching".into()],
        ..DeploymentSpec::default()
    };
    let dep = Deployment::start(&spec).await.unwrap();
    let agg = dep.aggregated_router().await.unwrap();
    let prompts = prompts(24);
    let reference = run_all(&format!("http://127.0.0.1:{}", agg.port), &prompts, 1).await;
    let router = Deployment::router_for(
        &dep.prefill,
        &dep.decode,
        "shm",
        &[
            "--placement".into(),
            "slo".into(),
            "--slo-tpot-ms".into(),
            "40".into(),
        ],
    )
    .unwrap();
    let base = format!("http://127.0.0.1:{}", router.port);
    tandem_e2e::wait_http_ok(&format!("{base}/health"), Duration::from_secs(60))
        .await
        .unwrap();
    // The first round teaches the workers' fits (the static rule places until both have
    // reported one); the second is placed by the targets. Both give the reference's tokens.
    for round in 0..2 {
        let got = run_all(&base, &prompts, 4).await;
        for (i, (got, want)) in got.iter().zip(&reference).enumerate() {
            assert!(
                ["aggregated", "disaggregated"].contains(&got.mode.as_str()),
                "{}",
                got.mode
            );
            assert_eq!(got.text, want.text, "round {round}, prompt {i}");
            assert_eq!(got.logprobs, want.logprobs, "round {round}, prompt {i}");
        }
        // Two load polls, so that the router sees the fits.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // The workers fitted their passes: the prefill worker can price a prompt token.
    let auth = tandem_e2e::test_auth();
    let prefill = PrefillServiceClient::new(
        tandem_e2e::channel(&dep.prefill[0].endpoint(), &auth)
            .await
            .unwrap(),
    )
    .get_load(LoadRequest::default())
    .await
    .unwrap()
    .into_inner();
    let prefill_cost = prefill.step_cost.unwrap_or_default();
    // Prompts of one length make the per-token and per-pair terms collinear: the fit may
    // put all of a prompt's cost on either, so the test asks what placement asks (a price
    // for a prompt token, from one term or the other), as the router's placement does.
    assert!(
        prefill_cost.passes > 0
            && (prefill_cost.per_token_ms > 0.0 || prefill_cost.per_mpair_ms > 0.0),
        "{prefill_cost:?}"
    );
    let decode = DecodeServiceClient::new(
        tandem_e2e::channel(&dep.decode[0].endpoint(), &auth)
            .await
            .unwrap(),
    )
    .get_load(LoadRequest::default())
    .await
    .unwrap()
    .into_inner();
    let cost = decode.step_cost.unwrap_or_default();
    assert!(
        cost.passes > 0 && cost.base_ms + cost.per_row_ms + cost.per_mpair_ms > 0.0,
        "{cost:?}"
    );
    assert_eq!(cost.max_batch_tokens, 2048);

    // The router placed requests by prediction, measured them, and says so.
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let placed = metric_sum(&text, "tandem_router_placements_total", &[]);
    assert!(
        placed >= 1.0,
        "no request was placed by its targets ({prefill_cost:?}, {cost:?})"
    );
    assert!(metric_sum(&text, "tandem_router_placements_total", &["predicted="]) == placed);
    let errors = metric_sum(
        &text,
        "tandem_router_placement_prediction_error_count",
        &["metric=\"ttft\""],
    );
    assert!(errors >= 1.0 && errors <= placed, "{errors} of {placed}");
    assert_eq!(
        metric_sum(
            &text,
            "tandem_router_slo_requests_total",
            &["target=\"ttft\""]
        ),
        48.0
    );
    assert_eq!(
        metric_sum(&text, "tandem_router_slo_target_ms", &["target=\"tpot\""]),
        40.0
    );
    let info: Value = reqwest::get(format!("{base}/info"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["placement"], "slo");
    assert_eq!(info["slo"]["tpot_ms"], 40.0);
    assert_eq!(info["slo"]["ttft_per_token_ms"], 1.5);
    // What calibration learned, per placement and prompt length class: the requests whose
    // prediction errors were recorded above taught at least one class.
    let mut learned = 0;
    for kind in ["aggregated", "disaggregated", "split"] {
        let slope = info["slo_calibration"][kind]["ttft"]["slope"]
            .as_f64()
            .unwrap_or(0.0);
        assert!((0.25..=4.0).contains(&slope), "{info}");
        for class in info["slo_calibration"][kind]["ttft_by_prompt_length"]
            .as_array()
            .into_iter()
            .flatten()
        {
            assert!(class["from_prompt_tokens"].is_u64(), "{class}");
            assert!(class["offset_ms"].is_number(), "{class}");
            learned += 1;
        }
    }
    assert!(learned >= 1, "{info}");

    // A request's own targets come from its headers; a bad one is refused, naming it.
    let client = reqwest::Client::new();
    let ok = client
        .post(format!("{base}/v1/completions"))
        .header("x-tandem-slo-tpot-ms", "25")
        .header("x-tandem-slo-ttft-ms", "2000")
        .json(&json!({"model": "tandem", "prompt": [5, 6, 7], "max_tokens": 3}))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    for (path, status) in [("/v1/completions", 400), ("/generate", 422)] {
        let body = json!({"model": "tandem", "prompt": "hi", "inputs": "hi"});
        let r = client
            .post(format!("{base}{path}"))
            .header("x-tandem-slo-ttft-ms", "soon")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), status, "{path}");
        let text = r.text().await.unwrap();
        assert!(text.contains("x-tandem-slo-ttft-ms"), "{path}: {text}");
    }

    // A TTFT target with room to spare: long prompts are split, the prefill worker computing
    // their first block and the decode worker the rest in its streams' slack. Same tokens.
    let loose = Deployment::router_for(
        &dep.prefill,
        &dep.decode,
        "shm",
        &[
            "--placement".into(),
            "slo".into(),
            "--slo-ttft-ms".into(),
            "600000".into(),
        ],
    )
    .unwrap();
    let loose_base = format!("http://127.0.0.1:{}", loose.port);
    tandem_e2e::wait_http_ok(&format!("{loose_base}/health"), Duration::from_secs(60))
        .await
        .unwrap();
    // Prompts no worker has seen (a cached prefix would leave nothing to split).
    let fresh: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| p.iter().map(|t| 3 + (t + 101) % 250).collect())
        .collect();
    let reference = run_all(&format!("http://127.0.0.1:{}", agg.port), &fresh, 1).await;
    let got = run_all(&loose_base, &fresh, 4).await;
    for (i, (got, want)) in got.iter().zip(&reference).enumerate() {
        assert_eq!(got.text, want.text, "split round, prompt {i}");
        assert_eq!(got.logprobs, want.logprobs, "split round, prompt {i}");
    }
    let text = reqwest::get(format!("{loose_base}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let splits = metric_sum(
        &text,
        "tandem_router_placements_total",
        &["placement=\"split\""],
    );
    let tail = metric_sum(
        &text,
        "tandem_router_split_prompt_tokens_total",
        &["side=\"decode\""],
    );
    let placements: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("placements_total") || l.contains("split"))
        .collect();
    assert!(
        splits >= 1.0 && tail >= 64.0 * splits,
        "{splits} splits, {tail} tokens: {placements:?}"
    );
    for d in &dep.decode {
        assert_eq!(
            tandem_e2e::blocks_in_use(&d.endpoint(), true)
                .await
                .unwrap(),
            0
        );
    }
}
