//! Fuzzes the frame decoder: no input may panic it, and every frame it accepts must encode back
//! to exactly the bytes it was decoded from.
//!
//! Run: `./scripts/fuzz 300 relay_frames`

#![no_main]

use libfuzzer_sys::fuzz_target;
use worker_relay::protocol::{decode_frame, Frame, FrameDecoder, Peer};

fn check_canonical(frame: &Frame, bytes: &[u8]) {
    let encoded = frame.to_bytes().expect("a decoded frame encodes");
    assert_eq!(&encoded[..], bytes, "decoding then encoding changed the bytes");
}

fuzz_target!(|data: &[u8]| {
    for peer in [Peer::Broker, Peer::Relay] {
        // Stateless: one frame from the start of the input.
        if let Ok(Some((frame, used))) = decode_frame(data, peer) {
            check_canonical(&frame, &data[..used]);
        }
        // Incremental: the same bytes in uneven pieces, every frame until an error.
        let mut decoder = FrameDecoder::new(peer);
        let step = data.first().map_or(1, |b| usize::from(*b % 13) + 1);
        let mut offset = 0;
        'feed: for chunk in data.chunks(step) {
            decoder.extend(chunk);
            loop {
                let before = decoder.buffered();
                match decoder.decode() {
                    Ok(Some(frame)) => {
                        // Frames are taken from the front, so this one is the next `used` bytes.
                        let used = before - decoder.buffered();
                        check_canonical(&frame, &data[offset..offset + used]);
                        offset += used;
                    }
                    Ok(None) => break,
                    Err(_) => break 'feed,
                }
            }
        }
    }
});
