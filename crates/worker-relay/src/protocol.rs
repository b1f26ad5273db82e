//! The wire protocol: frames, their binary encoding, and a decoder that rejects every malformed,
//! oversized, misdirected or out-of-order frame with a typed [`FrameError`].
//!
//! # Framing
//!
//! Every frame is a 6-byte header followed by a payload; integers are big-endian. Frames travel
//! only inside the [`channel`](crate::channel::SecureStream)'s encrypted records, after its
//! handshake: this layer neither authenticates nor encrypts, and needs not.
//!
//! ```text
//! +---------+------+----------------+=====================+
//! | version | type | payload length |  payload            |
//! |   u8    |  u8  |      u32       |  0..=1 MiB          |
//! +---------+------+----------------+=====================+
//! ```
//!
//! The version is [`VERSION`]. A length above [`MAX_PAYLOAD`] is rejected as soon as the header
//! is read, before anything is allocated. Strings are UTF-8 with a `u16` (or, for the session id,
//! `u8`) length prefix. The payload of each frame type is documented on its [`Frame`] variant.
//!
//! # Sequences
//!
//! Each direction numbers its stream items from 1: agent output ([`Frame::Data`], [`Frame::Eof`],
//! [`Frame::Exit`]) on the relay side, agent input ([`Frame::Data`], [`Frame::Eof`]) on the broker
//! side. [`Frame::Ack`] acknowledges every item up to a sequence number. A receiver drops
//! duplicates and rejects gaps ([`Sequencer`]).

use std::collections::VecDeque;
use std::fmt;
use std::io;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::token::{Token, TOKEN_LEN};

mod bind;

pub use self::bind::{Bind, Binding, MAX_BIND_ENV_BYTES, RESERVED_ENV_PREFIX};

/// The protocol (and framing) version this crate speaks.
pub const VERSION: u8 = 1;

/// Version bytes a future protocol may use; any other first byte is not a frame at all.
const PLAUSIBLE_VERSIONS: std::ops::RangeInclusive<u8> = 1..=31;

/// Length of a frame header: version, type, payload length.
pub const HEADER_LEN: usize = 6;

/// The largest payload a frame may carry (1 MiB).
pub const MAX_PAYLOAD: usize = 1 << 20;

/// The largest chunk of stream bytes one [`Frame::Data`] may carry.
pub const MAX_DATA: usize = MAX_PAYLOAD - 8;

/// The longest session id a [`Hello`] may carry.
pub const MAX_SESSION_LEN: usize = 64;

/// The longest text (error message, working directory) a frame may carry, in bytes.
pub const MAX_TEXT_LEN: usize = 4096;

/// A stream sequence number; the first item of a stream is 1, and 0 means "nothing yet".
pub type Seq = u64;

/// Which side of a connection sent a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Peer {
    /// The broker (the client).
    Broker,
    /// The relay inside the worker (the server).
    Relay,
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Peer::Broker => "broker",
            Peer::Relay => "relay",
        })
    }
}

/// The type byte of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FrameType {
    /// `0x01`, broker to relay: opens a connection.
    Hello,
    /// `0x02`, relay to broker: accepts a hello.
    Welcome,
    /// `0x03`, both ways: stream bytes.
    Data,
    /// `0x04`, both ways: acknowledges stream items.
    Ack,
    /// `0x05`, both ways: end of one direction of the stream.
    Eof,
    /// `0x06`, relay to broker: how the agent ended.
    Exit,
    /// `0x07`, both ways: heartbeat.
    Ping,
    /// `0x08`, both ways: heartbeat answer.
    Pong,
    /// `0x09`, broker to relay: signal the agent.
    Signal,
    /// `0x0a`, both ways: a refusal or failure, with a machine-readable code.
    Error,
    /// `0x0b`, broker to relay: binds an unbound relay to a session.
    Bind,
    /// `0x0c`, relay to broker: the relay is bound as asked.
    Bound,
}

impl FrameType {
    /// Every frame type, in wire order.
    pub const ALL: [FrameType; 12] = [
        FrameType::Hello,
        FrameType::Welcome,
        FrameType::Data,
        FrameType::Ack,
        FrameType::Eof,
        FrameType::Exit,
        FrameType::Ping,
        FrameType::Pong,
        FrameType::Signal,
        FrameType::Error,
        FrameType::Bind,
        FrameType::Bound,
    ];

    /// The type byte.
    pub const fn to_u8(self) -> u8 {
        match self {
            FrameType::Hello => 1,
            FrameType::Welcome => 2,
            FrameType::Data => 3,
            FrameType::Ack => 4,
            FrameType::Eof => 5,
            FrameType::Exit => 6,
            FrameType::Ping => 7,
            FrameType::Pong => 8,
            FrameType::Signal => 9,
            FrameType::Error => 10,
            FrameType::Bind => 11,
            FrameType::Bound => 12,
        }
    }

    /// The frame type of a type byte, if it is one.
    pub const fn from_u8(byte: u8) -> Option<Self> {
        Some(match byte {
            1 => FrameType::Hello,
            2 => FrameType::Welcome,
            3 => FrameType::Data,
            4 => FrameType::Ack,
            5 => FrameType::Eof,
            6 => FrameType::Exit,
            7 => FrameType::Ping,
            8 => FrameType::Pong,
            9 => FrameType::Signal,
            10 => FrameType::Error,
            11 => FrameType::Bind,
            12 => FrameType::Bound,
            _ => return None,
        })
    }

    /// The lower-case name of the type.
    pub const fn name(self) -> &'static str {
        match self {
            FrameType::Hello => "hello",
            FrameType::Welcome => "welcome",
            FrameType::Data => "data",
            FrameType::Ack => "ack",
            FrameType::Eof => "eof",
            FrameType::Exit => "exit",
            FrameType::Ping => "ping",
            FrameType::Pong => "pong",
            FrameType::Signal => "signal",
            FrameType::Error => "error",
            FrameType::Bind => "bind",
            FrameType::Bound => "bound",
        }
    }

    /// Whether `peer` may send frames of this type.
    pub const fn sent_by(self, peer: Peer) -> bool {
        match self {
            FrameType::Hello | FrameType::Signal | FrameType::Bind => matches!(peer, Peer::Broker),
            FrameType::Welcome | FrameType::Exit | FrameType::Bound => matches!(peer, Peer::Relay),
            FrameType::Data
            | FrameType::Ack
            | FrameType::Eof
            | FrameType::Ping
            | FrameType::Pong
            | FrameType::Error => true,
        }
    }
}

impl fmt::Display for FrameType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The first frame of every connection, broker to relay, sent once the channel is open (so the
/// token never crosses the wire in the clear, and a hello captured from one connection opens no
/// other).
///
/// Payload: `generation u64, epoch u64, nonce u64, resume u64, token [u8; 32], session (u8 length,
/// 1..=64 bytes of ASCII letters, digits, `-` and `_`)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The session the broker means to reach.
    pub session: String,
    /// The worker generation the broker means to reach.
    pub generation: u64,
    /// The broker's epoch; a newer epoch replaces the current connection, an older one is refused,
    /// and one further ahead of the relay's clock than
    /// [`EPOCH_LEEWAY`](crate::server::EPOCH_LEEWAY) is refused too (see the crate's "Epochs").
    pub epoch: u64,
    /// Strictly increasing within one epoch; a hello that does not raise it is sent again (by
    /// the broker itself, since the channel keeps captured hellos from being replayed).
    pub nonce: u64,
    /// The last agent output item the broker holds, or 0 for "everything you still have".
    pub resume: Seq,
    /// `HMAC-SHA256(broker key, session, generation)`; see [`BrokerKey`](crate::BrokerKey).
    pub token: Token,
}

