//! What the workers' flags drive (the flags themselves are `tandem_cli`'s): loading the
//! model, the engine's configuration, the kernels' instruction set and threads, and the
//! internal credentials.

use std::path::PathBuf;
use std::sync::Arc;

use tandem_auth::LoadInternalAuth;
pub use tandem_cli::{EngineArgs, ModelArgs, ServerArgs};
use tandem_engine::backend::cpu::kernels::{
    ComputeChoice, IntTile, Isa, isa, select_compute, select_isa,
};
use tandem_engine::{
    Device, EngineConfig, EngineError, LoadOptions, Model, ModelSource, WeightFormat,
};
use tandem_text::TextTokenizer;

/// Loads the model and its tokenizer.
pub fn load_model(args: &ModelArgs) -> Result<(Arc<Model>, TextTokenizer), EngineError> {
    let source: ModelSource = args.model.parse()?;
    let format: WeightFormat = args.weights.parse()?;
    let kv_dtype: tandem_kv::KvDtype = args
        .kv_dtype
        .parse()
        .map_err(|e: tandem_kv::KvError| EngineError::Config(e.to_string()))?;
    let opts = LoadOptions {
        format,
        kv_dtype,
        cache_dir: args
            .cache_dir
            .clone()
            .unwrap_or_else(tandem_engine::fetch::default_cache_dir),
        tokenizer: args.tokenizer.clone(),
        limits: match &args.model_limits {
            Some(spec) => spec.parse().map_err(EngineError::Text)?,
            None => tandem_text::ModelLimits::default(),
        },
    };
    let (model, tokenizer) = tandem_engine::load_model(&source, &opts)?;
    Ok((Arc::new(model), tokenizer))
}

/// Loads on a blocking thread (the first run downloads the default model), unless
/// `shutdown` resolves first: then `None`, and the worker can stop at once.
pub async fn load_model_until(
    args: &ModelArgs,
    shutdown: &mut std::pin::Pin<Box<dyn Future<Output = ()> + Send>>,
) -> Result<Option<(Arc<Model>, TextTokenizer)>, EngineError> {
    tracing::info!(model = %args.model, "loading model");
    let args = args.clone();
    let loading = tokio::task::spawn_blocking(move || load_model(&args));
    tokio::select! {
        loaded = loading => match loaded {
            Ok(result) => result.map(Some),
            Err(e) => Err(EngineError::Unsupported(format!("model loading failed: {e}"))),
        },
        () = shutdown.as_mut() => {
            tracing::info!("stopped while loading the model");
            Ok(None)
        }
    }
}

/// The engine's configuration, or why these flags cannot run in this build.
pub fn engine_config(args: &EngineArgs) -> Result<EngineConfig, String> {
    if let Some(name) = &args.isa {
        Isa::require(name).map_err(|e| format!("--isa: {e}"))?;
    }
    args.compute
        .parse::<ComputeChoice>()
        .map_err(|e| format!("--compute: {e}"))?;
    let mut device: Device = args
        .device
        .parse()
        .map_err(|e: EngineError| e.to_string())?;
    device
        .ensure_supported()
        .map_err(|e| format!("--device {}: {e}", args.device))?;
    match (&mut device, args.green_context_sms) {
        (Device::Cpu, Some(sms)) => {
            return Err(format!(
                "--green-context-sms {sms} confines a GPU engine: it needs --device cuda"
            ));
        }
        (Device::Cpu, None) => {}
        (
            Device::Cuda {
                green_context_sms, ..
            },
            sms,
        ) => *green_context_sms = sms,
    }
    Ok(EngineConfig {
        kv_budget_bytes: args.kv_budget_mb << 20,
        max_batch_tokens: args.max_batch_tokens,
        max_running: args.max_running,
        prefix_caching: !args.no_prefix_caching,
        device,
    })
}

/// Chooses the kernels' instruction set and sizes the compute threads (the kernels' team and
/// rayon's pool); call once, after [`engine_config`] and before loading.
pub fn init_compute(args: &EngineArgs) -> Result<(), String> {
    // First, so that every thread started from here on (the runtime, the compute pools,
    // the engine's thread) inherits it.
    set_cpu_priority(&args.cpu_priority)?;
    let chosen = match &args.isa {
        Some(name) => Isa::require(name)
            .and_then(select_isa)
            .map_err(|e| format!("--isa: {e}"))?,
        None => isa(),
    };
    let compute = args
        .compute
        .parse::<ComputeChoice>()
        .and_then(select_compute)
        .map_err(|e| format!("--compute: {e}"))?;
    let integer_tile = compute
        .mode
        .integer_tile(chosen)
        .map_or("none (exact mode)", IntTile::name);
    tracing::info!(
        isa = %chosen,
        best = %Isa::best(),
        compute = %compute.mode,
        why = %compute.reason,
        integer_tile,
        "CPU kernels"
    );
    if let Some(n) = args.threads {
        tandem_engine::backend::cpu::kernels::team::set_threads(n);
    }
    let mut builder = rayon::ThreadPoolBuilder::new().thread_name(|i| format!("compute-{i}"));
    if let Some(n) = args.threads {
        builder = builder.num_threads(n.max(1));
    }
    if let Err(e) = builder.build_global() {
        tracing::warn!(error = %e, "compute pool already initialised");
    }
    Ok(())
}

