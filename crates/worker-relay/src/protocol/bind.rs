//! The bind exchange's frames: [`Bind`] (broker to relay) and
//! [`Frame::Bound`](super::Frame::Bound) (its answer).
//!
//! An unbound relay (`oab-relay serve --unbound`, a warm pool's worker) knows no session yet. A
//! broker that claims it sends one `bind` on a connection of its own, inside a channel keyed by
//! the *bind token*'s hash (see the crate's "Binding a warm relay"); from then on the relay
//! serves the session the [`Binding`] names, exactly as if it had been started with it.

use std::collections::HashSet;
use std::fmt;

use bytes::{BufMut, BytesMut};

use super::{check_session, put_text, Fields, MAX_TEXT_LEN};
use crate::token::{Token, TokenHash, TOKEN_LEN};

/// The most bytes of agent environment one binding may carry: the sum of every entry's name
/// and value lengths (64 KiB).
pub const MAX_BIND_ENV_BYTES: usize = 64 * 1024;

/// The prefix of the relay's own environment variables: a binding may not set any such name
/// for the agent, which never sees them.
pub const RESERVED_ENV_PREFIX: &str = "OAB_RELAY_";

/// What a broker binds an unbound relay to: the session it serves from then on, the worker
/// generation, the hash of that session generation's token, and what the agent gets on top of
/// the relay's own settings.
///
/// Its `Debug` output shows the session, the generation, the working directory and the names of
/// the environment entries, never their values nor the token hash.
#[derive(Clone, PartialEq, Eq)]
pub struct Binding {
    /// The session (1 to 64 ASCII letters, digits, `-` and `_`, as in a hello).
    pub session: String,
    /// The worker generation.
    pub generation: u64,
    /// `SHA-256` of the session generation's token: what a relay started for the session holds.
    pub token_hash: TokenHash,
    /// The agent's working directory, an absolute path of at most [`MAX_TEXT_LEN`] bytes; empty
    /// for the relay's own (`--workdir`, or its current directory).
    pub working_dir: String,
    /// Environment entries for the agent, set after the relay's own environment (so they win over
    /// the worker's for the same name). Names are non-empty, contain no `=` and no NUL, do not
    /// start with [`RESERVED_ENV_PREFIX`] and appear once; values contain no NUL; names and values
    /// together are at most [`MAX_BIND_ENV_BYTES`].
    pub env: Vec<(String, String)>,
}

impl fmt::Debug for Binding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        struct Names<'a>(&'a [(String, String)]);
        impl fmt::Debug for Names<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_map()
                    .entries(self.0.iter().map(|(name, _)| (name, "<redacted>")))
                    .finish()
            }
        }
        f.debug_struct("Binding")
            .field("session", &self.session)
            .field("generation", &self.generation)
            .field("token_hash", &"<redacted>")
            .field("working_dir", &self.working_dir)
            .field("env", &Names(&self.env))
            .finish()
    }
}

impl Binding {
    /// A binding to `generation` of `session` whose token hashes to `token_hash`, with the
    /// relay's own working directory and no extra environment.
    pub fn new(session: impl Into<String>, generation: u64, token_hash: TokenHash) -> Self {
        Self {
            session: session.into(),
            generation,
            token_hash,
            working_dir: String::new(),
            env: Vec::new(),
        }
    }

    /// The agent's working directory (an absolute path).
    pub fn working_dir(mut self, dir: impl Into<String>) -> Self {
        self.working_dir = dir.into();
        self
    }

    /// Adds an environment entry for the agent.
    pub fn env(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((name.into(), value.into()));
        self
    }

    /// Checks every rule the protocol sets (see the fields); `(field, reason)` of the first
    /// broken one.
    ///
    /// # Errors
    /// The field that breaks a rule and why.
    pub fn check(&self) -> Result<(), (&'static str, &'static str)> {
        check_session(self.session.as_bytes()).map_err(|reason| ("session", reason))?;
        check_working_dir(&self.working_dir).map_err(|reason| ("working_dir", reason))?;
        if self.env.len() > usize::from(u16::MAX) {
            return Err(("env", "more than 65535 entries"));
        }
        let mut total = 0usize;
        let mut names = HashSet::with_capacity(self.env.len());
        for (name, value) in &self.env {
            check_env_name(name).map_err(|reason| ("env name", reason))?;
            if value.contains('\0') {
                return Err(("env value", "contains NUL"));
            }
            total = total.saturating_add(name.len()).saturating_add(value.len());
            if total > MAX_BIND_ENV_BYTES {
                return Err(("env", "names and values longer than 65536 bytes together"));
            }
            if !names.insert(name.as_str()) {
                return Err(("env name", "appears twice"));
            }
        }
        Ok(())
    }
}

