//! `tandem_text::fuzzing::guide` under libFuzzer.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tandem_text::fuzzing::guide(data));
