//! Load generation for one block, as vLLM's `benchmark()` (0.13.0): the ready check with
//! sample 0, warmups, gamma/Poisson arrival times rescaled to `N / rate`, a task per request
//! waiting on a `--max-concurrency` semaphore, and the benchmark duration (§2.4, §3.1).
//!
//! The informational lines vLLM prints around the run go to stderr here, so stdout carries
//! only the blocks.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, Gamma};
use tokio::sync::Semaphore;

use crate::backends::{RequestInput, Target, request_body, send_request};
use crate::metrics::RequestOutput;
use crate::progress::Progress;

/// Why a run could not take place.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(
        "Initial test run failed - Please make sure benchmark arguments are correctly specified. Error: {0}"
    )]
    InitialTestFailed(String),
    #[error("no requests to send")]
    NoRequests,
    #[error("invalid traffic settings: {0}")]
    Traffic(String),
}

/// Traffic shape and run options of one block.
#[derive(Debug, Clone, PartialEq)]
pub struct TrafficSettings {
    /// Requests per second; `f64::INFINITY` sends everything at once.
    pub request_rate: f64,
    /// Gamma shape; 1 is a Poisson process.
    pub burstiness: f64,
    pub max_concurrency: Option<usize>,
    pub seed: u64,
    pub show_progress: bool,
    /// `--ready-check-timeout-sec`; zero skips the initial test request.
    pub ready_check_timeout: Duration,
    pub num_warmups: usize,
    /// `--profile`: POST `{base}/start_profile` before and `/stop_profile` after the run.
    pub profile_base_url: Option<String>,
}

/// Outputs in dataset order and the measured duration in seconds.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    pub outputs: Vec<RequestOutput>,
    pub duration: f64,
}

/// Cumulative send offsets in seconds (vLLM 0.10+ `get_request` without ramp-up).
pub fn arrival_offsets(
    count: usize,
    request_rate: f64,
    burstiness: f64,
    seed: u64,
) -> Result<Vec<f64>, RunError> {
    if burstiness.is_nan() || burstiness <= 0.0 {
        return Err(RunError::Traffic(format!(
            "A positive burstiness factor is expected, but given {burstiness}."
        )));
    }
    if request_rate.is_nan() || request_rate <= 0.0 {
        return Err(RunError::Traffic(format!(
            "request rate must be positive, got {request_rate}"
        )));
    }
    let mut delays: Vec<f64> = if request_rate.is_infinite() {
        vec![0.0; count]
    } else if burstiness.is_infinite() {
        vec![1.0 / request_rate; count]
    } else {
        let theta = 1.0 / (request_rate * burstiness);
        let gamma = Gamma::new(burstiness, theta)
            .map_err(|e| RunError::Traffic(format!("gamma distribution: {e}")))?;
        let mut rng = StdRng::seed_from_u64(seed);
        (0..count).map(|_| gamma.sample(&mut rng)).collect()
    };
    for i in 1..delays.len() {
        delays[i] += delays[i - 1];
    }
    if let Some(&last) = delays.last()
        && last != 0.0
    {
        // Rescale so the last arrival lands exactly at N / rate.
        let factor = (count as f64 / request_rate) / last;
        for delay in &mut delays {
            *delay *= factor;
        }
    }
    Ok(delays)
}

/// Runs one block: ready check, warmups, then the timed run.
pub async fn run_block(
    client: &reqwest::Client,
    target: &Target,
    inputs: Vec<RequestInput>,
    settings: &TrafficSettings,
    log: &mut (dyn Write + Send),
) -> Result<RunOutcome, RunError> {
    let Some(test_input) = inputs.first().cloned() else {
        return Err(RunError::NoRequests);
    };
    let semaphore = start_run(client, target, &test_input, settings, log).await?;
    let offsets = arrival_offsets(
        inputs.len(),
        settings.request_rate,
        settings.burstiness,
        settings.seed,
    )?;
    let progress = Progress::new(inputs.len(), settings.show_progress);
    let start = Instant::now();
    let outputs = dispatch(
        client, target, inputs, &offsets, semaphore, &progress, start,
    )
    .await;
    progress.close();
    let duration = start.elapsed().as_secs_f64();
    stop_run(client, target, &test_input, settings, log).await;
    Ok(RunOutcome { outputs, duration })
}