/// The relay's acceptance of a [`Hello`].
///
/// Payload: `generation u64, input_acked u64, output_first u64, pid u32, flags u8 (bit 0: the
/// agent was started by this hello, bit 1: the agent has exited), working_dir (u16 length,
/// UTF-8)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Welcome {
    /// The worker's generation.
    pub generation: u64,
    /// The last broker input item the relay accepted; the broker resends from the next one.
    pub input_acked: Seq,
    /// The sequence number of the first agent output item the relay sends on this connection.
    pub output_first: Seq,
    /// The agent's process id inside the worker.
    pub pid: u32,
    /// Whether this hello started the agent (otherwise it was already running).
    pub started: bool,
    /// Whether the agent has already exited (its exit item follows in the output).
    pub exited: bool,
    /// The agent's working directory inside the worker.
    pub working_dir: String,
}

/// How the agent ended, as carried by [`Frame::Exit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExitStatus {
    /// It exited with this code (wire kind 0).
    Code(i32),
    /// It was killed by this signal (wire kind 1).
    Signal(i32),
}

impl ExitStatus {
    /// The conventional process exit code for this status: the code, or 128 + the signal.
    pub fn as_exit_code(&self) -> i32 {
        match *self {
            ExitStatus::Code(code) => code,
            ExitStatus::Signal(signal) => 128 + signal,
        }
    }
}

impl From<ExitStatus> for session_runtime::WorkerExit {
    fn from(status: ExitStatus) -> Self {
        match status {
            ExitStatus::Code(code) => session_runtime::WorkerExit::Code(code),
            ExitStatus::Signal(signal) => session_runtime::WorkerExit::Signal(signal),
        }
    }
}

impl fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExitStatus::Code(code) => write!(f, "exited with code {code}"),
            ExitStatus::Signal(signal) => write!(f, "killed by signal {signal}"),
        }
    }
}

/// A signal the broker may ask the relay to send to the agent's process group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RelaySignal {
    /// `SIGTERM` (15); with a grace period, `SIGKILL` follows if the agent outlives it.
    Terminate,
    /// `SIGKILL` (9).
    Kill,
    /// `SIGINT` (2).
    Interrupt,
}

impl RelaySignal {
    /// The signal number on the wire (Linux numbering).
    pub const fn number(self) -> u8 {
        match self {
            RelaySignal::Terminate => 15,
            RelaySignal::Kill => 9,
            RelaySignal::Interrupt => 2,
        }
    }

    /// The signal for a wire number, if it is one the protocol allows.
    pub const fn from_number(number: u8) -> Option<Self> {
        match number {
            15 => Some(RelaySignal::Terminate),
            9 => Some(RelaySignal::Kill),
            2 => Some(RelaySignal::Interrupt),
            _ => None,
        }
    }
}

/// The machine-readable code of a [`Frame::Error`].
///
/// Unknown codes from a newer peer decode as [`ErrorCode::Unknown`] rather than failing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorCode {
    /// 1: bytes that are not a valid frame (garbage, an unknown type, a bad field or length).
    BadFrame,
    /// 2: a frame of another protocol version (first byte 2 to 31).
    UnsupportedVersion,
    /// 3: a frame the receiver does not accept in this state (a second hello, data before hello, a
    /// frame type the sender may not send).
    UnexpectedFrame,
    /// 4: a stream item or acknowledgement out of sequence (a gap, or an ack of the future).
    OutOfOrder,
    /// 5: a frame longer than [`MAX_PAYLOAD`].
    FrameTooLarge,
    /// 6: the hello names another session.
    SessionMismatch,
    /// 7: the hello names another generation than this worker's.
    StaleGeneration,
    /// 8: the token does not match.
    BadToken,
    /// 9: the hello's epoch is older than one the relay has accepted.
    StaleEpoch,
    /// 10: the hello's nonce does not exceed the last accepted one of its epoch.
    ReplayedHello,
    /// 11: output the broker asked to resume from is no longer buffered.
    ResumeGap,
    /// 12: a newer connection took over; this one is closed.
    Superseded,
    /// 13: the agent could not be started.
    SpawnFailed,
    /// 14: no hello arrived in time.
    HandshakeTimeout,
    /// 15: the peer sent nothing for longer than the idle timeout.
    IdleTimeout,
    /// 16: an internal failure of the sender.
    Internal,
    /// 17: the broker sent more input than the relay holds unwritten (see the relay's
    /// `input_bytes`): its input window is larger than the relay allows.
    InputOverflow,
    /// 18: the hello's epoch lies further ahead of the relay's clock than
    /// [`EPOCH_LEEWAY`](crate::server::EPOCH_LEEWAY) allows: no broker started yet, so the relay
    /// does not let it fence the brokers that did (see the crate's "Epochs"). A broker whose clock
    /// runs ahead is admitted once the relay's clock catches up, so the client retries.
    EpochAhead,
    /// 19: a `bind` to a relay already bound to another binding (another session, generation,
    /// token hash, working directory or environment); nothing changed. The same binding again is
    /// answered with `bound`.
    AlreadyBound,
    /// A code this version does not know.
    Unknown(u16),
}

impl ErrorCode {
    /// Every known code.
    pub const KNOWN: [ErrorCode; 19] = [
        ErrorCode::BadFrame,
        ErrorCode::UnsupportedVersion,
        ErrorCode::UnexpectedFrame,
        ErrorCode::OutOfOrder,
        ErrorCode::FrameTooLarge,
        ErrorCode::SessionMismatch,
        ErrorCode::StaleGeneration,
        ErrorCode::BadToken,
        ErrorCode::StaleEpoch,
        ErrorCode::ReplayedHello,
        ErrorCode::ResumeGap,
        ErrorCode::Superseded,
        ErrorCode::SpawnFailed,
        ErrorCode::HandshakeTimeout,
        ErrorCode::IdleTimeout,
        ErrorCode::Internal,
        ErrorCode::InputOverflow,
        ErrorCode::EpochAhead,
        ErrorCode::AlreadyBound,
    ];

    /// The code on the wire.
    pub const fn to_u16(self) -> u16 {
        match self {
            ErrorCode::BadFrame => 1,
            ErrorCode::UnsupportedVersion => 2,
            ErrorCode::UnexpectedFrame => 3,
            ErrorCode::OutOfOrder => 4,
            ErrorCode::FrameTooLarge => 5,
            ErrorCode::SessionMismatch => 6,
            ErrorCode::StaleGeneration => 7,
            ErrorCode::BadToken => 8,
            ErrorCode::StaleEpoch => 9,
            ErrorCode::ReplayedHello => 10,
            ErrorCode::ResumeGap => 11,
            ErrorCode::Superseded => 12,
            ErrorCode::SpawnFailed => 13,
            ErrorCode::HandshakeTimeout => 14,
            ErrorCode::IdleTimeout => 15,
            ErrorCode::Internal => 16,
            ErrorCode::InputOverflow => 17,
            ErrorCode::EpochAhead => 18,
            ErrorCode::AlreadyBound => 19,
            ErrorCode::Unknown(code) => code,
        }
    }

