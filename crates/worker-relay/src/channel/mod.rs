//! The authenticated, encrypted channel every relay connection runs in: a Noise handshake with a
//! pre-shared key, then the framed protocol inside encrypted records.
//!
//! # What each side holds, and what each proves
//!
//! - The **broker** holds its [`BrokerKey`](crate::BrokerKey), so for every session generation
//!   it can derive the [`Token`] and from it everything below.
//! - The **relay** holds only `SHA-256(token)` ([`TokenHash`]), as before: nothing inside the
//!   worker can derive the token of another session or generation.
//! - Both derive the channel's pre-shared key from what the relay holds:
//!   `psk = HMAC-SHA256(key: SHA-256(token), "oab-relay channel key 1" ‖ u8 len ‖ session id)`
//!   ([`ChannelKey::derive`]).
//! - A bind connection to an unbound relay (a warm pool's) is the same channel keyed by what
//!   that relay holds, the hash of its bind token:
//!   `psk = HMAC-SHA256(key: SHA-256(bind token), "oab-relay bind channel key 1")`
//!   ([`ChannelKey::for_bind`]); the broker then proves it holds the bind token itself in its
//!   `bind`, as it proves the session token in a hello.
//!
//! The handshake is Noise `NNpsk0` (`Noise_NNpsk0_25519_ChaChaPoly_SHA256`, prologue
//! `oab-relay channel 1`): each side sends one fresh X25519 ephemeral key, and the PSK is mixed
//! into the key schedule before the first message. Completing it proves:
//!
//! - to the **relay**, that the broker holds this session generation's key (its first message
//!   decrypts only under the PSK); the broker then proves it holds the *token itself* (a
//!   preimage the relay cannot compute) in the `hello` it sends inside the channel, which the relay
//!   checks before anything else;
//! - to the **broker**, that the relay holds this session generation's secret: its reply decrypts
//!   only under the PSK and the broker's fresh ephemeral key. A listener that does not hold it (a
//!   plain socket at a reused Pod IP, a relay of another session or generation) cannot produce
//!   the reply, and the broker sends it nothing else: no hello, no token, no input.
//!
//! **Freshness.** Every channel's keys come from two fresh ephemeral keys (`ee`). Bytes captured
//! from an earlier connection (a hello included) decrypt under no later channel's keys, so
//! replaying them gets nowhere: the relay answers a replayed first message with a reply the
//! replayer cannot read, and refuses the replayed records that follow. The token only ever travels
//! inside a channel, so an eavesdropper never sees it.
//!
//! **Confidentiality and integrity.** After the handshake every byte of the protocol (hello,
//! welcome, input, output, acknowledgements, errors) travels in ChaCha20-Poly1305 records. A record
//! that fails authentication ends the connection.
//!
//! **Nothing before authentication.** A relay refuses a first message that does not authenticate
//! with an empty handshake message and closes: an outsider learns neither the session's
//! generation nor whether any session is served.
//!
//! # Wire format
//!
//! ```text
//! broker -> relay   u16be len (48) | Noise message 1: e, [empty payload, tag]
//! relay  -> broker  u16be len (48) | Noise message 2: e, ee, [empty payload, tag]
//!                   or u16be 0: refused (message 1 did not authenticate)
//! then both ways    records: u16be len (17..=65535) | ChaCha20-Poly1305(frames); a side
//!                   seals at most 16 KiB of plaintext per record and reads any up to Noise's
//!                   65,535-byte message limit; the protocol's frames (up to 1 MiB) are split
//!                   across records and joined again by the reader
//! ```
//!
//! The channel sits below the framing, so it runs over every reach the framing did: TCP to the
//! Pod IP, the `oab-relay connect` stdio bridge through `pods/exec` (which carries the encrypted
//! bytes and sees nothing else), and AgentCore's WebSocket.
//!
//! # Why Noise through `snow`
//!
//! The relay must run from a `FROM scratch` image as a static binary with no C dependencies, on
//! any reach (a WebSocket inside AgentCore is already TLS to AgentCore's edge, but it ends
//! there), and both ends already share a secret per session generation. Noise with a pre-shared
//! key is the authenticated key exchange made for exactly that: mutual authentication by the
//! shared secret, forward secrecy from ephemeral keys, two messages, no certificates, no PKI and
//! no certificate rotation per Pod. `snow` is the maintained pure-Rust implementation (used by
//! libp2p's Noise transport and others) with RustCrypto primitives; with its `std` feature off it
//! pulls in no C code. TLS (rustls) would need a certificate per worker and a way for the broker
//! to trust it, or TLS-PSK, which rustls does not offer for external keys.