/// Everything before the timed run: the ready check with `test_input`, warmups, the
/// profiler start and vLLM's informational lines. Returns the `--max-concurrency`
/// semaphore the timed run must use.
pub(crate) async fn start_run(
    client: &reqwest::Client,
    target: &Target,
    test_input: &RequestInput,
    settings: &TrafficSettings,
    log: &mut (dyn Write + Send),
) -> Result<Option<Arc<Semaphore>>, RunError> {
    let epoch = Instant::now();
    if settings.ready_check_timeout.is_zero() {
        let _ = writeln!(log, "Skipping endpoint ready check.");
    } else {
        let _ = writeln!(log, "Starting initial single prompt test run...");
        let output = wait_for_endpoint(
            client,
            target,
            test_input,
            settings.ready_check_timeout,
            log,
        )
        .await;
        if !output.success {
            return Err(RunError::InitialTestFailed(output.error));
        }
        let _ = writeln!(log, "Initial test run completed.");
    }
    let semaphore = settings
        .max_concurrency
        .map(|n| Arc::new(Semaphore::new(n.max(1))));
    if settings.num_warmups > 0 {
        let _ = writeln!(log, "Warming up with {} requests...", settings.num_warmups);
        let warmups = vec![test_input.clone(); settings.num_warmups];
        let progress = Progress::new(settings.num_warmups, settings.show_progress);
        let offsets = vec![0.0; warmups.len()];
        dispatch(
            client,
            target,
            warmups,
            &offsets,
            semaphore.clone(),
            &progress,
            epoch,
        )
        .await;
        progress.close();
        let _ = writeln!(log, "Warmup run completed.");
    }
    if let Some(base) = &settings.profile_base_url {
        let _ = writeln!(log, "Starting profiler...");
        post_profile(client, target, test_input, &format!("{base}/start_profile")).await;
    }
    let _ = writeln!(log, "Starting main benchmark run...");
    let rate = crate::report::python_float(settings.request_rate);
    let _ = writeln!(log, "Traffic request rate: {rate}");
    let distribution = if settings.burstiness == 1.0 {
        "Poisson process"
    } else {
        "Gamma distribution"
    };
    let _ = writeln!(
        log,
        "Burstiness factor: {} ({distribution})",
        crate::report::python_float(settings.burstiness)
    );
    let concurrency = settings
        .max_concurrency
        .map_or_else(|| "None".to_string(), |n| n.to_string());
    let _ = writeln!(log, "Maximum request concurrency: {concurrency}");
    let _ = log.flush();
    Ok(semaphore)
}

/// Everything after the timed run: the profiler stop.
pub(crate) async fn stop_run(
    client: &reqwest::Client,
    target: &Target,
    test_input: &RequestInput,
    settings: &TrafficSettings,
    log: &mut (dyn Write + Send),
) {
    if let Some(base) = &settings.profile_base_url {
        let _ = writeln!(log, "Stopping profiler...");
        post_profile(client, target, test_input, &format!("{base}/stop_profile")).await;
    }
}

