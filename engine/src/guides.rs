//! Structured output in the engine: the tokenizer's grammar factory (`tandem_text`'s
//! llguidance integration), built on the first request that asks for a grammar (the token
//! trie costs time and memory that a server never asked for one should not pay), and shared
//! by the engine and its worker (a decode worker compiles the grammar to follow a first token
//! sampled elsewhere).

use std::sync::{Arc, OnceLock};

use tandem_text::{Guide, GuideFactory, GuideSpec, TextTokenizer};

use crate::error::{EngineError, Result};

/// Compiles grammars for one tokenizer; cheap to clone.
#[derive(Clone)]
pub struct Guides {
    tokenizer: TextTokenizer,
    factory: Arc<OnceLock<std::result::Result<GuideFactory, String>>>,
}

impl std::fmt::Debug for Guides {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guides")
            .field("built", &self.factory.get().is_some())
            .finish()
    }
}

impl Guides {
    pub fn new(tokenizer: &TextTokenizer) -> Self {
        Self {
            tokenizer: tokenizer.clone(),
            factory: Arc::new(OnceLock::new()),
        }
    }

    /// The guide of `spec`, or a request error saying why the grammar does not compile.
    pub fn compile(&self, spec: &GuideSpec) -> Result<Guide> {
        let bad = |reason: String| EngineError::InvalidSampling {
            param: "guide",
            reason,
        };
        // Sizes first: nothing is built for a request that will be refused anyway.
        spec.check_size().map_err(|e| bad(e.to_string()))?;
        let factory = self
            .factory
            .get_or_init(|| GuideFactory::new(&self.tokenizer).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| EngineError::Unsupported(format!("structured output: {e}")))?;
        factory.compile(spec).map_err(|e| bad(e.to_string()))
    }

    /// The guide of a request's sampling parameters, if it has a grammar.
    pub fn for_request(&self, spec: Option<&GuideSpec>) -> Result<Option<Guide>> {
        spec.map(|s| self.compile(s)).transpose()
    }
}