    /// The code for a wire value.
    pub const fn from_u16(code: u16) -> Self {
        match code {
            1 => ErrorCode::BadFrame,
            2 => ErrorCode::UnsupportedVersion,
            3 => ErrorCode::UnexpectedFrame,
            4 => ErrorCode::OutOfOrder,
            5 => ErrorCode::FrameTooLarge,
            6 => ErrorCode::SessionMismatch,
            7 => ErrorCode::StaleGeneration,
            8 => ErrorCode::BadToken,
            9 => ErrorCode::StaleEpoch,
            10 => ErrorCode::ReplayedHello,
            11 => ErrorCode::ResumeGap,
            12 => ErrorCode::Superseded,
            13 => ErrorCode::SpawnFailed,
            14 => ErrorCode::HandshakeTimeout,
            15 => ErrorCode::IdleTimeout,
            16 => ErrorCode::Internal,
            17 => ErrorCode::InputOverflow,
            18 => ErrorCode::EpochAhead,
            19 => ErrorCode::AlreadyBound,
            other => ErrorCode::Unknown(other),
        }
    }

    /// The kebab-case name of the code, e.g. `resume-gap`.
    pub const fn name(self) -> &'static str {
        match self {
            ErrorCode::BadFrame => "bad-frame",
            ErrorCode::UnsupportedVersion => "unsupported-version",
            ErrorCode::UnexpectedFrame => "unexpected-frame",
            ErrorCode::OutOfOrder => "out-of-order",
            ErrorCode::FrameTooLarge => "frame-too-large",
            ErrorCode::SessionMismatch => "session-mismatch",
            ErrorCode::StaleGeneration => "stale-generation",
            ErrorCode::BadToken => "bad-token",
            ErrorCode::StaleEpoch => "stale-epoch",
            ErrorCode::ReplayedHello => "replayed-hello",
            ErrorCode::ResumeGap => "resume-gap",
            ErrorCode::Superseded => "superseded",
            ErrorCode::SpawnFailed => "spawn-failed",
            ErrorCode::HandshakeTimeout => "handshake-timeout",
            ErrorCode::IdleTimeout => "idle-timeout",
            ErrorCode::Internal => "internal",
            ErrorCode::InputOverflow => "input-overflow",
            ErrorCode::EpochAhead => "epoch-ahead",
            ErrorCode::AlreadyBound => "already-bound",
            ErrorCode::Unknown(_) => "unknown",
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ErrorCode::Unknown(code) => write!(f, "unknown-{code}"),
            known => f.write_str(known.name()),
        }
    }
}

/// One protocol frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Opens a connection (broker to relay); see [`Hello`].
    Hello(Hello),
    /// Accepts a hello (relay to broker); see [`Welcome`].
    Welcome(Welcome),
    /// Stream bytes: agent stdout (relay to broker) or stdin (broker to relay).
    ///
    /// Payload: `seq u64, bytes (the rest, at most` [`MAX_DATA`]`)`.
    Data {
        /// The item's sequence number (at least 1).
        seq: Seq,
        /// The bytes.
        payload: Bytes,
    },
    /// Acknowledges every stream item up to and including `seq` of the other side's stream.
    ///
    /// Payload: `seq u64`.
    Ack {
        /// The last item received.
        seq: Seq,
    },
    /// End of the sender's stream: the agent closed stdout (relay), or the broker closed the
    /// agent's stdin (broker). Takes a sequence number like data.
    ///
    /// Payload: `seq u64`.
    Eof {
        /// The item's sequence number (at least 1).
        seq: Seq,
    },
    /// How the agent ended; the last item of the relay's stream.
    ///
    /// Payload: `seq u64, kind u8 (0 code, 1 signal), value i32`, then, when the agent wrote to
    /// its standard error, `stderr_tail (u16 length, UTF-8)`. A relay older than the field never
    /// sends it; a broker older than it refuses an exit that carries it, so upgrade brokers
    /// before worker images.
    Exit {
        /// The item's sequence number (at least 1).
        seq: Seq,
        /// How it ended.
        status: ExitStatus,
        /// The last lines the agent wrote to its standard error (at most [`MAX_TEXT_LEN`]
        /// bytes), empty when it wrote none: why an agent that could not start said it could not.
        stderr_tail: String,
    },
    /// Heartbeat; the receiver answers with [`Frame::Pong`] carrying the same nonce.
    ///
    /// Payload: `nonce u64`.
    Ping {
        /// Echoed by the pong.
        nonce: u64,
    },
    /// Heartbeat answer.
    ///
    /// Payload: `nonce u64`.
    Pong {
        /// The ping's nonce.
        nonce: u64,
    },
    /// Asks the relay to signal the agent's process group (broker to relay).
    ///
    /// Payload: `signal u8 (15, 9 or 2), grace_ms u32`.
    Signal {
        /// Which signal.
        signal: RelaySignal,
        /// For [`RelaySignal::Terminate`]: `SIGKILL` follows after this many milliseconds if the
        /// agent is still running; 0 means never.
        grace_ms: u32,
    },
    /// A refusal or failure; the sender closes the connection after it.
    ///
    /// Payload: `code u16, message (u16 length, UTF-8, at most` [`MAX_TEXT_LEN`] `bytes)`.
    Error {
        /// What went wrong, for machines.
        code: ErrorCode,
        /// What went wrong, for people.
        message: String,
    },
    /// Binds an unbound relay (broker to relay); see [`Bind`].
    Bind(Bind),
    /// The relay is bound as the [`Bind`] asked (relay to broker); it closes the connection.
    ///
    /// Payload: `generation u64`, the bound generation, echoed.
    Bound {
        /// The generation the relay is bound to.
        generation: u64,
    },
}

impl Frame {
    /// An error frame; the message is cut to [`MAX_TEXT_LEN`] bytes at a character boundary.
    pub fn error(code: ErrorCode, message: impl Into<String>) -> Self {
        Frame::Error {
            code,
            message: truncate(message.into(), MAX_TEXT_LEN),
        }
    }

    /// The frame's type.
    pub fn frame_type(&self) -> FrameType {
        match self {
            Frame::Hello(_) => FrameType::Hello,
            Frame::Welcome(_) => FrameType::Welcome,
            Frame::Data { .. } => FrameType::Data,
            Frame::Ack { .. } => FrameType::Ack,
            Frame::Eof { .. } => FrameType::Eof,
            Frame::Exit { .. } => FrameType::Exit,
            Frame::Ping { .. } => FrameType::Ping,
            Frame::Pong { .. } => FrameType::Pong,
            Frame::Signal { .. } => FrameType::Signal,
            Frame::Error { .. } => FrameType::Error,
            Frame::Bind(_) => FrameType::Bind,
            Frame::Bound { .. } => FrameType::Bound,
        }
    }

    /// The stream sequence number of a data, eof or exit frame.
    pub fn seq(&self) -> Option<Seq> {
        match self {
            Frame::Data { seq, .. } | Frame::Eof { seq } | Frame::Exit { seq, .. } => Some(*seq),
            _ => None,
        }
    }