/// Sends `inputs[i]` at `start + offsets[i]`, each as its own task behind the semaphore, and
/// returns the outputs in input order.
async fn dispatch(
    client: &reqwest::Client,
    target: &Target,
    inputs: Vec<RequestInput>,
    offsets: &[f64],
    semaphore: Option<Arc<Semaphore>>,
    progress: &Progress,
    start: Instant,
) -> Vec<RequestOutput> {
    let target = Arc::new(target.clone());
    let mut tasks = Vec::with_capacity(inputs.len());
    for (input, offset) in inputs.into_iter().zip(offsets.iter().copied()) {
        if offset > 0.0 {
            tokio::time::sleep_until((start + Duration::from_secs_f64(offset)).into()).await;
        }
        let (client, target, semaphore, progress) = (
            client.clone(),
            target.clone(),
            semaphore.clone(),
            progress.clone(),
        );
        let prompt_len = input.prompt_len;
        let task = tokio::spawn(async move {
            // The start time is read after the slot is acquired: client-side queueing is
            // excluded from TTFT and E2EL, as in vLLM.
            let _permit = match &semaphore {
                Some(semaphore) => semaphore.clone().acquire_owned().await.ok(),
                None => None,
            };
            let output = send_request(&client, &target, &input, start).await;
            progress.advance();
            output
        });
        tasks.push((task, prompt_len));
    }
    let mut outputs = Vec::with_capacity(tasks.len());
    for (task, prompt_len) in tasks {
        outputs.push(task.await.unwrap_or_else(|e| RequestOutput {
            prompt_len,
            error: format!("request task failed: {e}"),
            ..Default::default()
        }));
    }
    outputs
}

/// vLLM's `wait_for_endpoint`: retry the test request every 5 s until it succeeds or the
/// timeout passes; returns the last output.
async fn wait_for_endpoint(
    client: &reqwest::Client,
    target: &Target,
    input: &RequestInput,
    timeout: Duration,
    log: &mut (dyn Write + Send),
) -> RequestOutput {
    const RETRY_INTERVAL: Duration = Duration::from_secs(5);
    let deadline = Instant::now() + timeout;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let output = send_request(client, target, input, Instant::now()).await;
        let remaining = deadline.saturating_duration_since(Instant::now());
        if output.success || remaining.is_zero() {
            return output;
        }
        let _ = writeln!(
            log,
            "Endpoint not ready (attempt {attempt}): {}; retrying for up to {:.0} s",
            output.error.lines().next().unwrap_or(""),
            remaining.as_secs_f64()
        );
        tokio::time::sleep(RETRY_INTERVAL.min(remaining)).await;
    }
}

async fn post_profile(client: &reqwest::Client, target: &Target, input: &RequestInput, url: &str) {
    let body = request_body(target.backend, input);
    match client.post(url).json(&body).send().await {
        Ok(response) if response.status().is_success() => {}
        Ok(response) => tracing::warn!(%url, status = %response.status(), "profiler call refused"),
        Err(error) => tracing::warn!(%url, %error, "profiler call failed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn infinite_rate_sends_everything_at_once() {
        assert_eq!(
            arrival_offsets(3, f64::INFINITY, 1.0, 0).unwrap(),
            vec![0.0; 3]
        );
    }

    #[test]
    fn arrivals_are_rescaled_to_end_at_n_over_rate() {
        for burstiness in [0.5, 1.0, 4.0, f64::INFINITY] {
            let offsets = arrival_offsets(50, 10.0, burstiness, 3).unwrap();
            assert!(
                (offsets[49] - 5.0).abs() < 1e-9,
                "{burstiness}: {}",
                offsets[49]
            );
            assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
            // The first request is delayed too.
            assert!(offsets[0] > 0.0);
        }
        let uniform = arrival_offsets(4, 2.0, f64::INFINITY, 0).unwrap();
        assert_eq!(uniform, vec![0.5, 1.0, 1.5, 2.0]);
    }

    #[test]
    fn burstiness_spreads_gaps() {
        let gaps = |b: f64| {
            let o = arrival_offsets(2000, 100.0, b, 1).unwrap();
            let g: Vec<f64> = o.windows(2).map(|w| w[1] - w[0]).collect();
            let mean = g.iter().sum::<f64>() / g.len() as f64;
            (g.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / g.len() as f64).sqrt() / mean
        };
        // Coefficient of variation of Gamma(b) gaps is 1/sqrt(b).
        assert!((gaps(1.0) - 1.0).abs() < 0.1);
        assert!(gaps(0.25) > 1.5);
        assert!(gaps(16.0) < 0.4);
        assert!(arrival_offsets(2, 1.0, 0.0, 0).is_err());
    }
}