/// Binds an unbound relay (broker to relay): the first and only frame of a bind connection.
///
/// Payload: `bind_token [u8; 32], session (u8 length, as a hello's), generation u64,
/// token_hash [u8; 32], working_dir (u16 length, UTF-8; empty: the relay's own), env_count u16,
/// then env_count times: name (u16 length, UTF-8), value (u32 length, UTF-8)`. See [`Binding`]
/// for the rules each field follows; a frame that breaks one is refused with `bad-frame`.
///
/// The relay answers [`Frame::Bound`](super::Frame::Bound) (or an error) and closes the
/// connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bind {
    /// The bind token: its `SHA-256` is what the unbound relay was started with.
    pub bind_token: Token,
    /// What to bind the relay to.
    pub binding: Binding,
}

impl Bind {
    pub(super) fn encode_payload(&self, out: &mut BytesMut) {
        let binding = &self.binding;
        out.put_slice(self.bind_token.as_bytes());
        out.put_u8(binding.session.len() as u8);
        out.put_slice(binding.session.as_bytes());
        out.put_u64(binding.generation);
        out.put_slice(binding.token_hash.as_bytes());
        put_text(out, &binding.working_dir);
        // `check` bounded the entries and their lengths.
        out.put_u16(binding.env.len() as u16);
        for (name, value) in &binding.env {
            put_text(out, name);
            out.put_u32(value.len() as u32);
            out.put_slice(value.as_bytes());
        }
    }

    pub(super) fn payload_len(&self) -> usize {
        let binding = &self.binding;
        let env: usize = binding
            .env
            .iter()
            .map(|(name, value)| 6 + name.len() + value.len())
            .sum();
        TOKEN_LEN + 1 + binding.session.len() + 8 + TOKEN_LEN + 2 + binding.working_dir.len() + 2 + env
    }
}

/// Decodes a bind frame's payload, holding it to every rule [`Binding::check`] does.
pub(super) fn parse(f: &mut Fields) -> Result<Bind, super::FrameError> {
    let bind_token = f.bytes(TOKEN_LEN, "bind_token")?;
    let bind_token = Token::from_slice(&bind_token).ok_or(f.invalid("bind_token", "not 32 bytes"))?;
    let len = f.u8("session")? as usize;
    let session = f.bytes(len, "session")?;
    check_session(&session).map_err(|reason| f.invalid("session", reason))?;
    let session = String::from_utf8(session.to_vec()).map_err(|_| f.invalid("session", "not UTF-8"))?;
    let generation = f.u64("generation")?;
    let hash = f.bytes(TOKEN_LEN, "token_hash")?;
    let mut token_hash = [0u8; TOKEN_LEN];
    token_hash.copy_from_slice(&hash);
    let working_dir = f.text("working_dir")?;
    let count = f.u16("env_count")?;
    let mut env = Vec::with_capacity(usize::from(count).min(256));
    let mut total = 0usize;
    for _ in 0..count {
        let name = f.text("env name")?;
        let len = f.u32("env value")? as usize;
        total = total.saturating_add(name.len()).saturating_add(len);
        if total > MAX_BIND_ENV_BYTES {
            // Before the value is copied: the bound holds whatever the lengths say.
            return Err(f.invalid("env", "names and values longer than 65536 bytes together"));
        }
        let value = f.bytes(len, "env value")?;
        let value = String::from_utf8(value.to_vec()).map_err(|_| f.invalid("env value", "not UTF-8"))?;
        env.push((name, value));
    }
    let binding = Binding {
        session,
        generation,
        token_hash: TokenHash::from_bytes(token_hash),
        working_dir,
        env,
    };
    binding
        .check()
        .map_err(|(field, reason)| f.invalid(field, reason))?;
    Ok(Bind { bind_token, binding })
}

fn check_working_dir(dir: &str) -> Result<(), &'static str> {
    if dir.len() > MAX_TEXT_LEN {
        return Err("longer than 4096 bytes");
    }
    if !dir.is_empty() && !dir.starts_with('/') {
        return Err("not an absolute path");
    }
    if dir.contains('\0') {
        return Err("contains NUL");
    }
    Ok(())
}