    /// Appends the encoded frame to `out`.
    ///
    /// # Errors
    /// [`FrameError::TooLarge`] or [`FrameError::InvalidField`] if the frame could not be decoded
    /// by a peer (too much data, an over-long string, a bad session id, sequence number 0); `out`
    /// is then unchanged.
    pub fn encode(&self, out: &mut BytesMut) -> Result<(), FrameError> {
        self.validate()?;
        let frame_type = self.frame_type();
        let start = out.len();
        out.put_u8(VERSION);
        out.put_u8(frame_type.to_u8());
        out.put_u32(0);
        match self {
            Frame::Hello(hello) => {
                out.put_u64(hello.generation);
                out.put_u64(hello.epoch);
                out.put_u64(hello.nonce);
                out.put_u64(hello.resume);
                out.put_slice(hello.token.as_bytes());
                out.put_u8(hello.session.len() as u8);
                out.put_slice(hello.session.as_bytes());
            }
            Frame::Welcome(welcome) => {
                out.put_u64(welcome.generation);
                out.put_u64(welcome.input_acked);
                out.put_u64(welcome.output_first);
                out.put_u32(welcome.pid);
                out.put_u8(u8::from(welcome.started) | (u8::from(welcome.exited) << 1));
                put_text(out, &welcome.working_dir);
            }
            Frame::Data { seq, payload } => {
                out.put_u64(*seq);
                out.put_slice(payload);
            }
            Frame::Ack { seq } | Frame::Eof { seq } => out.put_u64(*seq),
            Frame::Exit {
                seq,
                status,
                stderr_tail,
            } => {
                out.put_u64(*seq);
                let (kind, value) = match *status {
                    ExitStatus::Code(code) => (0, code),
                    ExitStatus::Signal(signal) => (1, signal),
                };
                out.put_u8(kind);
                out.put_i32(value);
                if !stderr_tail.is_empty() {
                    put_text(out, stderr_tail);
                }
            }
            Frame::Ping { nonce } | Frame::Pong { nonce } => out.put_u64(*nonce),
            Frame::Signal { signal, grace_ms } => {
                out.put_u8(signal.number());
                out.put_u32(*grace_ms);
            }
            Frame::Error { code, message } => {
                out.put_u16(code.to_u16());
                put_text(out, message);
            }
            Frame::Bind(bind) => bind.encode_payload(out),
            Frame::Bound { generation } => out.put_u64(*generation),
        }
        let len = out.len() - start - HEADER_LEN;
        // `validate` bounded every field, so the payload fits the header's u32.
        out[start + 2..start + HEADER_LEN].copy_from_slice(&(len as u32).to_be_bytes());
        Ok(())
    }

    /// The encoded frame.
    ///
    /// # Errors
    /// As [`Frame::encode`].
    pub fn to_bytes(&self) -> Result<Bytes, FrameError> {
        let mut out = BytesMut::with_capacity(HEADER_LEN + self.payload_hint());
        self.encode(&mut out)?;
        Ok(out.freeze())
    }

    fn payload_hint(&self) -> usize {
        match self {
            Frame::Data { payload, .. } => 8 + payload.len(),
            Frame::Hello(hello) => 65 + hello.session.len(),
            Frame::Welcome(welcome) => 31 + welcome.working_dir.len(),
            Frame::Error { message, .. } => 4 + message.len(),
            Frame::Bind(bind) => bind.payload_len(),
            _ => 16,
        }
    }

    fn validate(&self) -> Result<(), FrameError> {
        let frame_type = self.frame_type();
        let invalid = |field, reason| {
            Err(FrameError::InvalidField {
                frame_type,
                field,
                reason,
            })
        };
        match self {
            Frame::Hello(hello) => {
                if let Err(reason) = check_session(hello.session.as_bytes()) {
                    return invalid("session", reason);
                }
            }
            Frame::Bind(bind) => {
                if let Err((field, reason)) = bind.binding.check() {
                    return invalid(field, reason);
                }
            }
            Frame::Welcome(welcome) if welcome.working_dir.len() > MAX_TEXT_LEN => {
                return invalid("working_dir", "longer than 4096 bytes")
            }
            Frame::Error { message, .. } if message.len() > MAX_TEXT_LEN => {
                return invalid("message", "longer than 4096 bytes")
            }
            Frame::Exit { stderr_tail, .. } if stderr_tail.len() > MAX_TEXT_LEN => {
                return invalid("stderr_tail", "longer than 4096 bytes")
            }
            Frame::Data { payload, .. } if payload.len() > MAX_DATA => {
                return Err(FrameError::TooLarge {
                    len: (payload.len() + 8) as u64,
                    max: MAX_PAYLOAD,
                })
            }
            _ => {}
        }
        if self.seq() == Some(0) {
            return invalid("seq", "sequence numbers start at 1");
        }
        Ok(())
    }
}

fn put_text(out: &mut BytesMut, text: &str) {
    out.put_u16(text.len() as u16);
    out.put_slice(text.as_bytes());
}

fn truncate(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut cut = max;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
    text
}

fn check_session(session: &[u8]) -> Result<(), &'static str> {
    if session.is_empty() {
        return Err("empty");
    }
    if session.len() > MAX_SESSION_LEN {
        return Err("longer than 64 bytes");
    }
    if !session
        .iter()
        .all(|b| b.is_ascii_alphanumeric() || *b == b'-' || *b == b'_')
    {
        return Err("not made of ASCII letters, digits, '-' and '_'");
    }
    Ok(())
}

/// Why bytes could not be decoded as a frame, or a frame was not acceptable where it arrived.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The first byte cannot start a frame of any version (0, or above 31): garbage.
    #[error("not a frame: first byte {first_byte:#04x}")]
    NotAFrame {
        /// The byte received.
        first_byte: u8,
    },
    /// The version byte is a plausible version (2 to 31), but not [`VERSION`].
    #[error("unsupported protocol version {version} (this side speaks {VERSION})")]
    UnsupportedVersion {
        /// The version byte received.
        version: u8,
    },
    /// The type byte names no frame type.
    #[error("unknown frame type {frame_type}")]
    UnknownType {
        /// The type byte received.
        frame_type: u8,
    },
    /// A frame type this peer never sends (e.g. a hello from the relay).
    #[error("a {frame_type} frame cannot come from the {from}")]
    WrongDirection {
        /// The frame's type.
        frame_type: FrameType,
        /// Who sent it.
        from: Peer,
    },
    /// The payload length exceeds the limit.
    #[error("frame payload of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// The announced payload length.
        len: u64,
        /// The limit.
        max: usize,
    },
    /// The payload ends before a field does.
    #[error("{frame_type} frame is truncated at {field}")]
    Truncated {
        /// The frame's type.
        frame_type: FrameType,
        /// The first field that did not fit.
        field: &'static str,
    },
    /// The payload is longer than its fields.
    #[error("{frame_type} frame has {extra} bytes after its last field")]
    TrailingBytes {
        /// The frame's type.
        frame_type: FrameType,
        /// How many bytes are left over.
        extra: usize,
    },
    /// A field holds a value the protocol does not allow.
    #[error("{frame_type} frame has an invalid {field}: {reason}")]
    InvalidField {
        /// The frame's type.
        frame_type: FrameType,
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A stream item skipped ahead, or an acknowledgement covers items never sent.
    #[error("sequence number {got} arrived where at most {expected} was acceptable")]
    OutOfOrder {
        /// The highest acceptable sequence number.
        expected: Seq,
        /// The sequence number received.
        got: Seq,
    },
}

impl FrameError {
    /// The [`ErrorCode`] a receiver reports for this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            FrameError::UnsupportedVersion { .. } => ErrorCode::UnsupportedVersion,
            FrameError::WrongDirection { .. } => ErrorCode::UnexpectedFrame,
            FrameError::TooLarge { .. } => ErrorCode::FrameTooLarge,
            FrameError::OutOfOrder { .. } => ErrorCode::OutOfOrder,
            FrameError::NotAFrame { .. }
            | FrameError::UnknownType { .. }
            | FrameError::Truncated { .. }
            | FrameError::TrailingBytes { .. }
            | FrameError::InvalidField { .. } => ErrorCode::BadFrame,
        }
    }
}

