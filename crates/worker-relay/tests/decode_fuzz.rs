//! A bounded randomized run of the frame decoder, so CI exercises what the cargo-fuzz target
//! (`fuzz/fuzz_targets/relay_frames.rs`) does without nightly: no input panics the decoder, every error is
//! typed, and every accepted frame encodes back to exactly its bytes.

use bytes::Bytes;
use proptest::prelude::*;
use worker_relay::protocol::{
    decode_frame, Bind, Binding, ErrorCode, ExitStatus, Frame, FrameDecoder, FrameError, Hello, Peer,
    RelaySignal, Welcome, MAX_DATA,
};
use worker_relay::{Token, TokenHash};

fn check(data: &[u8]) {
    for peer in [Peer::Broker, Peer::Relay] {
        match decode_frame(data, peer) {
            Ok(Some((frame, used))) => {
                let encoded = frame.to_bytes().expect("a decoded frame encodes");
                assert_eq!(&encoded[..], &data[..used]);
            }
            Ok(None) => {}
            Err(error) => {
                // Every error maps to a wire code and a message.
                let _ = (error.code(), error.to_string());
            }
        }
        let mut decoder = FrameDecoder::new(peer);
        let mut offset = 0;
        'feed: for chunk in data.chunks(7) {
            decoder.extend(chunk);
            loop {
                let before = decoder.buffered();
                match decoder.decode() {
                    Ok(Some(frame)) => {
                        let used = before - decoder.buffered();
                        let encoded = frame.to_bytes().expect("a decoded frame encodes");
                        assert_eq!(&encoded[..], &data[offset..offset + used]);
                        offset += used;
                    }
                    Ok(None) => break,
                    Err(error) => {
                        assert_eq!(decoder.decode(), Err(error), "errors are sticky");
                        break 'feed;
                    }
                }
            }
        }
    }
}

fn session() -> impl Strategy<Value = String> {
    "[A-Za-z0-9_-]{1,64}"
}

fn text() -> impl Strategy<Value = String> {
    ".{0,64}"
}

fn frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        (
            session(),
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            any::<[u8; 32]>()
        )
            .prop_map(|(session, generation, epoch, nonce, resume, token)| {
                Frame::Hello(Hello {
                    session,
                    generation,
                    epoch,
                    nonce,
                    resume,
                    token: Token::from_bytes(token),
                })
            }),
        (
            any::<u64>(),
            any::<u64>(),
            1..u64::MAX,
            any::<u32>(),
            any::<bool>(),
            any::<bool>(),
            text()
        )
            .prop_map(
                |(generation, input_acked, output_first, pid, started, exited, working_dir)| {
                    Frame::Welcome(Welcome {
                        generation,
                        input_acked,
                        output_first,
                        pid,
                        started,
                        exited,
                        working_dir,
                    })
                }
            ),
        (1..u64::MAX, proptest::collection::vec(any::<u8>(), 0..512)).prop_map(|(seq, payload)| {
            Frame::Data {
                seq,
                payload: Bytes::from(payload),
            }
        }),
        any::<u64>().prop_map(|seq| Frame::Ack { seq }),
        (1..u64::MAX).prop_map(|seq| Frame::Eof { seq }),
        (1..u64::MAX, any::<bool>(), any::<i32>(), "[^\\x00]{0,64}").prop_map(
            |(seq, signal, value, stderr_tail)| Frame::Exit {
                seq,
                status: if signal {
                    ExitStatus::Signal(value)
                } else {
                    ExitStatus::Code(value)
                },
                stderr_tail,
            }
        ),
        any::<u64>().prop_map(|nonce| Frame::Ping { nonce }),
        any::<u64>().prop_map(|nonce| Frame::Pong { nonce }),
        (
            prop_oneof![
                Just(RelaySignal::Terminate),
                Just(RelaySignal::Kill),
                Just(RelaySignal::Interrupt)
            ],
            any::<u32>()
        )
            .prop_map(|(signal, grace_ms)| Frame::Signal { signal, grace_ms }),
        (any::<u16>(), text()).prop_map(|(code, message)| Frame::error(ErrorCode::from_u16(code), message)),
        (
            any::<[u8; 32]>(),
            session(),
            any::<u64>(),
            any::<[u8; 32]>(),
            prop_oneof![Just(String::new()), "/[a-z/]{0,20}"],
            proptest::collection::btree_map("[A-Za-z_][A-Za-z0-9_]{0,10}", ".{0,20}", 0..4),
        )
            .prop_map(|(bind_token, session, generation, hash, working_dir, env)| {
                let mut binding =
                    Binding::new(session, generation, TokenHash::from_bytes(hash)).working_dir(working_dir);
                for (name, value) in env {
                    binding = binding.env(format!("X{name}"), value.replace('\0', ""));
                }
                Frame::Bind(Bind {
                    bind_token: Token::from_bytes(bind_token),
                    binding,
                })
            }),
        any::<u64>().prop_map(|generation| Frame::Bound { generation }),
    ]
}

fn peer_of(frame: &Frame) -> Peer {
    if frame.frame_type().sent_by(Peer::Broker) {
        Peer::Broker
    } else {
        Peer::Relay
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..600)) {
        check(&data);
    }

    #[test]
    fn bytes_behind_a_valid_header_never_panic(
        frame_type in 0u8..14,
        len in 0u32..300,
        body in proptest::collection::vec(any::<u8>(), 0..300),
    ) {
        let mut data = vec![1, frame_type];
        data.extend_from_slice(&len.to_be_bytes());
        data.extend_from_slice(&body);
        check(&data);
    }

    #[test]
    fn mutated_frames_never_panic(
        frames in proptest::collection::vec(frame(), 1..4),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut data = Vec::new();
        for frame in &frames {
            data.extend_from_slice(&frame.to_bytes().expect("valid frame"));
        }
        check(&data);
        for (at, byte) in flips {
            let i = at.index(data.len());
            data[i] ^= byte;
        }
        check(&data);
        let keep = cut.index(data.len() + 1);
        check(&data[..keep]);
    }

    #[test]
    fn valid_frames_round_trip_through_the_stream_decoder(frames in proptest::collection::vec(frame(), 1..8)) {
        let mut data = Vec::new();
        for frame in &frames {
            data.extend_from_slice(&frame.to_bytes().expect("valid frame"));
        }
        let mut decoded = Vec::new();
        let mut decoders = [FrameDecoder::new(Peer::Broker), FrameDecoder::new(Peer::Relay)];
        let mut offset = 0;
        for frame in &frames {
            let len = frame.to_bytes().expect("valid").len();
            let decoder = &mut decoders[usize::from(peer_of(frame) == Peer::Relay)];
            decoder.extend(&data[offset..offset + len]);
            offset += len;
            decoded.push(decoder.decode().expect("valid").expect("whole frame"));
        }
        prop_assert_eq!(decoded, frames);
    }
}

#[test]
fn oversized_data_cannot_be_built_or_accepted() {
    let frame = Frame::Data {
        seq: 1,
        payload: Bytes::from(vec![0; MAX_DATA + 1]),
    };
    assert!(matches!(frame.to_bytes(), Err(FrameError::TooLarge { .. })));
    let at_limit = Frame::Data {
        seq: 1,
        payload: Bytes::from(vec![0; MAX_DATA]),
    };
    let bytes = at_limit.to_bytes().expect("at the limit");
    assert_eq!(
        decode_frame(&bytes, Peer::Broker).expect("valid").map(|(f, _)| f),
        Some(at_limit)
    );
}
