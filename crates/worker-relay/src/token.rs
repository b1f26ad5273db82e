//! Connection tokens: the broker derives them, the relay holds only their hash.
//!
//! `token = HMAC-SHA256(broker key, u8 len(session) ‖ session ‖ u64be generation)`. The broker can
//! re-derive a token after a restart without storing it; the worker is given only
//! `SHA-256(token)` in hex ([`TokenHash`]), so nothing inside it (in particular the untrusted agent)
//! can forge a token for another session or generation.
//!
//! A warm pool's unbound relay is given the hash of a *bind token* instead
//! ([`BIND_TOKEN_HASH_ENV`]): `HMAC-SHA256(broker key, 0x00 ‖ "oab-relay bind token 1" ‖ u8
//! len(member) ‖ member)` ([`BrokerKey::bind_token`]), for the pool member (e.g. the Pod's name).
//!
//! **A bind token is never a session token.** Both are the same HMAC under the same key, so they
//! are kept apart by their inputs. A session token's input starts with its session's length `L`
//! (saturated at 255) and is exactly `1 + L + 8` bytes long when `L < 255`: it starts with `0x00`
//! only for the empty session, and is then exactly 9 bytes long. A bind token's input starts with
//! `0x00` and is at least `1 + 22 + 1 = 24` bytes long. No input is both, for any session or member
//! string (and a real session id is never empty, so its token's input never starts with `0x00` at
//! all); HMAC then gives the two unrelated outputs.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Length of a token and of its hash, in bytes.
pub const TOKEN_LEN: usize = 32;

/// The environment variable the relay reads its [`TokenHash`] from (64 lowercase hex digits).
pub const TOKEN_HASH_ENV: &str = "OAB_RELAY_TOKEN_SHA256";

/// The environment variable an unbound relay (`oab-relay serve --unbound`) reads the hash of its
/// bind token from (64 hex digits), instead of a session, generation and [`TOKEN_HASH_ENV`].
pub const BIND_TOKEN_HASH_ENV: &str = "OAB_RELAY_BIND_TOKEN_SHA256";

/// What a bind token's HMAC input starts with after its tag byte `0x00`.
const BIND_LABEL: &[u8] = b"oab-relay bind token 1";

/// The broker's secret for deriving relay tokens. Its `Debug` output never shows the key.
#[derive(Clone)]
pub struct BrokerKey {
    key: Vec<u8>,
}

impl fmt::Debug for BrokerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("BrokerKey(<redacted>)")
    }
}

impl BrokerKey {
    /// Wraps a secret key (use at least 32 random bytes).
    pub fn new(key: impl Into<Vec<u8>>) -> Self {
        Self { key: key.into() }
    }

    /// The token for one worker generation of one session.
    pub fn token(&self, session: &str, generation: u64) -> Token {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.key).expect("HMAC accepts keys of any length");
        // A length prefix keeps (session, generation) pairs unambiguous.
        let len = u8::try_from(session.len()).unwrap_or(u8::MAX);
        mac.update(&[len]);
        mac.update(session.as_bytes());
        mac.update(&generation.to_be_bytes());
        Token(mac.finalize().into_bytes().into())
    }

    /// The bind token of one warm pool member (e.g. its Pod's name): the broker gives the
    /// member's relay `SHA-256` of it ([`BIND_TOKEN_HASH_ENV`]) and presents it in the `bind`
    /// that claims the member for a session. It never equals any session's [`token`](Self::token)
    /// (see the module documentation).
    pub fn bind_token(&self, member: &str) -> Token {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.key).expect("HMAC accepts keys of any length");
        // The tag byte no session token's input of this length starts with, then the label.
        mac.update(&[0]);
        mac.update(BIND_LABEL);
        let len = u8::try_from(member.len()).unwrap_or(u8::MAX);
        mac.update(&[len]);
        mac.update(member.as_bytes());
        Token(mac.finalize().into_bytes().into())
    }
}

/// A connection token, as carried in a `hello`. Its `Debug` output never shows it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Token([u8; TOKEN_LEN]);

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

impl Token {
    /// A token from its 32 bytes.
    pub fn from_bytes(bytes: [u8; TOKEN_LEN]) -> Self {
        Self(bytes)
    }

    /// A token from a slice, if it is 32 bytes long.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Self)
    }

    /// The token's bytes.
    pub fn as_bytes(&self) -> &[u8; TOKEN_LEN] {
        &self.0
    }

    /// `SHA-256(token)`: what the worker is given.
    pub fn hash(&self) -> TokenHash {
        TokenHash(Sha256::digest(self.0).into())
    }
}

/// `SHA-256` of a [`Token`]; all the relay knows. Compared in constant time.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct TokenHash([u8; TOKEN_LEN]);

impl fmt::Debug for TokenHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TokenHash({})", self.to_hex())
    }
}

impl TokenHash {
    /// A hash from its 32 bytes.
    pub fn from_bytes(bytes: [u8; TOKEN_LEN]) -> Self {
        Self(bytes)
    }

