//! `tandem_worker::fuzzing::grpc_handlers` under libFuzzer.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tandem_worker::fuzzing::grpc_handlers(data));
