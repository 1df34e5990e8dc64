//! The compute mode of quantized weights, chosen once per process like the instruction set:
//! `exact` runs them through the f32 tiles, bit for bit the f32 widening's logits; `fast`
//! quantizes the activations to 8 bits and takes integer dot products (`quant::int8`).
//! Both are batch-invariant; they differ in value by the activations' rounding.
//!
//! `auto` (the default) picks by instruction set from measurements (see `decide_auto`).
//! The choice decides how the weights are packed at load ([`Arrangement`]), so it is made
//! before the first model loads: [`select_compute`] from the binaries' `--compute` flag, else
//! `TANDEM_COMPUTE`.

use std::sync::OnceLock;

use super::quant::{Arrangement, IntTile};
use super::{Isa, isa};

/// The environment variable that picks the compute mode when no flag did.
pub const COMPUTE_ENV: &str = "TANDEM_COMPUTE";

/// How quantized weights compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ComputeMode {
    /// The f32 tiles over dequantized weights: the f32 widening's bits.
    Exact,
    /// 8-bit activations and integer dot products.
    Fast,
}

/// What a deployment asks for: a mode, or the faster one on this machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ComputeChoice {
    Auto,
    Mode(ComputeMode),
}

/// A compute mode that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ComputeError {
    #[error("unknown compute mode `{0}`: expected auto, exact or fast")]
    Unknown(String),
    #[error("quantized weights already compute in {0} mode; the mode is chosen once per process")]
    AlreadyChosen(&'static str),
}

impl ComputeMode {
    pub fn name(self) -> &'static str {
        match self {
            ComputeMode::Exact => "exact",
            ComputeMode::Fast => "fast",
        }
    }

    /// The integer tile this mode runs on `isa`: none in `exact` mode.
    pub fn integer_tile(self, isa: Isa) -> Option<IntTile> {
        match self {
            ComputeMode::Exact => None,
            ComputeMode::Fast => Some(IntTile::for_isa(isa)),
        }
    }

    /// How this mode packs quantized weights.
    pub fn arrangement(self) -> Arrangement {
        match self {
            ComputeMode::Exact => Arrangement::InputMajor,
            ComputeMode::Fast => Arrangement::Quads,
        }
    }
}

impl std::fmt::Display for ComputeMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ComputeChoice {
    type Err = ComputeError;

    fn from_str(name: &str) -> Result<Self, ComputeError> {
        match name.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(ComputeChoice::Auto),
            "exact" => Ok(ComputeChoice::Mode(ComputeMode::Exact)),
            "fast" => Ok(ComputeChoice::Mode(ComputeMode::Fast)),
            _ => Err(ComputeError::Unknown(name.to_string())),
        }
    }
}

/// The mode in force and why it was picked (for the logs and `/info`).
#[derive(Debug, Clone, PartialEq)]
pub struct ComputeDecision {
    pub mode: ComputeMode,
    pub reason: String,
}

static CHOSEN: OnceLock<ComputeDecision> = OnceLock::new();

/// Resolves `choice` on this machine (measuring for `auto`).
fn decide(choice: ComputeChoice) -> ComputeDecision {
    match choice {
        ComputeChoice::Mode(mode) => ComputeDecision {
            mode,
            reason: "asked for".to_string(),
        },
        ComputeChoice::Auto => decide_auto(isa()),
    }
}

/// Makes quantized weights of this process compute as `choice` says (refused once another
/// mode is in force). Call it before loading a model.
pub fn select_compute(choice: ComputeChoice) -> Result<&'static ComputeDecision, ComputeError> {
    let decision = CHOSEN.get_or_init(|| decide(choice));
    match choice {
        ComputeChoice::Mode(mode) if mode != decision.mode => {
            Err(ComputeError::AlreadyChosen(decision.mode.name()))
        }
        _ => Ok(decision),
    }
}

/// The mode in force: the one selected, else `TANDEM_COMPUTE`'s, else `auto`'s.
///
/// # Panics
/// If `TANDEM_COMPUTE` names no mode (as `TANDEM_ISA` does: a test must not pass on kernels
/// other than the ones it asked for). Binaries select through [`select_compute`] first.
pub fn compute_decision() -> &'static ComputeDecision {
    CHOSEN.get_or_init(|| {
        let choice = match std::env::var(COMPUTE_ENV) {
            Ok(name) if !name.trim().is_empty() => name
                .parse()
                .unwrap_or_else(|e| panic!("{COMPUTE_ENV}: {e}")),
            _ => ComputeChoice::Auto,
        };
        decide(choice)
    })
}

/// The mode in force (see [`compute_decision`]).
pub fn compute_mode() -> ComputeMode {
    compute_decision().mode
}

/// `auto`'s choice for an instruction set: a table rather than a timing, so that every
/// process of a deployment picks the same mode (a prefill worker and a decode worker that
/// disagreed would compute different KV for the same tokens; the mode is part of the model's
/// identity, so they would refuse each other's) and so that x86-64 hosts of different
/// generations still agree bit for bit: every x86-64 set with AVX2 gets `fast` (its integer
/// tiles, `vpmaddubsw` or VNNI's `vpdpbusd`, give the same bits). Measured on Zen 1 (BENCHMARKS.md, "Compute modes"):
/// the integer tiles stream a 4-bit matrix about 3.5x faster per row, a batch-1 decode step
/// takes a third of the time, and batches of 8-64 rows run within about 15 % of the f32
/// tiles; on Zen 4 (AVX512_VNNI) batches of 64 rows run at twice the f32 tiles' rate and a
/// 512-token prefill 1.4x faster. NEON's integer tile (`sdot`, on CPUs with the dot-product extension) is checked
/// for its bits under emulation but has not been timed on an ARM machine, and the portable
/// tile is slower than NEON's f32 tiles, so NEON and portable code keep `exact`.
fn decide_auto(isa: Isa) -> ComputeDecision {
    let (mode, reason) = match isa {
        Isa::Avx2 | Isa::Avx512 => (
            ComputeMode::Fast,
            "x86-64 with AVX2: integer tiles, measured faster than the f32 tiles for decode",
        ),
        Isa::Neon | Isa::Scalar => (
            ComputeMode::Exact,
            "no integer tile measured faster on this instruction set",
        ),
    };
    ComputeDecision {
        mode,
        reason: format!("auto: {reason}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_unknown_ones_are_refused() {
        assert_eq!("auto".parse(), Ok(ComputeChoice::Auto));
        assert_eq!(" FAST ".parse(), Ok(ComputeChoice::Mode(ComputeMode::Fast)));
        assert_eq!("exact".parse(), Ok(ComputeChoice::Mode(ComputeMode::Exact)));
        assert!(matches!(
            "int8".parse::<ComputeChoice>(),
            Err(ComputeError::Unknown(_))
        ));
    }

    #[test]
    fn auto_is_a_fixed_choice_per_instruction_set() {
        for isa in Isa::ALL {
            let first = decide_auto(isa);
            assert_eq!(first, decide_auto(isa), "{isa}");
            assert!(first.reason.starts_with("auto: "), "{first:?}");
        }
        assert_eq!(decide_auto(Isa::Avx2).mode, ComputeMode::Fast);
        // x86-64 hosts of different generations compute alike.
        assert_eq!(decide_auto(Isa::Avx512), decide_auto(Isa::Avx2));
        assert_eq!(decide_auto(Isa::Scalar).mode, ComputeMode::Exact);
    }
}
