//! `tandem_engine::fuzzing::config_json` under libFuzzer.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tandem_engine::fuzzing::config_json(data));
