//! Feeds arbitrary bytes to the message reader (single events and wire 1.2 batches): it must
//! never panic, a refused batch declares between one event and one per byte, and every
//! event of a readable batch decodes or is refused on its own.
#![no_main]

use lease_router::wire::{self, Message, MessageLimits};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match wire::decode_message(data, MessageLimits::default()) {
        Message::Event(_) => {}
        Message::Refused { events, .. } => assert!((1..=data.len().max(1)).contains(&events)),
        Message::Batch(events) => {
            let declared = events.len();
            assert_eq!(events.count(), declared);
        }
    }
});
