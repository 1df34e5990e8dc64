//! Which instruction set the kernels run on: detected once per process, or chosen.
//!
//! Every kernel has a path per instruction set (AVX-512, AVX2, NEON, and a portable one) and
//! each path computes every output element in the same order with the same fused
//! multiply-adds, so they agree bit for bit. Choosing a path other than the best one is for
//! tests (they check that agreement on one machine) and for benchmarks (what a CPU without
//! AVX-512 would see); a path the CPU cannot run is refused, never emulated.
//!
//! The choice is process-wide and made once: by [`select_isa`] (the binaries call it from
//! their `--isa` flag), else from `TANDEM_ISA` the first time a kernel asks. That variable is
//! the one a library reads: `cargo test` and the examples have no `main` of ours to pass a
//! flag through, and the choice must be the same for every kernel call of the process.

use std::sync::OnceLock;

/// The environment variable that picks the instruction set when no flag did.
pub const ISA_ENV: &str = "TANDEM_ISA";

/// The instruction sets the kernels are written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Isa {
    /// x86-64 with AVX-512 F/BW/VL, FMA and F16C.
    Avx512,
    /// x86-64 with AVX2, FMA and F16C.
    Avx2,
    /// aarch64 Advanced SIMD (always present there).
    Neon,
    /// No vector instructions assumed: any CPU.
    Scalar,
}

/// A requested instruction set that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IsaError {
    #[error("unknown instruction set `{0}`: expected avx512, avx2, neon or scalar")]
    Unknown(String),
    #[error("this CPU cannot run the {0} kernels (it has: {1})")]
    Unsupported(&'static str, String),
    #[error("the kernels already run on {0}; the instruction set is chosen once per process")]
    AlreadyChosen(&'static str),
}

impl Isa {
    /// Every instruction set, best first.
    pub const ALL: [Isa; 4] = [Isa::Avx512, Isa::Avx2, Isa::Neon, Isa::Scalar];

    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Neon => "neon",
            Isa::Scalar => "scalar",
        }
    }

    /// Parses a name as [`Isa::name`] writes it.
    pub fn parse(name: &str) -> Result<Isa, IsaError> {
        Isa::ALL
            .into_iter()
            .find(|isa| isa.name().eq_ignore_ascii_case(name.trim()))
            .ok_or_else(|| IsaError::Unknown(name.to_string()))
    }

    /// Whether this CPU can run the kernels of `self`.
    pub fn supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            // AVX2 too: the AVX-512 kernels share AVX2 helpers (the per-lane softmax).
            Isa::Avx512 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("f16c")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("f16c")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The instruction sets this CPU can run, best first.
    pub fn available() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|isa| isa.supported()).collect()
    }

    /// The fastest instruction set this CPU can run.
    pub fn best() -> Isa {
        Isa::ALL
            .into_iter()
            .find(|isa| isa.supported())
            .unwrap_or(Isa::Scalar)
    }

    /// `name` if this CPU can run it.
    pub fn require(name: &str) -> Result<Isa, IsaError> {
        let isa = Isa::parse(name)?;
        if isa.supported() {
            Ok(isa)
        } else {
            let have: Vec<&str> = Isa::available().iter().map(|i| i.name()).collect();
            Err(IsaError::Unsupported(isa.name(), have.join(", ")))
        }
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

static CHOSEN: OnceLock<Isa> = OnceLock::new();

/// Makes the kernels of this process run on `isa` (refused if the CPU lacks it, or if the
/// kernels already run on another one). Call it before the first forward pass.
pub fn select_isa(isa: Isa) -> Result<Isa, IsaError> {
    let isa = Isa::require(isa.name())?;
    let chosen = *CHOSEN.get_or_init(|| isa);
    if chosen == isa {
        Ok(isa)
    } else {
        Err(IsaError::AlreadyChosen(chosen.name()))
    }
}

/// The instruction set named by `TANDEM_ISA`, if set (see the module docs).
pub fn isa_from_env() -> Result<Option<Isa>, IsaError> {
    match std::env::var(ISA_ENV) {
        Ok(name) if !name.trim().is_empty() => Isa::require(&name).map(Some),
        _ => Ok(None),
    }
}

/// The instruction set the kernels dispatch to.
///
/// # Panics
/// If nothing was selected and `TANDEM_ISA` names a set this CPU cannot run: running other
/// kernels than the ones asked for would make a test pass that checked nothing. Binaries
/// select through [`select_isa`] first and report the error instead.
pub fn isa() -> Isa {
    *CHOSEN.get_or_init(|| match isa_from_env() {
        Ok(chosen) => chosen.unwrap_or_else(Isa::best),
        Err(e) => panic!("{ISA_ENV}: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_refused() {
        for isa in Isa::ALL {
            assert_eq!(Isa::parse(isa.name()), Ok(isa));
        }
        assert_eq!(Isa::parse(" AVX2 "), Ok(Isa::Avx2));
        assert!(matches!(Isa::parse("sse4"), Err(IsaError::Unknown(_))));
    }

    #[test]
    fn scalar_runs_everywhere_and_the_best_is_available() {
        assert!(Isa::Scalar.supported());
        assert!(Isa::available().contains(&Isa::best()));
        #[cfg(target_arch = "x86_64")]
        assert!(matches!(
            Isa::require("neon"),
            Err(IsaError::Unsupported("neon", _))
        ));
        #[cfg(target_arch = "aarch64")]
        assert!(matches!(
            Isa::require("avx2"),
            Err(IsaError::Unsupported("avx2", _))
        ));
    }
}
