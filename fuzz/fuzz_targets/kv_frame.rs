//! `tandem_transfer::fuzzing::kv_frame` under libFuzzer.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tandem_transfer::fuzzing::kv_frame(data));
