//! `tandem_text::fuzzing::tokenizer_json` under libFuzzer.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tandem_text::fuzzing::tokenizer_json(data));
