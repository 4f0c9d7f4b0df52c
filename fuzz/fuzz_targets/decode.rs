//! Feeds arbitrary bytes to the wire decoder: it must never panic, and whatever it accepts
//! must be a valid event that encodes back to exactly the bytes it came from (the encoding
//! is canonical), or at least re-decodes to the same event.
#![no_main]

use lease_router::wire::{self, DEFAULT_MAX_EVENT_BYTES};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The router's limit, and a limit large enough to decode anything the fuzzer makes.
    let _ = wire::decode(data, DEFAULT_MAX_EVENT_BYTES);
    if let Ok(envelope) = wire::decode(data, usize::MAX) {
        let bytes = wire::encode(&envelope).expect("a decoded envelope encodes");
        let again = wire::decode(&bytes, usize::MAX).expect("its encoding decodes");
        assert_eq!(again, envelope);
    }
});
