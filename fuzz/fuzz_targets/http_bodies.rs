//! `tandem_router::fuzzing::http_bodies` under libFuzzer.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = tandem_router::fuzzing::http_bodies(data);
});
