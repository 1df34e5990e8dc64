//! `tandem_text::fuzzing::reply` under libFuzzer.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tandem_text::fuzzing::reply(data));