/// Decodes one frame from the start of `buf`.
///
/// Returns `Ok(None)` while `buf` holds only a valid prefix of a frame, and `Ok(Some((frame,
/// consumed)))` once a whole frame is there. A bad version, type or length is reported as soon as
/// its byte arrives, before the payload.
///
/// # Errors
/// A [`FrameError`] for every malformed or oversized frame, or a frame type `from` never sends.
pub fn decode_frame(buf: &[u8], from: Peer) -> Result<Option<(Frame, usize)>, FrameError> {
    let Some(len) = check_header(buf, from, MAX_PAYLOAD)? else {
        return Ok(None);
    };
    let total = HEADER_LEN + len;
    if buf.len() < total {
        return Ok(None);
    }
    let frame_type = FrameType::from_u8(buf[1]).ok_or(FrameError::UnknownType { frame_type: buf[1] })?;
    let payload = Bytes::copy_from_slice(&buf[HEADER_LEN..total]);
    Ok(Some((parse_payload(frame_type, payload)?, total)))
}

/// Checks as much of a header as `buf` holds; the payload length once the header is complete.
fn check_header(buf: &[u8], from: Peer, max_payload: usize) -> Result<Option<usize>, FrameError> {
    if let Some(&version) = buf.first() {
        if version != VERSION {
            return Err(if PLAUSIBLE_VERSIONS.contains(&version) {
                FrameError::UnsupportedVersion { version }
            } else {
                FrameError::NotAFrame { first_byte: version }
            });
        }
    }
    if let Some(&byte) = buf.get(1) {
        let frame_type = FrameType::from_u8(byte).ok_or(FrameError::UnknownType { frame_type: byte })?;
        if !frame_type.sent_by(from) {
            return Err(FrameError::WrongDirection { frame_type, from });
        }
    }
    if buf.len() < HEADER_LEN {
        return Ok(None);
    }
    let len = u32::from_be_bytes([buf[2], buf[3], buf[4], buf[5]]);
    if len as usize > max_payload {
        return Err(FrameError::TooLarge {
            len: u64::from(len),
            max: max_payload,
        });
    }
    Ok(Some(len as usize))
}

/// Reads fields off a payload.
struct Fields {
    frame_type: FrameType,
    payload: Bytes,
}

impl Fields {
    fn need(&self, n: usize, field: &'static str) -> Result<(), FrameError> {
        if self.payload.remaining() < n {
            Err(FrameError::Truncated {
                frame_type: self.frame_type,
                field,
            })
        } else {
            Ok(())
        }
    }

    fn u8(&mut self, field: &'static str) -> Result<u8, FrameError> {
        self.need(1, field)?;
        Ok(self.payload.get_u8())
    }

    fn u16(&mut self, field: &'static str) -> Result<u16, FrameError> {
        self.need(2, field)?;
        Ok(self.payload.get_u16())
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, FrameError> {
        self.need(4, field)?;
        Ok(self.payload.get_u32())
    }

    fn i32(&mut self, field: &'static str) -> Result<i32, FrameError> {
        self.need(4, field)?;
        Ok(self.payload.get_i32())
    }

    fn u64(&mut self, field: &'static str) -> Result<u64, FrameError> {
        self.need(8, field)?;
        Ok(self.payload.get_u64())
    }

    fn seq(&mut self) -> Result<Seq, FrameError> {
        let seq = self.u64("seq")?;
        if seq == 0 {
            return Err(self.invalid("seq", "sequence numbers start at 1"));
        }
        Ok(seq)
    }

    fn bytes(&mut self, n: usize, field: &'static str) -> Result<Bytes, FrameError> {
        self.need(n, field)?;
        Ok(self.payload.split_to(n))
    }

    fn text(&mut self, field: &'static str) -> Result<String, FrameError> {
        let len = self.u16(field)? as usize;
        if len > MAX_TEXT_LEN {
            return Err(self.invalid(field, "longer than 4096 bytes"));
        }
        let bytes = self.bytes(len, field)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.invalid(field, "not UTF-8"))
    }

    fn rest(&mut self) -> Bytes {
        std::mem::take(&mut self.payload)
    }

    fn invalid(&self, field: &'static str, reason: &'static str) -> FrameError {
        FrameError::InvalidField {
            frame_type: self.frame_type,
            field,
            reason,
        }
    }

    fn finish(self, frame: Frame) -> Result<Frame, FrameError> {
        if self.payload.is_empty() {
            Ok(frame)
        } else {
            Err(FrameError::TrailingBytes {
                frame_type: self.frame_type,
                extra: self.payload.len(),
            })
        }
    }
}

fn parse_payload(frame_type: FrameType, payload: Bytes) -> Result<Frame, FrameError> {
    let mut f = Fields { frame_type, payload };
    let frame = match frame_type {
        FrameType::Hello => {
            let generation = f.u64("generation")?;
            let epoch = f.u64("epoch")?;
            let nonce = f.u64("nonce")?;
            let resume = f.u64("resume")?;
            let token = f.bytes(TOKEN_LEN, "token")?;
            let token = Token::from_slice(&token).ok_or(f.invalid("token", "not 32 bytes"))?;
            let len = f.u8("session")? as usize;
            let session = f.bytes(len, "session")?;
            check_session(&session).map_err(|reason| f.invalid("session", reason))?;
            // check_session admits ASCII only, so this cannot fail.
            let session =
                String::from_utf8(session.to_vec()).map_err(|_| f.invalid("session", "not UTF-8"))?;
            Frame::Hello(Hello {
                session,
                generation,
                epoch,
                nonce,
                resume,
                token,
            })
        }
        FrameType::Welcome => {
            let generation = f.u64("generation")?;
            let input_acked = f.u64("input_acked")?;
            let output_first = f.u64("output_first")?;
            if output_first == 0 {
                return Err(f.invalid("output_first", "sequence numbers start at 1"));
            }
            let pid = f.u32("pid")?;
            let flags = f.u8("flags")?;
            if flags & !0b11 != 0 {
                return Err(f.invalid("flags", "unknown flag bits"));
            }
            let working_dir = f.text("working_dir")?;
            Frame::Welcome(Welcome {
                generation,
                input_acked,
                output_first,
                pid,
                started: flags & 1 != 0,
                exited: flags & 2 != 0,
                working_dir,
            })
        }
        FrameType::Data => {
            let seq = f.seq()?;
            let payload = f.rest();
            Frame::Data { seq, payload }
        }
        FrameType::Ack => Frame::Ack { seq: f.u64("seq")? },
        FrameType::Eof => Frame::Eof { seq: f.seq()? },
        FrameType::Exit => {
            let seq = f.seq()?;
            let kind = f.u8("kind")?;
            let value = f.i32("value")?;
            let status = match kind {
                0 => ExitStatus::Code(value),
                1 => ExitStatus::Signal(value),
                _ => return Err(f.invalid("kind", "neither 0 (code) nor 1 (signal)")),
            };
            let stderr_tail = if f.payload.is_empty() {
                String::new()
            } else {
                // An empty tail is sent as none, so each exit has exactly one encoding.
                let tail = f.text("stderr_tail")?;
                if tail.is_empty() {
                    return Err(f.invalid("stderr_tail", "present but empty"));
                }
                tail
            };
            Frame::Exit {
                seq,
                status,
                stderr_tail,
            }
        }
        FrameType::Ping => Frame::Ping {
            nonce: f.u64("nonce")?,
        },
        FrameType::Pong => Frame::Pong {
            nonce: f.u64("nonce")?,
        },
        FrameType::Signal => {
            let number = f.u8("signal")?;
            let signal =
                RelaySignal::from_number(number).ok_or(f.invalid("signal", "not one of 15, 9, 2"))?;
            let grace_ms = f.u32("grace_ms")?;
            Frame::Signal { signal, grace_ms }
        }
        FrameType::Error => {
            let code = ErrorCode::from_u16(f.u16("code")?);
            let message = f.text("message")?;
            Frame::Error { code, message }
        }
        FrameType::Bind => Frame::Bind(bind::parse(&mut f)?),
        FrameType::Bound => Frame::Bound {
            generation: f.u64("generation")?,
        },
    };
    f.finish(frame)
}

