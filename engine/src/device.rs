//! Where an engine computes: the CPU (the default, and the only choice without the `cuda`
//! feature) or one CUDA device, optionally confined to a green context of some SMs.

use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::EngineError;

/// The compute device of an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Device {
    #[default]
    Cpu,
    Cuda {
        /// Device index as CUDA numbers it (after `CUDA_VISIBLE_DEVICES`).
        ordinal: usize,
        /// Confine the engine to a green context of this many SMs.
        green_context_sms: Option<u32>,
    },
}

impl Device {
    /// Whether this build can compute on the device: the CPU always, CUDA only with the
    /// `cuda` feature. Callers check early (before loading a model) with this same error.
    pub fn ensure_supported(&self) -> Result<(), EngineError> {
        match self {
            Device::Cuda { .. } if !crate::CUDA_SUPPORT => Err(EngineError::Unsupported(
                "this binary was built without CUDA support: build it with the `cuda` feature \
                 (scripts/build-gpu builds the GPU binaries)"
                    .into(),
            )),
            _ => Ok(()),
        }
    }
}

impl FromStr for Device {
    type Err = EngineError;

    /// `cpu`, `cuda` (device 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad =
            || EngineError::Config(format!("device {s:?}: expected `cpu`, `cuda` or `cuda:N`"));
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda {
                ordinal: 0,
                green_context_sms: None,
            }),
            _ => {
                let n = s.strip_prefix("cuda:").ok_or_else(bad)?;
                Ok(Device::Cuda {
                    ordinal: n.parse().map_err(|_| bad())?,
                    green_context_sms: None,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_devices() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!(
            "cuda:1".parse::<Device>().unwrap(),
            Device::Cuda {
                ordinal: 1,
                green_context_sms: None
            }
        );
        assert!("cuda".parse::<Device>().is_ok());
        for bad in ["gpu", "cuda:", "cuda:x", ""] {
            assert!(bad.parse::<Device>().is_err(), "{bad}");
        }
    }
}