/// Puts the calling thread, and every thread it starts afterwards, at `priority`
/// (`--cpu-priority`): `idle` is Linux's SCHED_IDLE, which runs only on cycles that no
/// normal-priority thread wants.
fn set_cpu_priority(priority: &str) -> Result<(), String> {
    match priority {
        "normal" => Ok(()),
        #[cfg(target_os = "linux")]
        "idle" => {
            let param = libc::sched_param { sched_priority: 0 };
            // SAFETY: pid 0 is the calling thread; `param` is a valid sched_param for it.
            let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
            if rc != 0 {
                return Err(format!(
                    "--cpu-priority idle: {}",
                    std::io::Error::last_os_error()
                ));
            }
            tracing::info!("CPU priority idle: this worker runs on cycles the others leave");
            Ok(())
        }
        other => Err(format!(
            "--cpu-priority `{other}` is not available on this system (normal only)"
        )),
    }
}

/// The credentials, after refusing a non-loopback listen address without a secret. (The
/// binary refuses a secret on its command line: `tandem_auth::refuse_secret_on_command_line`.)
pub fn internal_auth(
    args: &ServerArgs,
) -> Result<tandem_auth::InternalAuth, tandem_auth::AuthError> {
    let auth = args.auth.load()?;
    auth.check_listen(&args.host)?;
    Ok(auth)
}

/// The shared-memory folder: the flag, else /dev/shm where it exists.
pub fn shm_dir(args: &ServerArgs) -> Option<PathBuf> {
    args.shm_dir
        .clone()
        .or_else(tandem_kv::shm::default_shm_dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn every_value_the_storage_flags_offer_is_one_the_engine_loads() {
        for name in tandem_cli::WEIGHT_FORMATS {
            let format: WeightFormat = name.parse().unwrap();
            assert_eq!(format.name(), name);
        }
        for name in tandem_cli::KV_DTYPES {
            let dtype: tandem_kv::KvDtype = name.parse().unwrap();
            assert_eq!(dtype.name(), name);
        }
        assert_eq!(
            tandem_cli::MODEL_PRESETS,
            tandem_engine::config::ModelConfig::PRESETS
        );
    }

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        engine: EngineArgs,
    }

    fn parse(args: &[&str]) -> EngineArgs {
        Flags::try_parse_from(std::iter::once("worker").chain(args.iter().copied()))
            .unwrap()
            .engine
    }

    #[test]
    fn devices_and_gpu_placement() {
        assert_eq!(engine_config(&parse(&[])).unwrap().device, Device::Cpu);
        let err = engine_config(&parse(&["--green-context-sms", "64"])).unwrap_err();
        assert!(err.contains("needs --device cuda"), "{err}");
        assert!(engine_config(&parse(&["--device", "tpu"])).is_err());
        let err = engine_config(&parse(&["--isa", "sse9"])).unwrap_err();
        assert!(
            err.contains("--isa: unknown instruction set `sse9`"),
            "{err}"
        );
        assert!(engine_config(&parse(&["--isa", "scalar"])).is_ok());
        let refused = Flags::try_parse_from(["worker", "--compute", "int4"]).err();
        let message = refused.map(|e| e.to_string()).unwrap_or_default();
        assert!(
            message.contains("[possible values: auto, exact, fast]"),
            "{message}"
        );
        assert!(engine_config(&parse(&["--compute", "exact"])).is_ok());
        let gpu = engine_config(&parse(&["--device", "cuda:1", "--green-context-sms", "64"]));
        if tandem_engine::CUDA_SUPPORT {
            assert_eq!(
                gpu.unwrap().device,
                Device::Cuda {
                    ordinal: 1,
                    green_context_sms: Some(64)
                }
            );
        } else {
            let err = gpu.unwrap_err();
            assert!(err.contains("without CUDA support"), "{err}");
        }
    }
}
