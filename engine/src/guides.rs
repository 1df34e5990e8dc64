//! Structured output in the engine: a request's grammar compiled with the tokenizer's
//! `GuideFactory` (`tandem_text`'s llguidance integration, shared by the engine and its
//! worker), its problems as request errors.

use tandem_text::{Guide, GuideFactory, GuideSpec, TextError};

use crate::error::{EngineError, Result};

/// Compiles `spec`: a grammar that does not compile (or is too large) is the request's fault;
/// a vocabulary the token trie cannot be built from is the server's.
pub fn compile_guide(factory: &GuideFactory, spec: &GuideSpec) -> Result<Guide> {
    factory.compile(spec).map_err(|e| match e {
        TextError::Guide(reason) => EngineError::InvalidSampling {
            param: "guide",
            reason,
        },
        other => EngineError::Unsupported(other.to_string()),
    })
}