/// An incremental decoder for a byte stream of frames from one peer.
///
/// Feed it bytes with [`extend`](Self::extend) (or read into [`buffer_mut`](Self::buffer_mut)) and
/// take frames with [`decode`](Self::decode). After an error the stream has lost its framing: the
/// decoder keeps returning that error.
#[derive(Debug)]
pub struct FrameDecoder {
    from: Peer,
    max_payload: usize,
    buf: BytesMut,
    failed: Option<FrameError>,
}

impl FrameDecoder {
    /// A decoder of frames sent by `from`, with the [`MAX_PAYLOAD`] limit.
    pub fn new(from: Peer) -> Self {
        Self {
            from,
            max_payload: MAX_PAYLOAD,
            buf: BytesMut::with_capacity(8 * 1024),
            failed: None,
        }
    }

    /// Lowers the payload limit (it is never raised above [`MAX_PAYLOAD`]).
    pub fn with_max_payload(mut self, max_payload: usize) -> Self {
        self.max_payload = max_payload.min(MAX_PAYLOAD);
        self
    }

    /// Appends received bytes.
    pub fn extend(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The receive buffer, for reading into directly.
    pub fn buffer_mut(&mut self) -> &mut BytesMut {
        &mut self.buf
    }

    /// How many received bytes are not yet decoded.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// How many more bytes the frame at the front needs, as far as its header tells (0 when
    /// it is complete or its header incomplete).
    fn missing(&self) -> usize {
        match check_header(&self.buf, self.from, self.max_payload) {
            Ok(Some(len)) => (HEADER_LEN + len).saturating_sub(self.buf.len()),
            _ => 0,
        }
    }

    /// The next whole frame, or `Ok(None)` if more bytes are needed.
    ///
    /// # Errors
    /// The first [`FrameError`] in the stream, again on every later call.
    pub fn decode(&mut self) -> Result<Option<Frame>, FrameError> {
        if let Some(error) = &self.failed {
            return Err(error.clone());
        }
        let result = self.decode_inner();
        if let Err(error) = &result {
            self.failed = Some(error.clone());
        }
        result
    }

    fn decode_inner(&mut self) -> Result<Option<Frame>, FrameError> {
        let Some(len) = check_header(&self.buf, self.from, self.max_payload)? else {
            return Ok(None);
        };
        let total = HEADER_LEN + len;
        if self.buf.len() < total {
            return Ok(None);
        }
        let frame_type = FrameType::from_u8(self.buf[1]).ok_or(FrameError::UnknownType {
            frame_type: self.buf[1],
        })?;
        let mut frame = self.buf.split_to(total).freeze();
        frame.advance(HEADER_LEN);
        parse_payload(frame_type, frame).map(Some)
    }
}

/// Whether a stream item is new or was seen before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// The next item: deliver it.
    New,
    /// An item already delivered: drop it.
    Duplicate,
}

/// Receive-side bookkeeping of one direction of the stream: drops duplicates, rejects gaps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sequencer {
    last: Seq,
}

impl Sequencer {
    /// A sequencer that has delivered every item up to `last`.
    pub fn new(last: Seq) -> Self {
        Self { last }
    }

    /// The last item delivered.
    pub fn last(&self) -> Seq {
        self.last
    }

    /// Classifies `seq` without recording it.
    ///
    /// # Errors
    /// [`FrameError::OutOfOrder`] if `seq` skips ahead of the next item.
    pub fn check(&self, seq: Seq) -> Result<Arrival, FrameError> {
        let next = self.last.checked_add(1).ok_or(FrameError::OutOfOrder {
            expected: self.last,
            got: seq,
        })?;
        match seq {
            s if s < next => Ok(Arrival::Duplicate),
            s if s == next => Ok(Arrival::New),
            _ => Err(FrameError::OutOfOrder {
                expected: next,
                got: seq,
            }),
        }
    }

    /// Classifies `seq` and records it if it is new.
    ///
    /// # Errors
    /// As [`Sequencer::check`]; nothing is recorded then.
    pub fn accept(&mut self, seq: Seq) -> Result<Arrival, FrameError> {
        let arrival = self.check(seq)?;
        if arrival == Arrival::New {
            self.last = seq;
        }
        Ok(arrival)
    }
}

/// Acknowledge at the latest once this many items are unacknowledged.
const ACK_EVERY: Seq = 8;

/// Acknowledge at the latest this long after the first unacknowledged item arrived.
const ACK_DELAY: std::time::Duration = std::time::Duration::from_millis(5);

/// Delayed acknowledgements: an ack rides along with other frames the writer sends anyway, and
/// goes out on its own only once [`ACK_EVERY`] items are unacknowledged or the oldest of them
/// waited [`ACK_DELAY`]. Halves the frames of a request-response exchange.
#[derive(Debug)]
pub(crate) struct DelayedAck {
    sent: Seq,
    due: Option<tokio::time::Instant>,
}

impl DelayedAck {
    pub(crate) fn new(sent: Seq) -> Self {
        Self { sent, due: None }
    }

    /// The ack to send now for `received`, if any. `piggyback`: other frames go out now;
    /// `urgent`: the peer waits for this ack (e.g. for the agent's exit).
    pub(crate) fn take(&mut self, received: Seq, piggyback: bool, urgent: bool) -> Option<Seq> {
        if received <= self.sent {
            self.due = None;
            return None;
        }
        let now = tokio::time::Instant::now();
        let due = *self.due.get_or_insert(now + ACK_DELAY);
        if piggyback || urgent || received - self.sent >= ACK_EVERY || now >= due {
            self.sent = received;
            self.due = None;
            Some(received)
        } else {
            None
        }
    }

    /// When a pending ack must go out on its own.
    pub(crate) fn deadline(&self) -> Option<tokio::time::Instant> {
        self.due
    }
}

/// A timer kept across loop iterations and armed lazily: it is moved only to an earlier
/// deadline, and stays armed when the deadline it served is withdrawn (e.g. an ack that went out
/// piggybacked). Re-arming a tokio timer for an earlier deadline wakes the runtime's driver (a
/// syscall), and a fresh timer per loop iteration registers and deregisters one each time; a timer
/// that now and then fires for nothing is far cheaper than either on a per-frame path.
#[derive(Debug)]
pub(crate) struct LazyTimer {
    sleep: std::pin::Pin<Box<tokio::time::Sleep>>,
    armed: Option<tokio::time::Instant>,
}

impl LazyTimer {
    /// A timer that is not armed.
    pub(crate) fn new() -> Self {
        Self {
            // Never polled before it is armed.
            sleep: Box::pin(tokio::time::sleep(std::time::Duration::ZERO)),
            armed: None,
        }
    }

    /// Makes sure the timer fires no later than `deadline`, if there is one.
    pub(crate) fn arm(&mut self, deadline: Option<tokio::time::Instant>) {
        if let Some(deadline) = deadline {
            if self.armed.is_none_or(|armed| armed > deadline) {
                self.sleep.as_mut().reset(deadline);
                self.armed = Some(deadline);
            }
        }
    }

    /// Resolves once the armed deadline passed (the timer is then disarmed); never while it is
    /// not armed. Cancel-safe.
    pub(crate) async fn fired(&mut self) {
        if self.armed.is_none() {
            return std::future::pending().await;
        }
        self.sleep.as_mut().await;
        self.armed = None;
    }
}

