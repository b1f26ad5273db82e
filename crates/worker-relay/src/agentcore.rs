//! AgentCore's `runtimeSessionId` as the relay and the broker share it.
//!
//! AgentCore routes every request carrying one `runtimeSessionId` to one microVM and keys the
//! microVM's session storage by it, so the id must stay the same while a session lives (across
//! suspends and worker generations) and change when it is closed. The container's environment is
//! the same for every session of a runtime, so the relay cannot be told its session the way a Pod
//! is; instead the id carries what the relay needs, and AgentCore hands it to the container in the
//! [`SESSION_HEADER`] of every request:
//!
//! ```text
//! oab1-<session id>-<incarnation>-<SHA-256 of the incarnation's token, base32>
//! ```
//!
//! - `session id`: the contract's session id (20 characters of lowercase base32), never the
//!   identity it was derived from.
//! - `incarnation`: how many times a session of this id was created; bumped when a closed session
//!   is created again, so a new session never sees the storage of an old one.
//! - the token hash: `SHA-256` of `HMAC(broker key, session id, incarnation)`
//!   ([`BrokerKey::token`](crate::BrokerKey::token)). The relay admits only a hello carrying the
//!   token itself, which only the broker can derive; the hash tells nothing about the key.
//!
//! The result is 71 to 99 characters of `[a-z0-9-]`, inside AgentCore's 33 to 100.

use std::fmt;
use std::str::FromStr;

use data_encoding::BASE32_NOPAD;

use crate::token::{Token, TokenHash, TOKEN_LEN};

/// The first word of a wipe request's body.
const WIPE: &str = "oab-relay-wipe";

/// The body of an `InvokeAgentRuntime` call that asks the relay to delete the contents of the
/// session storage (AgentCore has no call that deletes session storage): the word
/// `oab-relay-wipe` and the incarnation's token in hex. The relay checks the token against the
/// runtime session id's hash, retires the agent, empties its working directory and answers
/// `{"wiped":true,"removed":<entries>}`.
pub fn wipe_request(token: &Token) -> Vec<u8> {
    format!("{WIPE} {}\n", data_encoding::HEXLOWER.encode(token.as_bytes())).into_bytes()
}

/// The token of a wipe request, if `body` is one.
pub fn parse_wipe_request(body: &[u8]) -> Option<Token> {
    let text = std::str::from_utf8(body).ok()?.trim();
    let hex = text.strip_prefix(WIPE)?.strip_prefix(' ')?;
    let bytes = data_encoding::HEXLOWER_PERMISSIVE.decode(hex.as_bytes()).ok()?;
    Token::from_slice(&bytes)
}

/// The answer to a successful wipe.
pub fn wipe_answer(removed: usize) -> String {
    format!(r#"{{"wiped":true,"removed":{removed}}}"#)
}

/// Checks a wipe's answer.
///
/// # Errors
/// What the relay said instead, if it did not confirm the wipe.
pub fn check_wipe_answer(answer: &[u8]) -> Result<(), String> {
    let text = String::from_utf8_lossy(answer);
    if text.trim_start().starts_with(r#"{"wiped":true"#) {
        Ok(())
    } else {
        Err(format!(
            "the relay did not confirm deleting the session storage: {}",
            text.trim()
        ))
    }
}

/// The header in which AgentCore passes the runtime session id, on the way in and to the container.
pub const SESSION_HEADER: &str = "X-Amzn-Bedrock-AgentCore-Runtime-Session-Id";

/// The scheme's version prefix.
const PREFIX: &str = "oab1";

/// The shortest runtime session id AgentCore accepts.
pub const MIN_LEN: usize = 33;
/// The longest runtime session id AgentCore echoes back (its input limit is 256).
pub const MAX_LEN: usize = 100;

/// The longest session id the scheme carries (the contract's are 20 characters).
const MAX_SESSION_LEN: usize = 32;

/// A runtime session id of this scheme.
#[derive(Clone, PartialEq, Eq)]
pub struct RuntimeSessionId {
    session: String,
    incarnation: u64,
    token_hash: TokenHash,
}

impl fmt::Debug for RuntimeSessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RuntimeSessionId")
            .field(&self.to_string())
            .finish()
    }
}

/// Why a string is not a runtime session id of this scheme.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuntimeSessionIdError {
    /// It does not start with `oab1-`, or does not have four `-`-separated parts.
    #[error("not an oab1 runtime session id")]
    Scheme,
    /// The session part is empty, too long, or not lowercase base32.
    #[error("the session part is not a session id")]
    Session,
    /// The incarnation is not a decimal number.
    #[error("the incarnation is not a number")]
    Incarnation,
    /// The token hash is not 52 characters of lowercase base32 (32 bytes).
    #[error("the token hash is not 32 bytes of base32")]
    TokenHash,
}

impl RuntimeSessionId {
    /// The id of `session`'s `incarnation`, whose relay admits `token`.
    ///
    /// # Errors
    /// [`RuntimeSessionIdError::Session`] if `session` is not a session id (lowercase base32, at
    /// most 32 characters).
    pub fn new(session: &str, incarnation: u64, token: &Token) -> Result<Self, RuntimeSessionIdError> {
        if !is_session(session) {
            return Err(RuntimeSessionIdError::Session);
        }
        Ok(Self {
            session: session.to_owned(),
            incarnation,
            token_hash: token.hash(),
        })
    }

    /// The contract's session id.
    pub fn session(&self) -> &str {
        &self.session
    }

    /// The incarnation.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The hash of the token the relay admits.
    pub fn token_hash(&self) -> &TokenHash {
        &self.token_hash
    }
}

