//! The ceilings on what a model file may declare: the one place they are defined, with their
//! defaults and the `--model-limits` spelling (`vocab=8M,merges=32M`) a worker's flag gives.
//!
//! A model file is hostile input. Every size it declares is checked twice before anything is
//! allocated for it: against the bytes the file actually holds (a count must fit the bytes
//! left at the smallest size its items take there), and against a ceiling here. The first
//! check stops a small file from declaring huge things; the second stops a large file from
//! costing more memory than any real model of its kind (a u8 array item costs one byte in the
//! file but a 32-byte value in memory; a tensor's data is read whole). The defaults are an
//! order of magnitude above the largest models shipped, so raising them is for files tandem
//! has not met yet.
//!
//! A config's dimensions (layers, widths, heads) are bounded where the config is parsed
//! (`tandem_engine::config::SIZE_BOUNDS`: what the kernels take) and must fit the bytes of
//! weights there are; they have no ceiling here.

use std::fmt;

use crate::TextError;

/// One ceiling: its key in the `--model-limits` spelling, its default and what it bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ceiling {
    /// GGUF metadata array items in all, see [`MAX_METADATA_ITEMS`].
    MetadataItems,
    /// Bytes of one GGUF metadata string. Files that embed a whole `tokenizer.json` as a
    /// string hold the largest (~30 MB for a 256k vocabulary).
    StringBytes,
    /// Tokens of a vocabulary (a GGUF's token list, a tokenizer's largest id + 1, a config's
    /// `vocab_size`): the largest shipped hold ~262k (Gemma 3).
    Vocab,
    /// Merges of a BPE vocabulary (stored, or derived from a SentencePiece one): the largest
    /// shipped hold ~500k. Deriving a SentencePiece vocabulary's merges also hashes at most
    /// [`SPM_BYTES_PER_MERGE`] bytes per allowed merge.
    Merges,
    /// Bytes of a chat template's source: the longest shipped (tool-calling templates) are
    /// ~40 KB.
    TemplateBytes,
    /// Tensors in one weight file: a 405B-parameter GGUF holds ~1.1k, DeepSeek-V3's 163
    /// safetensors shards ~91k in all.
    Tensors,
    /// Bytes of a JSON file read whole (`tokenizer.json`, `config.json`,
    /// `tokenizer_config.json`, `generation_config.json`) and of a safetensors header: a
    /// 256k-token `tokenizer.json` is ~33 MB.
    JsonBytes,
}

/// Array items the metadata of one GGUF file may hold in all, by default (the
/// [`Ceiling::MetadataItems`] ceiling). Each becomes a value of some 32 bytes in memory however
/// few bytes it takes in the file (one, for a u8), so the file's length alone does not bound
/// what its arrays cost: this does (about 1 GB at most). The largest vocabularies shipped
/// (~260k tokens, their scores and types, ~500k merges) hold about 1.3M.
pub const MAX_METADATA_ITEMS: u64 = 32 << 20;

/// Bytes a SentencePiece vocabulary's merge derivation may hash per allowed merge: each
/// split of a piece of `n` bytes hashes up to `n` bytes, so a few long pieces would otherwise
/// cost time and memory quadratic in the file's size. Real vocabularies need ~100 per merge.
pub const SPM_BYTES_PER_MERGE: u64 = 16;

impl Ceiling {
    /// Every ceiling, in the order `--model-limits` lists them.
    pub const ALL: [Ceiling; 7] = [
        Ceiling::MetadataItems,
        Ceiling::StringBytes,
        Ceiling::Vocab,
        Ceiling::Merges,
        Ceiling::TemplateBytes,
        Ceiling::Tensors,
        Ceiling::JsonBytes,
    ];

    /// The key of `--model-limits KEY=N`.
    pub fn key(self) -> &'static str {
        match self {
            Ceiling::MetadataItems => "metadata-items",
            Ceiling::StringBytes => "string-bytes",
            Ceiling::Vocab => "vocab",
            Ceiling::Merges => "merges",
            Ceiling::TemplateBytes => "template-bytes",
            Ceiling::Tensors => "tensors",
            Ceiling::JsonBytes => "json-bytes",
        }
    }

    fn default_value(self) -> u64 {
        match self {
            Ceiling::MetadataItems => MAX_METADATA_ITEMS,
            Ceiling::StringBytes => 64 << 20,
            Ceiling::Vocab => 4 << 20,
            Ceiling::Merges => 16 << 20,
            Ceiling::TemplateBytes => 1 << 20,
            Ceiling::Tensors => 256 << 10,
            Ceiling::JsonBytes => 256 << 20,
        }
    }
}

/// The ceilings a load runs under; [`Default`] is what a worker uses unless told otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelLimits {
    values: [u64; Ceiling::ALL.len()],
}

impl Default for ModelLimits {
    fn default() -> Self {
        Self {
            values: Ceiling::ALL.map(Ceiling::default_value),
        }
    }
}