    /// The hash's bytes.
    pub fn as_bytes(&self) -> &[u8; TOKEN_LEN] {
        &self.0
    }

    /// Parses 64 hex digits (either case).
    ///
    /// # Errors
    /// A description of what is wrong with `hex`.
    pub fn from_hex(hex: &str) -> Result<Self, String> {
        let bytes = data_encoding::HEXLOWER_PERMISSIVE
            .decode(hex.trim().as_bytes())
            .map_err(|e| format!("not hex: {e}"))?;
        let bytes: [u8; TOKEN_LEN] = bytes
            .try_into()
            .map_err(|b: Vec<u8>| format!("{} bytes, expected {TOKEN_LEN}", b.len()))?;
        Ok(Self(bytes))
    }

    /// The hash as 64 lowercase hex digits (the form [`TOKEN_HASH_ENV`] takes).
    pub fn to_hex(&self) -> String {
        data_encoding::HEXLOWER.encode(&self.0)
    }

    /// Whether `token` hashes to this hash, compared in constant time.
    pub fn verify(&self, token: &Token) -> bool {
        bool::from(token.hash().0.ct_eq(&self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_depend_on_key_session_and_generation() {
        let key = BrokerKey::new(b"k".repeat(32));
        let token = key.token("abc", 1);
        assert_eq!(token, key.token("abc", 1));
        assert_ne!(token, key.token("abc", 2));
        assert_ne!(token, key.token("abd", 1));
        assert_ne!(token, BrokerKey::new(b"j".repeat(32)).token("abc", 1));
        // The length prefix separates "ab"+gen from "a"+"b..." encodings.
        assert_ne!(key.token("ab", 1), key.token("a", 0x6200_0000_0000_0001));
    }

    #[test]
    fn hash_verifies_only_its_token_and_round_trips_as_hex() {
        let key = BrokerKey::new(vec![1; 32]);
        let token = key.token("s", 7);
        let hash = token.hash();
        assert!(hash.verify(&token));
        assert!(!hash.verify(&key.token("s", 8)));
        assert_eq!(TokenHash::from_hex(&hash.to_hex()), Ok(hash));
        assert_eq!(TokenHash::from_hex(&hash.to_hex().to_uppercase()), Ok(hash));
        assert!(TokenHash::from_hex("abcd").is_err());
        assert!(TokenHash::from_hex(&"zz".repeat(32)).is_err());
    }

    #[test]
    fn hmac_matches_a_known_vector() {
        // RFC 4231 test case 2: key "Jefe", data "what do ya want for nothing?". Our message is
        // len ‖ session ‖ generation, so build the same bytes through the API: not possible; check
        // the primitive instead, then that our encoding is what the docs say.
        let mut mac = Hmac::<Sha256>::new_from_slice(b"Jefe").expect("any key length");
        mac.update(b"what do ya want for nothing?");
        assert_eq!(
            data_encoding::HEXLOWER.encode(&mac.finalize().into_bytes()),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        let mut mac = Hmac::<Sha256>::new_from_slice(b"key").expect("any key length");
        mac.update(&[3]);
        mac.update(b"abc");
        mac.update(&5u64.to_be_bytes());
        let expected: [u8; 32] = mac.finalize().into_bytes().into();
        assert_eq!(BrokerKey::new(b"key".to_vec()).token("abc", 5), Token(expected));
    }

    #[test]
    fn bind_tokens_depend_on_key_and_member_and_follow_the_documented_input() {
        let key = BrokerKey::new(b"k".repeat(32));
        let token = key.bind_token("pool-0");
        assert_eq!(token, key.bind_token("pool-0"));
        assert_ne!(token, key.bind_token("pool-1"));
        assert_ne!(token, BrokerKey::new(b"j".repeat(32)).bind_token("pool-0"));
        let mut mac = Hmac::<Sha256>::new_from_slice(&b"k".repeat(32)).expect("any key length");
        mac.update(b"\0oab-relay bind token 1\x06pool-0");
        assert_eq!(token, Token(mac.finalize().into_bytes().into()));
    }

    #[test]
    fn a_bind_token_is_no_session_token() {
        let key = BrokerKey::new(b"k".repeat(32));
        // The session tokens whose input starts with the bind tag (the empty session), and ones
        // built to look like a bind token's input as far as they can.
        for generation in [0, 1, u64::MAX] {
            for member in ["", "pool-0", "x"] {
                let bind = key.bind_token(member);
                assert_ne!(bind, key.token("", generation));
                assert_ne!(bind, key.token(member, generation));
                assert_ne!(bind, key.token("oab-relay bind token 1", generation));
            }
        }
    }

    #[test]
    fn debug_output_redacts_secrets() {
        let key = BrokerKey::new(b"secret-key".to_vec());
        assert!(!format!("{key:?}").contains("secret"));
        assert_eq!(format!("{:?}", key.token("s", 1)), "Token(<redacted>)");
        assert_eq!(format!("{:?}", key.bind_token("m")), "Token(<redacted>)");
    }
}
