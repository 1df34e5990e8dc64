//! Tokenizers, chat templates and incremental detokenization, without any model code.
