//! `tandem_text::fuzzing::tokenizer_json` under libFuzzer.
#![no_main]

use std::sync::Once;

static DEFAULT_HOOK: Once = Once::new();

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    // libfuzzer-sys's panic hook aborts on every panic, even one caught: tandem reads a
    // tokenizer.json with the tokenizers library's panics caught (it panics on some
    // malformed files), so here the default hook comes back. A panic that escapes still
    // aborts where it leaves the fuzz target (it cannot unwind into libFuzzer): a crash.
    DEFAULT_HOOK.call_once(|| drop(std::panic::take_hook()));
    tandem_text::fuzzing::tokenizer_json(data)
});