/// Why a frame could not be read from a stream.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReadError {
    /// The transport failed.
    #[error("transport error: {0}")]
    Io(#[from] io::Error),
    /// The bytes are not a valid frame.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The stream ended inside a frame.
    #[error("the stream ended inside a frame ({buffered} bytes of it received)")]
    Truncated {
        /// How many bytes of the unfinished frame arrived.
        buffered: usize,
    },
}

/// Reads frames from one peer off a byte stream.
#[derive(Debug)]
pub struct FrameReader<R> {
    inner: R,
    decoder: FrameDecoder,
    /// Exhausted receive buffers, reused once every frame split off them is dropped.
    retired: VecDeque<BytesMut>,
}

/// Receive buffer size of a [`FrameReader`] (more if a frame needs it).
const READ_BUFFER: usize = 256 * 1024;

/// Below this much room, a [`FrameReader`] moves to another receive buffer before reading.
const MIN_READ_ROOM: usize = 4096;

/// Exhausted receive buffers a [`FrameReader`] keeps for reuse.
const SPARE_BUFFERS: usize = 8;

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// Reads frames sent by `from` from `inner`.
    pub fn new(inner: R, from: Peer) -> Self {
        Self {
            inner,
            decoder: FrameDecoder::new(from),
            retired: VecDeque::new(),
        }
    }

    /// Makes room to read the rest of the current frame, or at least [`MIN_READ_ROOM`] bytes.
    /// Frames are split off the receive buffer without copying, so a full buffer stays shared
    /// until they are dropped; rather than a new allocation each time (fresh memory whose every
    /// page faults on first write), take a retired buffer whose frames are all gone, and move
    /// the undecoded tail (less than a frame) over.
    fn make_room(&mut self) {
        let missing = self.decoder.missing();
        let buf = self.decoder.buffer_mut();
        let spare = buf.capacity() - buf.len();
        if spare >= missing.max(MIN_READ_ROOM) {
            return;
        }
        let want = buf.len() + missing.max(READ_BUFFER);
        let mut fresh = None;
        for _ in 0..self.retired.len() {
            let Some(mut candidate) = self.retired.pop_front() else {
                break;
            };
            if candidate.try_reclaim(want) {
                fresh = Some(candidate);
                break;
            }
            self.retired.push_back(candidate);
        }
        let mut fresh = fresh.unwrap_or_else(|| BytesMut::with_capacity(want));
        fresh.extend_from_slice(buf);
        let mut used = std::mem::replace(buf, fresh);
        used.clear();
        if self.retired.len() == SPARE_BUFFERS {
            self.retired.pop_front();
        }
        self.retired.push_back(used);
    }

    /// The next frame, or `Ok(None)` at a clean end of stream (between frames).
    ///
    /// # Errors
    /// [`ReadError`] on a transport failure, a malformed frame or a stream cut inside a frame.
    ///
    /// # Cancellation
    /// Cancel-safe: bytes already read stay buffered for the next call.
    pub async fn next(&mut self) -> Result<Option<Frame>, ReadError> {
        loop {
            if let Some(frame) = self.decoder.decode()? {
                return Ok(Some(frame));
            }
            self.make_room();
            if self.inner.read_buf(self.decoder.buffer_mut()).await? == 0 {
                return match self.decoder.buffered() {
                    0 => Ok(None),
                    buffered => Err(ReadError::Truncated { buffered }),
                };
            }
        }
    }

    /// The underlying stream.
    pub fn into_inner(self) -> R {
        self.inner
    }
}

