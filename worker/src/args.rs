//! Flag groups shared by both workers (every flag also reads a `TANDEM_*` variable) and the
//! loading they drive.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use tandem_engine::{
    Device, EngineConfig, EngineError, LoadOptions, Model, ModelSource, WeightDtype, load_model,
};
use tandem_text::TextTokenizer;

/// Which model to serve.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// `smollm2` (default model, fetched once with pip), `tiny` (built-in test model),
    /// `dummy:PRESET[:SEED]`, or a path to an HF folder or a GGUF file.
    #[arg(long, env = "TANDEM_MODEL", default_value = "smollm2")]
    pub model: String,
    /// Weight storage type: f32, f16 or bf16 (compute is f32 on the CPU).
    #[arg(long, env = "TANDEM_DTYPE", default_value = "f32")]
    pub dtype: String,
    /// A tokenizer (tokenizer.json, HF folder or GGUF) instead of the model's own.
    #[arg(long, env = "TANDEM_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,
    /// Where the default model is cached (default: the user's cache dir + /tandem).
    #[arg(long, env = "TANDEM_CACHE")]
    pub cache_dir: Option<PathBuf>,
}

impl ModelArgs {
    /// Loads the model and its tokenizer.
    pub fn load(&self) -> Result<(Arc<Model>, TextTokenizer), tandem_engine::EngineError> {
        let source: ModelSource = self.model.parse()?;
        let dtype: WeightDtype = self.dtype.parse()?;
        let opts = LoadOptions {
            dtype,
            cache_dir: self
                .cache_dir
                .clone()
                .unwrap_or_else(tandem_engine::fetch::default_cache_dir),
            tokenizer: self.tokenizer.clone(),
        };
        let (model, tokenizer) = load_model(&source, &opts)?;
        Ok((Arc::new(model), tokenizer))
    }

    /// Loads on a blocking thread (the first run downloads the default model), unless
    /// `shutdown` resolves first: then `None`, and the worker can stop at once.
    pub async fn load_until(
        &self,
        shutdown: &mut std::pin::Pin<Box<dyn Future<Output = ()> + Send>>,
    ) -> Result<Option<(Arc<Model>, TextTokenizer)>, EngineError> {
        let args = self.clone();
        let loading = tokio::task::spawn_blocking(move || args.load());
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
}

/// Engine sizing and threads.
#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    /// MiB of KV cache.
    #[arg(long, env = "TANDEM_KV_BUDGET_MB", default_value_t = 1024)]
    pub kv_budget_mb: usize,
    /// Tokens per forward pass (decode tokens plus prefill chunks).
    #[arg(long, env = "TANDEM_MAX_BATCH_TOKENS", default_value_t = 2048)]
    pub max_batch_tokens: usize,
    /// Sequences running at once.
    #[arg(long, env = "TANDEM_MAX_RUNNING", default_value_t = 256)]
    pub max_running: usize,
    /// Compute threads (default: one per available core).
    #[arg(long, env = "TANDEM_THREADS")]
    pub threads: Option<usize>,
    /// Where the engine computes: `cpu`, `cuda` or `cuda:N` (binaries built with the `cuda`
    /// feature, see scripts/build-gpu).
    #[arg(long, env = "TANDEM_DEVICE", default_value = "cpu")]
    pub device: String,
    /// Confine the GPU engine to a green context of this many SMs (set by `tandem up` from a
    /// GPU deployment). Refused with `--device cpu`, never ignored.
    #[arg(long, env = "TANDEM_GREEN_CONTEXT_SMS")]
    pub green_context_sms: Option<u32>,
    /// Instruction set of the CPU kernels: avx512, avx2, neon or scalar (default: the best
    /// this CPU runs). Every set gives the same bits; a set the CPU lacks is refused.
    #[arg(long, env = "TANDEM_ISA")]
    pub isa: Option<String>,
}

