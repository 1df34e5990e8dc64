//! `tandem_engine::fuzzing::safetensors_header` under libFuzzer.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tandem_engine::fuzzing::safetensors_header(data));
