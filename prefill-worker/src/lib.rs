//! The prefill worker.