mod handshake;
mod stream;

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::token::{Token, TokenHash};

pub use self::handshake::{initiate, respond, respond_any, HandshakeError};
pub use self::stream::{SecureStream, MAX_RECORD_PLAINTEXT};

/// Length of a [`ChannelKey`], in bytes.
pub const CHANNEL_KEY_LEN: usize = 32;

/// What the key derivation mixes in before the session id, so that the key is good for nothing
/// else.
const KEY_LABEL: &[u8] = b"oab-relay channel key 1";

/// What the key of a bind connection's channel is derived from: a label no session key's input
/// starts with.
const BIND_KEY_LABEL: &[u8] = b"oab-relay bind channel key 1";

/// The channel's pre-shared key for one session generation. Its `Debug` output never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct ChannelKey([u8; CHANNEL_KEY_LEN]);

impl fmt::Debug for ChannelKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ChannelKey(<redacted>)")
    }
}

impl ChannelKey {
    /// The key of `session`'s channel, from what the relay holds: the hash of the session
    /// generation's token (in AgentCore, of the session incarnation's token).
    pub fn derive(session: &str, token_hash: &TokenHash) -> Self {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(token_hash.as_bytes()).expect("HMAC accepts keys of any length");
        mac.update(KEY_LABEL);
        // A length prefix keeps the encoding unambiguous (session ids are at most 64 bytes).
        mac.update(&[u8::try_from(session.len()).unwrap_or(u8::MAX)]);
        mac.update(session.as_bytes());
        Self(mac.finalize().into_bytes().into())
    }

    /// The key a broker uses for `session`: [`derive`](Self::derive) over the token's hash.
    pub fn for_token(session: &str, token: &Token) -> Self {
        Self::derive(session, &token.hash())
    }

    /// The key of a bind connection's channel, from what an unbound relay holds: the hash of its
    /// bind token ([`BrokerKey::bind_token`](crate::BrokerKey::bind_token)).
    pub fn for_bind(bind_token_hash: &TokenHash) -> Self {
        let mut mac = Hmac::<Sha256>::new_from_slice(bind_token_hash.as_bytes())
            .expect("HMAC accepts keys of any length");
        mac.update(BIND_KEY_LABEL);
        Self(mac.finalize().into_bytes().into())
    }

    pub(crate) fn as_bytes(&self) -> &[u8; CHANNEL_KEY_LEN] {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BrokerKey;

    #[test]
    fn keys_depend_on_session_and_token_and_match_on_both_sides() {
        let broker = BrokerKey::new(b"k".repeat(32));
        let token = broker.token("abc", 1);
        let relay_side = ChannelKey::derive("abc", &token.hash());
        assert_eq!(ChannelKey::for_token("abc", &token), relay_side);
        assert_ne!(ChannelKey::for_token("abd", &token), relay_side);
        assert_ne!(ChannelKey::for_token("abc", &broker.token("abc", 2)), relay_side);
        assert_eq!(format!("{relay_side:?}"), "ChannelKey(<redacted>)");
    }

    #[test]
    fn bind_keys_differ_from_session_keys_of_the_same_hash() {
        let hash = BrokerKey::new(b"k".repeat(32)).bind_token("pool-0").hash();
        let bind = ChannelKey::for_bind(&hash);
        assert_ne!(bind, ChannelKey::derive("", &hash));
        assert_ne!(bind, ChannelKey::derive("pool-0", &hash));
        assert_ne!(
            bind,
            ChannelKey::for_bind(&BrokerKey::new(b"k".repeat(32)).bind_token("pool-1").hash())
        );
    }
}