fn check_env_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("empty");
    }
    if name.len() > MAX_TEXT_LEN {
        return Err("longer than 4096 bytes");
    }
    if name.contains('=') {
        return Err("contains '='");
    }
    if name.contains('\0') {
        return Err("contains NUL");
    }
    if name.starts_with(RESERVED_ENV_PREFIX) {
        return Err("starts with OAB_RELAY_ (the relay's own variables)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::{decode_frame, Frame, FrameDecoder, FrameError, FrameType, Peer, HEADER_LEN, VERSION};
    use super::*;

    fn binding() -> Binding {
        Binding::new("sess-1", 7, TokenHash::from_bytes([3; 32]))
            .working_dir("/workspace/sess-1")
            .env("GIT_AUTHOR_NAME", "someone")
            .env("EMPTY", "")
            .env("LANG", "C.UTF-8 é")
    }

    fn bind(binding: Binding) -> Frame {
        Frame::Bind(Bind {
            bind_token: Token::from_bytes([9; 32]),
            binding,
        })
    }

    /// The frame's bytes without the encoder's checks, as a broker that ignores them would send.
    fn unchecked(binding: Binding) -> Vec<u8> {
        let bind = Bind {
            bind_token: Token::from_bytes([9; 32]),
            binding,
        };
        let mut out = BytesMut::new();
        out.put_u8(VERSION);
        out.put_u8(FrameType::Bind.to_u8());
        out.put_u32(0);
        bind.encode_payload(&mut out);
        let len = (out.len() - HEADER_LEN) as u32;
        out[2..HEADER_LEN].copy_from_slice(&len.to_be_bytes());
        assert_eq!(out.len() - HEADER_LEN, bind.payload_len());
        out.to_vec()
    }

    fn refused(binding: Binding, field: &str) {
        let what = format!("{binding:?}");
        let error = bind(binding.clone()).to_bytes().expect_err(&what);
        assert!(
            matches!(error, FrameError::InvalidField { field: f, .. } if f == field),
            "encode {what}: {error}"
        );
        let error = decode_frame(&unchecked(binding), Peer::Broker).expect_err(&what);
        assert!(
            matches!(error, FrameError::InvalidField { field: f, .. } if f == field),
            "decode {what}: {error}"
        );
        assert_eq!(error.code(), crate::protocol::ErrorCode::BadFrame);
    }

    #[test]
    fn bind_and_bound_round_trip_whole_and_byte_by_byte() {
        let frames = [
            bind(binding()),
            bind(Binding::new("s", 0, TokenHash::from_bytes([0; 32]))),
            bind(Binding::new(
                "x".repeat(64),
                u64::MAX,
                TokenHash::from_bytes([0xff; 32]),
            )),
            Frame::Bound { generation: 7 },
            Frame::Bound { generation: 0 },
        ];
        for frame in frames {
            let from = if frame.frame_type() == FrameType::Bind {
                Peer::Broker
            } else {
                Peer::Relay
            };
            let bytes = frame.to_bytes().expect("encode");
            assert_eq!(
                decode_frame(&bytes, from).expect("decode"),
                Some((frame.clone(), bytes.len()))
            );
            let mut decoder = FrameDecoder::new(from);
            for (i, byte) in bytes.iter().enumerate() {
                decoder.extend(&[*byte]);
                let got = decoder.decode().expect("a valid prefix");
                assert_eq!(got.is_some(), i + 1 == bytes.len(), "{frame:?} at byte {i}");
                if let Some(got) = got {
                    assert_eq!(got, frame);
                }
            }
        }
    }

    #[test]
    fn the_layout_is_the_documented_one() {
        let frame = bind(
            Binding::new("ab", 0x0102, TokenHash::from_bytes([4; 32]))
                .working_dir("/w")
                .env("K", "vv"),
        );
        let bytes = frame.to_bytes().expect("encode");
        let mut expected = vec![VERSION, 11, 0, 0, 0, 0];
        expected.extend_from_slice(&[9; 32]);
        expected.extend_from_slice(&[2, b'a', b'b']);
        expected.extend_from_slice(&0x0102u64.to_be_bytes());
        expected.extend_from_slice(&[4; 32]);
        expected.extend_from_slice(&[0, 2, b'/', b'w']);
        expected.extend_from_slice(&[0, 1, 0, 1, b'K', 0, 0, 0, 2, b'v', b'v']);
        let len = (expected.len() - HEADER_LEN) as u8;
        expected[5] = len;
        assert_eq!(&bytes[..], &expected[..]);
        let bound = Frame::Bound { generation: 5 }.to_bytes().expect("encode");
        assert_eq!(&bound[..], &[VERSION, 12, 0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0, 5]);
    }

    #[test]
    fn every_rule_of_a_binding_is_enforced_on_both_sides() {
        let base = || Binding::new("s", 1, TokenHash::from_bytes([1; 32]));
        refused(base().env("", "v"), "env name");
        refused(base().env("A=B", "v"), "env name");
        refused(base().env("A\0B", "v"), "env name");
        refused(base().env("OAB_RELAY_TOKEN_SHA256", "v"), "env name");
        refused(base().env("OAB_RELAY_BIND_TOKEN_SHA256", "v"), "env name");
        refused(base().env("A", "1").env("A", "2"), "env name");
        refused(base().env("A", "x\0y"), "env value");
        refused(base().working_dir("relative/dir"), "working_dir");
        refused(base().working_dir("/a\0b"), "working_dir");
        refused(
            base().working_dir(format!("/{}", "d".repeat(MAX_TEXT_LEN))),
            "working_dir",
        );
        let mut bad_session = base();
        bad_session.session = "a/b".into();
        refused(bad_session, "session");
        // The environment's bound: exactly at it is fine, a byte more is not.
        let at_limit = base().env("BIG", "v".repeat(MAX_BIND_ENV_BYTES - 3));
        let bytes = bind(at_limit.clone()).to_bytes().expect("at the bound");
        assert!(decode_frame(&bytes, Peer::Broker).expect("decode").is_some());
        refused(base().env("BIG", "v".repeat(MAX_BIND_ENV_BYTES - 2)), "env");
        // Spread over many entries too.
        let mut many = base();
        for i in 0..1000 {
            many = many.env(format!("V{i:04}"), "v".repeat(61));
        }
        refused(many, "env");
        // Names near the reserved prefix, an empty value and the root directory are fine.
        let ok = base()
            .env("OAB_RELAYX", "")
            .env("oab_relay_lower", "1")
            .working_dir("/");
        assert!(bind(ok).to_bytes().is_ok());
    }

    #[test]
    fn a_value_length_past_the_bound_is_refused_before_the_value_arrives() {
        // Header and fields up to an env value of length u32::MAX, and no value at all.
        let mut bytes = unchecked(Binding::new("s", 1, TokenHash::from_bytes([1; 32])).env("K", ""));
        let at = bytes.len() - 4;
        bytes[at..].copy_from_slice(&u32::MAX.to_be_bytes());
        let error = decode_frame(&bytes, Peer::Broker).expect_err("too long");
        assert!(
            matches!(error, FrameError::InvalidField { field: "env", .. }),
            "{error}"
        );
    }

    #[test]
    fn malformed_bind_payloads_are_typed_errors() {
        let good = unchecked(binding());
        // Cut anywhere inside the payload (the header says more is coming: truncated at a field
        // once the header's length is corrected).
        for cut in HEADER_LEN..good.len() {
            let mut bytes = good[..cut].to_vec();
            let len = (cut - HEADER_LEN) as u32;
            bytes[2..HEADER_LEN].copy_from_slice(&len.to_be_bytes());
            let error = decode_frame(&bytes, Peer::Broker).expect_err("truncated");
            assert_eq!(
                error.code(),
                crate::protocol::ErrorCode::BadFrame,
                "cut {cut}: {error}"
            );
        }
        let mut trailing = good.clone();
        trailing.push(0);
        let len = (trailing.len() - HEADER_LEN) as u32;
        trailing[2..HEADER_LEN].copy_from_slice(&len.to_be_bytes());
        assert!(matches!(
            decode_frame(&trailing, Peer::Broker),
            Err(FrameError::TrailingBytes { extra: 1, .. })
        ));
        // A value that is not UTF-8.
        let mut bytes = unchecked(Binding::new("s", 1, TokenHash::from_bytes([1; 32])).env("K", "v"));
        let last = bytes.len() - 1;
        bytes[last] = 0xff;
        assert!(matches!(
            decode_frame(&bytes, Peer::Broker),
            Err(FrameError::InvalidField {
                field: "env value",
                ..
            })
        ));
        // Directions: only a broker binds, only a relay answers bound.
        assert!(matches!(
            decode_frame(&good, Peer::Relay),
            Err(FrameError::WrongDirection { .. })
        ));
        let bound = Frame::Bound { generation: 1 }.to_bytes().expect("encode");
        assert!(matches!(
            decode_frame(&bound, Peer::Broker),
            Err(FrameError::WrongDirection { .. })
        ));
        let mut short = bound.to_vec();
        short.pop();
        short[5] = 7;
        assert!(matches!(
            decode_frame(&short, Peer::Relay),
            Err(FrameError::Truncated { .. })
        ));
    }

    #[test]
    fn debug_output_shows_names_but_no_value_and_no_token_hash() {
        let binding =
            Binding::new("sess", 2, TokenHash::from_bytes([0xab; 32])).env("SECRET_NAME", "hunter2");
        let shown = format!("{:?}", bind(binding));
        assert!(shown.contains("SECRET_NAME") && shown.contains("sess"), "{shown}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(!shown.contains("abab"), "{shown}");
        assert!(!shown.contains("9, 9"), "{shown}");
    }
}