impl ModelLimits {
    /// The value of one ceiling.
    pub fn get(&self, ceiling: Ceiling) -> u64 {
        self.values[ceiling as usize]
    }

    /// These limits with one ceiling changed.
    pub fn with(mut self, ceiling: Ceiling, value: u64) -> Self {
        self.values[ceiling as usize] = value;
        self
    }

    /// `Ok` when `value` (of `what`, as an error names it) is within `ceiling`.
    pub fn check(
        &self,
        ceiling: Ceiling,
        value: u64,
        what: impl fmt::Display,
    ) -> Result<(), TextError> {
        let limit = self.get(ceiling);
        if value > limit {
            return Err(TextError::OverLimit {
                what: what.to_string(),
                value,
                limit,
                key: ceiling.key(),
            });
        }
        Ok(())
    }
}

impl fmt::Display for ModelLimits {
    /// The `--model-limits` spelling of every ceiling (`metadata-items=32M,…`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, c) in Ceiling::ALL.into_iter().enumerate() {
            let sep = if i == 0 { "" } else { "," };
            write!(f, "{sep}{}={}", c.key(), human(self.get(c)))?;
        }
        Ok(())
    }
}

/// `n` with the largest binary suffix that divides it (`32M`, `1536`).
fn human(n: u64) -> String {
    for (shift, suffix) in [(40, "T"), (30, "G"), (20, "M"), (10, "K")] {
        if n != 0 && n.trailing_zeros() >= shift {
            return format!("{}{suffix}", n >> shift);
        }
    }
    n.to_string()
}

impl std::str::FromStr for ModelLimits {
    type Err = TextError;

    /// The defaults with the ceilings `s` names changed: `KEY=N` pairs separated by commas,
    /// `N` a whole number, optionally ending in `K`, `M`, `G` or `T` (powers of 1024). An
    /// empty string is the defaults.
    fn from_str(s: &str) -> Result<Self, TextError> {
        let mut limits = ModelLimits::default();
        let bad = |why: String| TextError::Limits(why);
        for pair in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| bad(format!("`{pair}` is not KEY=N")))?;
            let ceiling = Ceiling::ALL
                .into_iter()
                .find(|c| c.key() == key.trim())
                .ok_or_else(|| {
                    let keys: Vec<_> = Ceiling::ALL.map(Ceiling::key).into();
                    bad(format!("unknown key `{key}` (one of {})", keys.join(", ")))
                })?;
            let value = value.trim();
            let (digits, shift) = match value.char_indices().last() {
                Some((i, 'K' | 'k')) => (&value[..i], 10),
                Some((i, 'M' | 'm')) => (&value[..i], 20),
                Some((i, 'G' | 'g')) => (&value[..i], 30),
                Some((i, 'T' | 't')) => (&value[..i], 40),
                _ => (value, 0),
            };
            let n = digits
                .parse::<u64>()
                .ok()
                .and_then(|n| n.checked_mul(1 << shift))
                .ok_or_else(|| bad(format!("`{value}` for `{key}` is not a count")))?;
            limits = limits.with(ceiling, n);
        }
        Ok(limits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_the_flag_spelling() {
        let limits: ModelLimits = "vocab=8M, merges=100,template-bytes=2k".parse().unwrap();
        assert_eq!(limits.get(Ceiling::Vocab), 8 << 20);
        assert_eq!(limits.get(Ceiling::Merges), 100);
        assert_eq!(limits.get(Ceiling::TemplateBytes), 2048);
        assert_eq!(limits.get(Ceiling::Tensors), 256 << 10);
        assert_eq!("".parse::<ModelLimits>().unwrap(), ModelLimits::default());
        let printed = ModelLimits::default().to_string();
        assert!(printed.starts_with("metadata-items=32M,string-bytes=64M,vocab=4M,"));
        assert_eq!(
            printed.parse::<ModelLimits>().unwrap(),
            ModelLimits::default()
        );
        for bad in ["vocab", "words=3", "vocab=lots", "vocab=99999999999999T"] {
            let err = bad.parse::<ModelLimits>().unwrap_err().to_string();
            assert!(err.contains("--model-limits"), "{bad}: {err}");
        }
    }

    #[test]
    fn an_excess_names_what_and_the_key_that_raises_it() {
        let limits = ModelLimits::default().with(Ceiling::Merges, 10);
        assert!(limits.check(Ceiling::Merges, 10, "merges").is_ok());
        let err = limits
            .check(Ceiling::Merges, 11, "`tokenizer.ggml.merges`")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`tokenizer.ggml.merges`: 11 is above the ceiling of 10")
                && err.contains("--model-limits merges="),
            "{err}"
        );
    }

    /// `--model-limits`' help (tandem-cli, which depends on nothing of this crate) spells the
    /// defaults out: they must be these.
    #[test]
    fn the_flag_help_spells_the_defaults() {
        let help = include_str!("../../cli/src/worker.rs");
        let defaults = format!("`{}`", ModelLimits::default());
        assert!(
            help.contains(&defaults),
            "cli/src/worker.rs must say {defaults}"
        );
    }
}