/// Encodes `frame` and writes it whole to `writer` (without flushing).
///
/// # Errors
/// The transport's error, or [`io::ErrorKind::InvalidInput`] wrapping a [`FrameError`] for a frame
/// that cannot be encoded.
pub async fn write_frame<W: AsyncWrite + Unpin + ?Sized>(writer: &mut W, frame: &Frame) -> io::Result<()> {
    let bytes = frame
        .to_bytes()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    writer.write_all(&bytes).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token() -> Token {
        Token::from_slice(&[7; 32]).expect("32 bytes")
    }

    fn samples() -> Vec<Frame> {
        vec![
            Frame::Hello(Hello {
                session: "abcdefghijklmnopqrst".into(),
                generation: 3,
                epoch: 9,
                nonce: 11,
                resume: 0,
                token: token(),
            }),
            Frame::Welcome(Welcome {
                generation: 3,
                input_acked: 4,
                output_first: 5,
                pid: 42,
                started: true,
                exited: false,
                working_dir: "/workspace".into(),
            }),
            Frame::Data {
                seq: 1,
                payload: Bytes::from_static(b"{\"jsonrpc\":\"2.0\"}\n"),
            },
            Frame::Data {
                seq: 2,
                payload: Bytes::new(),
            },
            Frame::Ack { seq: 0 },
            Frame::Eof { seq: 7 },
            Frame::Exit {
                seq: 8,
                status: ExitStatus::Signal(9),
                stderr_tail: String::new(),
            },
            Frame::Exit {
                seq: 8,
                status: ExitStatus::Code(2),
                stderr_tail: "error: unexpected argument '--no-such-flag'\n".into(),
            },
            Frame::Exit {
                seq: 8,
                status: ExitStatus::Code(-1),
                stderr_tail: String::new(),
            },
            Frame::Ping { nonce: u64::MAX },
            Frame::Pong { nonce: 0 },
            Frame::Signal {
                signal: RelaySignal::Terminate,
                grace_ms: 5000,
            },
            Frame::error(ErrorCode::ResumeGap, "output 3 to 9 is gone"),
            Frame::error(ErrorCode::Unknown(999), ""),
            Frame::error(ErrorCode::AlreadyBound, "bound to another session"),
            Frame::Bind(Bind {
                bind_token: token(),
                binding: Binding::new("abcdefghijklmnopqrst", 3, crate::TokenHash::from_bytes([5; 32]))
                    .working_dir("/workspace")
                    .env("HOME", "/home/agent"),
            }),
            Frame::Bound { generation: 3 },
        ]
    }

    fn from(frame: &Frame) -> Peer {
        if frame.frame_type().sent_by(Peer::Broker) {
            Peer::Broker
        } else {
            Peer::Relay
        }
    }

    #[test]
    fn an_exit_with_an_empty_stderr_tail_field_is_refused_so_each_exit_has_one_encoding() {
        // seq 1, code 11, then a tail field of length 0 (found by the fuzzer).
        let mut bytes = vec![VERSION, FrameType::Exit.to_u8(), 0, 0, 0, 15];
        bytes.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 11, 0, 0]);
        assert!(matches!(
            decode_frame(&bytes, Peer::Relay),
            Err(FrameError::InvalidField {
                field: "stderr_tail",
                ..
            })
        ));
    }

    #[test]
    fn every_frame_round_trips_whole_and_byte_by_byte() {
        for frame in samples() {
            let bytes = frame.to_bytes().expect("encode");
            let (decoded, used) = decode_frame(&bytes, from(&frame)).unwrap().unwrap();
            assert_eq!((decoded, used), (frame.clone(), bytes.len()));
            let mut decoder = FrameDecoder::new(from(&frame));
            for (i, byte) in bytes.iter().enumerate() {
                decoder.extend(&[*byte]);
                let got = decoder.decode().expect("valid prefix");
                assert_eq!(got.is_some(), i + 1 == bytes.len(), "{frame:?} at byte {i}");
                if let Some(got) = got {
                    assert_eq!(got, frame);
                }
            }
        }
    }

    #[test]
    fn oversized_length_is_rejected_from_the_header_alone() {
        let header = [VERSION, FrameType::Data.to_u8(), 0xff, 0xff, 0xff, 0xff];
        assert_eq!(
            decode_frame(&header, Peer::Broker),
            Err(FrameError::TooLarge {
                len: u64::from(u32::MAX),
                max: MAX_PAYLOAD
            })
        );
        let too_big = Frame::Data {
            seq: 1,
            payload: Bytes::from(vec![0; MAX_DATA + 1]),
        };
        assert!(matches!(too_big.to_bytes(), Err(FrameError::TooLarge { .. })));
    }

    #[test]
    fn bad_version_type_and_direction_are_reported_early() {
        assert_eq!(
            decode_frame(&[2], Peer::Broker),
            Err(FrameError::UnsupportedVersion { version: 2 })
        );
        assert_eq!(
            decode_frame(b"GET", Peer::Broker),
            Err(FrameError::NotAFrame { first_byte: b'G' })
        );
        assert_eq!(
            decode_frame(&[VERSION, 0], Peer::Broker),
            Err(FrameError::UnknownType { frame_type: 0 })
        );
        assert_eq!(
            decode_frame(&[VERSION, FrameType::Welcome.to_u8()], Peer::Broker),
            Err(FrameError::WrongDirection {
                frame_type: FrameType::Welcome,
                from: Peer::Broker
            })
        );
        assert_eq!(decode_frame(&[], Peer::Relay), Ok(None));
    }

    #[test]
    fn malformed_payloads_are_typed_errors() {
        let cases: Vec<(u8, Vec<u8>, &str)> = vec![
            (FrameType::Ack.to_u8(), vec![0; 7], "truncated"),
            (FrameType::Ack.to_u8(), vec![0; 9], "trailing"),
            (FrameType::Data.to_u8(), vec![0; 8], "seq 0"),
            (FrameType::Signal.to_u8(), vec![3, 0, 0, 0, 0], "signal"),
            (FrameType::Error.to_u8(), vec![0, 1, 0, 2, 0xff, 0xfe], "utf8"),
        ];
        for (frame_type, payload, what) in cases {
            let mut bytes = vec![VERSION, frame_type];
            bytes.extend_from_slice(&(payload.len() as u32).to_be_bytes());
            bytes.extend_from_slice(&payload);
            let from = if frame_type == FrameType::Signal.to_u8() {
                Peer::Broker
            } else {
                Peer::Relay
            };
            let error = decode_frame(&bytes, from).expect_err(what);
            assert_eq!(error.code(), ErrorCode::BadFrame, "{what}: {error}");
        }
    }

    #[test]
    fn hello_session_must_be_a_plain_name() {
        let mut hello = Hello {
            session: "ok".into(),
            generation: 1,
            epoch: 1,
            nonce: 1,
            resume: 0,
            token: token(),
        };
        assert!(Frame::Hello(hello.clone()).to_bytes().is_ok());
        for bad in ["", "a/b", "x".repeat(65).as_str(), "é"] {
            hello.session = bad.into();
            assert!(Frame::Hello(hello.clone()).to_bytes().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn decoder_stays_failed_after_an_error() {
        let mut decoder = FrameDecoder::new(Peer::Broker);
        decoder.extend(b"GET / HTTP/1.1\r\n");
        let first = decoder.decode().expect_err("garbage");
        assert_eq!(first.code(), ErrorCode::BadFrame);
        decoder.extend(&Frame::Ping { nonce: 1 }.to_bytes().unwrap());
        assert_eq!(decoder.decode(), Err(first));
    }

    #[test]
    fn sequencer_drops_duplicates_and_rejects_gaps() {
        let mut seq = Sequencer::default();
        assert_eq!(seq.accept(1), Ok(Arrival::New));
        assert_eq!(seq.accept(1), Ok(Arrival::Duplicate));
        assert_eq!(seq.accept(2), Ok(Arrival::New));
        assert_eq!(seq.accept(4), Err(FrameError::OutOfOrder { expected: 3, got: 4 }));
        assert_eq!(seq.last(), 2);
        assert_eq!(
            Sequencer::new(u64::MAX).check(1),
            Err(FrameError::OutOfOrder {
                expected: u64::MAX,
                got: 1
            })
        );
    }

    #[test]
    fn error_codes_round_trip_and_have_distinct_names() {
        let mut names = std::collections::HashSet::new();
        for code in ErrorCode::KNOWN {
            assert_eq!(ErrorCode::from_u16(code.to_u16()), code);
            assert!(names.insert(code.name()));
        }
        assert_eq!(ErrorCode::from_u16(0), ErrorCode::Unknown(0));
        let long = Frame::error(ErrorCode::Internal, "é".repeat(3000));
        assert!(long.to_bytes().is_ok());
    }

    #[tokio::test]
    async fn reader_reports_truncation_and_clean_end() {
        let mut bytes = Frame::Ping { nonce: 5 }.to_bytes().unwrap().to_vec();
        let mut reader = FrameReader::new(&bytes[..], Peer::Relay);
        assert_eq!(reader.next().await.unwrap(), Some(Frame::Ping { nonce: 5 }));
        assert!(reader.next().await.unwrap().is_none());
        bytes.truncate(bytes.len() - 1);
        let mut reader = FrameReader::new(&bytes[..], Peer::Relay);
        assert!(matches!(
            reader.next().await,
            Err(ReadError::Truncated { buffered: 13 })
        ));
    }

    #[tokio::test]
    async fn reader_reuses_buffers_across_frames_of_every_size() {
        // Frames larger than a receive buffer, frames straddling buffers, and buffers still
        // held by earlier frames (kept here) while later ones are read.
        let sizes = [
            10,
            MAX_DATA,
            300_000,
            1,
            READ_BUFFER - 7,
            70_000,
            3,
            MAX_DATA,
            5000,
            200_000,
        ];
        let mut bytes = Vec::new();
        for (i, size) in sizes.iter().cycle().take(40).enumerate() {
            let payload = Bytes::from(vec![i as u8; *size]);
            let frame = Frame::Data {
                seq: i as u64 + 1,
                payload,
            };
            bytes.extend_from_slice(&frame.to_bytes().unwrap());
        }
        let mut reader = FrameReader::new(&bytes[..], Peer::Relay);
        let mut kept = Vec::new();
        for (i, size) in sizes.iter().cycle().take(40).enumerate() {
            let Some(Frame::Data { seq, payload }) = reader.next().await.unwrap() else {
                panic!("expected data {i}");
            };
            assert_eq!(seq, i as u64 + 1);
            assert_eq!(payload.len(), *size);
            assert!(payload.iter().all(|b| *b == i as u8), "frame {i} intact");
            if i % 3 == 0 {
                kept.push(payload);
            }
        }
        assert!(reader.next().await.unwrap().is_none());
        for (n, payload) in kept.iter().enumerate() {
            assert!(
                payload.iter().all(|b| *b == (n * 3) as u8),
                "kept frame {n} unchanged"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn lazy_timer_fires_by_the_earliest_deadline_and_only_when_armed() {
        let start = tokio::time::Instant::now();
        let mut timer = LazyTimer::new();
        let never = tokio::time::timeout(std::time::Duration::from_secs(60), timer.fired()).await;
        assert!(never.is_err(), "an unarmed timer never fires");
        let now = tokio::time::Instant::now();
        timer.arm(Some(now + std::time::Duration::from_millis(10)));
        timer.arm(Some(now + std::time::Duration::from_millis(50)));
        timer.arm(None);
        timer.fired().await;
        assert_eq!(now.elapsed(), std::time::Duration::from_millis(10));
        let never = tokio::time::timeout(std::time::Duration::from_secs(1), timer.fired()).await;
        assert!(never.is_err(), "disarmed once fired");
        assert!(start.elapsed() >= std::time::Duration::from_secs(61));
    }
}
