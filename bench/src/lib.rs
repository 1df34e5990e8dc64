//! vLLM-compatible serving benchmark.