fn is_session(session: &str) -> bool {
    !session.is_empty()
        && session.len() <= MAX_SESSION_LEN
        && session
            .bytes()
            .all(|b| b.is_ascii_lowercase() || (b'2'..=b'7').contains(&b))
}

impl fmt::Display for RuntimeSessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hash = BASE32_NOPAD
            .encode(self.token_hash.as_bytes())
            .to_ascii_lowercase();
        write!(f, "{PREFIX}-{}-{}-{hash}", self.session, self.incarnation)
    }
}

impl FromStr for RuntimeSessionId {
    type Err = RuntimeSessionIdError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let mut parts = text.split('-');
        let (Some(PREFIX), Some(session), Some(incarnation), Some(hash), None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return Err(RuntimeSessionIdError::Scheme);
        };
        if !is_session(session) {
            return Err(RuntimeSessionIdError::Session);
        }
        // `u64::from_str` takes a leading `+`; the canonical form has none and no leading zeros.
        let incarnation = match incarnation.parse::<u64>() {
            Ok(n) if incarnation.bytes().all(|b| b.is_ascii_digit()) && n.to_string() == incarnation => n,
            _ => return Err(RuntimeSessionIdError::Incarnation),
        };
        if !hash
            .bytes()
            .all(|b| b.is_ascii_lowercase() || (b'2'..=b'7').contains(&b))
        {
            return Err(RuntimeSessionIdError::TokenHash);
        }
        let bytes = BASE32_NOPAD
            .decode(hash.to_ascii_uppercase().as_bytes())
            .map_err(|_| RuntimeSessionIdError::TokenHash)?;
        let bytes: [u8; TOKEN_LEN] = bytes.try_into().map_err(|_| RuntimeSessionIdError::TokenHash)?;
        Ok(Self {
            session: session.to_owned(),
            incarnation,
            token_hash: TokenHash::from_bytes(bytes),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BrokerKey;

    const SESSION: &str = "abcdefghijklmnopqrst";

    fn id(incarnation: u64) -> RuntimeSessionId {
        let token = BrokerKey::new(b"test key".to_vec()).token(SESSION, incarnation);
        RuntimeSessionId::new(SESSION, incarnation, &token).expect("a session id")
    }

    #[test]
    fn it_round_trips_and_fits_agentcore_limits() {
        for incarnation in [0, 1, 42, u64::MAX] {
            let text = id(incarnation).to_string();
            assert!(
                (MIN_LEN..=MAX_LEN).contains(&text.len()),
                "{text}: {} chars",
                text.len()
            );
            assert!(
                text.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'),
                "{text}"
            );
            assert!(text.as_bytes()[0].is_ascii_alphanumeric());
            assert_eq!(text.parse::<RuntimeSessionId>(), Ok(id(incarnation)));
        }
    }

    #[test]
    fn each_incarnation_and_key_gives_another_id() {
        assert_ne!(id(1).to_string(), id(2).to_string());
        let other = BrokerKey::new(b"another key".to_vec()).token(SESSION, 1);
        let other = RuntimeSessionId::new(SESSION, 1, &other).expect("a session id");
        assert_ne!(other.to_string(), id(1).to_string());
    }

    #[test]
    fn malformed_ids_are_refused_with_their_reason() {
        let good = id(7).to_string();
        let hash = good.rsplit('-').next().expect("a hash part");
        let cases = [
            ("", RuntimeSessionIdError::Scheme),
            ("oab2-abc-1-x", RuntimeSessionIdError::Scheme),
            (&format!("{good}-extra"), RuntimeSessionIdError::Scheme),
            (&format!("oab1-ABC-1-{hash}"), RuntimeSessionIdError::Session),
            (&format!("oab1--1-{hash}"), RuntimeSessionIdError::Session),
            (
                &format!("oab1-{SESSION}-+1-{hash}"),
                RuntimeSessionIdError::Incarnation,
            ),
            (
                &format!("oab1-{SESSION}-01-{hash}"),
                RuntimeSessionIdError::Incarnation,
            ),
            (
                &format!("oab1-{SESSION}-x-{hash}"),
                RuntimeSessionIdError::Incarnation,
            ),
            (
                &format!("oab1-{SESSION}-1-{}", &hash[1..]),
                RuntimeSessionIdError::TokenHash,
            ),
            (
                &format!("oab1-{SESSION}-1-{}", hash.to_ascii_uppercase()),
                RuntimeSessionIdError::TokenHash,
            ),
        ];
        for (text, why) in cases {
            assert_eq!(text.parse::<RuntimeSessionId>(), Err(why), "{text:?}");
        }
    }

    #[test]
    fn wipe_requests_round_trip_and_answers_are_checked() {
        let token = BrokerKey::new(b"test key".to_vec()).token(SESSION, 1);
        assert_eq!(parse_wipe_request(&wipe_request(&token)), Some(token));
        assert_eq!(parse_wipe_request(b"oab-relay-wipe nothex"), None);
        assert_eq!(parse_wipe_request(b"{\"prompt\":\"hi\"}"), None);
        assert!(check_wipe_answer(wipe_answer(3).as_bytes()).is_ok());
        assert!(check_wipe_answer(br#"{"relay":"oab-relay"}"#).is_err());
    }

    #[test]
    fn the_id_admits_only_its_own_token() {
        let parsed: RuntimeSessionId = id(3).to_string().parse().expect("parses");
        let key = BrokerKey::new(b"test key".to_vec());
        assert!(parsed.token_hash().verify(&key.token(SESSION, 3)));
        assert!(!parsed.token_hash().verify(&key.token(SESSION, 4)));
        assert!(!parsed
            .token_hash()
            .verify(&BrokerKey::new(b"x".to_vec()).token(SESSION, 3)));
    }
}