impl EngineArgs {
    /// The engine's configuration, or why these flags cannot run in this build.
    pub fn engine_config(&self) -> Result<EngineConfig, String> {
        if let Some(name) = &self.isa {
            tandem_engine::backend::cpu::kernels::Isa::require(name)
                .map_err(|e| format!("--isa: {e}"))?;
        }
        let mut device: Device = self
            .device
            .parse()
            .map_err(|e: EngineError| e.to_string())?;
        device
            .ensure_supported()
            .map_err(|e| format!("--device {}: {e}", self.device))?;
        match (&mut device, self.green_context_sms) {
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
            kv_budget_bytes: self.kv_budget_mb << 20,
            max_batch_tokens: self.max_batch_tokens,
            max_running: self.max_running,
            device,
        })
    }

    /// Chooses the kernels' instruction set and sizes the compute threads (the kernels' team
    /// and rayon's pool); call once, after [`EngineArgs::engine_config`] and before loading.
    pub fn init_compute(&self) -> Result<(), String> {
        use tandem_engine::backend::cpu::kernels::{Isa, isa, select_isa};
        let chosen = match &self.isa {
            Some(name) => Isa::require(name)
                .and_then(select_isa)
                .map_err(|e| format!("--isa: {e}"))?,
            None => isa(),
        };
        tracing::info!(isa = %chosen, best = %Isa::best(), "CPU kernels");
        if let Some(n) = self.threads {
            tandem_engine::backend::cpu::kernels::team::set_threads(n);
        }
        let mut builder = rayon::ThreadPoolBuilder::new().thread_name(|i| format!("compute-{i}"));
        if let Some(n) = self.threads {
            builder = builder.num_threads(n.max(1));
        }
        if let Err(e) = builder.build_global() {
            tracing::warn!(error = %e, "compute pool already initialised");
        }
        Ok(())
    }
}

/// Where the gRPC server listens, and the credentials it requires.
#[derive(Debug, Clone, Args)]
pub struct ServerArgs {
    #[arg(long, env = "TANDEM_HOST", default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, env = "TANDEM_PORT")]
    pub port: Option<u16>,
    /// Host other machines reach this worker at (for the KV TCP port), if not `host`.
    #[arg(long, env = "TANDEM_ADVERTISE_HOST")]
    pub advertise_host: Option<String>,
    /// Log as JSON lines instead of text.
    #[arg(long, env = "TANDEM_LOG_JSON")]
    pub log_json: bool,
    /// A name for this worker in logs and metrics (default: role@host:port).
    #[arg(long, env = "TANDEM_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Folder of the decode workers' shared-memory KV pools (default /dev/shm). Prefill
    /// workers map pools only from here.
    #[arg(long, env = "TANDEM_SHM_DIR")]
    pub shm_dir: Option<PathBuf>,
    #[command(flatten)]
    pub auth: tandem_auth::InternalAuthArgs,
}

impl ServerArgs {
    /// The credentials, after refusing a non-loopback listen address without a secret. (The
    /// binary refuses a secret on its command line: `tandem_auth::refuse_secret_on_command_line`.)
    pub fn internal_auth(&self) -> Result<tandem_auth::InternalAuth, tandem_auth::AuthError> {
        let auth = self.auth.load()?;
        auth.check_listen(&self.host)?;
        Ok(auth)
    }

    /// The shared-memory folder: the flag, else /dev/shm where it exists.
    pub fn shm_dir(&self) -> Option<PathBuf> {
        self.shm_dir
            .clone()
            .or_else(tandem_kv::shm::default_shm_dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

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
        assert_eq!(parse(&[]).engine_config().unwrap().device, Device::Cpu);
        let err = parse(&["--green-context-sms", "64"])
            .engine_config()
            .unwrap_err();
        assert!(err.contains("needs --device cuda"), "{err}");
        assert!(parse(&["--device", "tpu"]).engine_config().is_err());
        let err = parse(&["--isa", "sse9"]).engine_config().unwrap_err();
        assert!(
            err.contains("--isa: unknown instruction set `sse9`"),
            "{err}"
        );
        assert!(parse(&["--isa", "scalar"]).engine_config().is_ok());
        let gpu = parse(&["--device", "cuda:1", "--green-context-sms", "64"]).engine_config();
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
