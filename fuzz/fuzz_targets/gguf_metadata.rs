//! `tandem_text::fuzzing::gguf_metadata` under libFuzzer.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tandem_text::fuzzing::gguf_metadata(data));
