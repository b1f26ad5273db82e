//! Who a session belongs to ([`SessionIdentity`]) and the name it goes by ([`SessionId`]).
//!
//! A session is identified by four parts: the broker deployment (`installation`), the configured
//! agent (`agent`), the chat platform (`platform`) and the thread on that platform (`thread`).
//! Two deployments sharing a cluster never collide, and two bots in one thread get two sessions.
//!
//! # The id is computed, not looked up
//!
//! [`SessionIdentity::id`] derives the [`SessionId`] from the four parts with SHA-256. Nothing maps
//! threads to sessions, so there is no table that can go stale, be lost in a crash, or disagree
//! between broker replicas: every replica, before and after a restart, computes the same id for the
//! same thread and finds the same session.
//!
//! # What appears where
//!
//! The [`SessionId`] is the only form of a session that ever appears in a path, an object name, a
//! label or a log field. It is 20 characters of `a-z` and `2-7`, so it is safe in all of them.
//!
//! The raw `thread` never appears in any of those: it may be sensitive (a DM channel, a user id)
//! and it is arbitrary user-controlled text. Accordingly:
//! - the [`Debug`](fmt::Debug) output of [`SessionIdentity`] redacts it;
//! - [`SessionIdentity`] has no [`Display`](fmt::Display) implementation, so it cannot end up in a
//!   log line or a path by accident: format [`SessionIdentity::id`] instead;
//! - validation errors describe what is wrong with a thread but never quote it.
//!
//! The other parts are short DNS-label-like names (`[a-z0-9-]`, 1 to 63 bytes) chosen by an
//! administrator, so they may be used as Kubernetes label values and may appear in errors.
//!
//! # Stability
//!
//! [`SessionIdentity::canonical_encoding`] and [`SessionIdentity::id`] are stable forever: a
//! session created by one version must be found by every later version. Test vectors produced by an
//! independent implementation (`tests/data/identity-vectors.json`) pin them. A different encoding
//! would need a new domain tag (`openab-session-id/v2`) and a migration, never an edit of v1.

use std::fmt;
use std::str::FromStr;

use serde::de::{self, Deserializer, Visitor};
use serde::ser::Serializer;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::Error;

/// Prefix of every canonical encoding; changing it changes every session id.
const DOMAIN_TAG: &[u8] = b"openab-session-id/v1";

/// How the label parts are described in errors.
const LABEL_RULE: &str = "must be 1 to 63 characters of a-z, 0-9 and '-', not starting or ending with '-'";

/// How the thread part is described in errors.
const THREAD_RULE: &str =
    "must be 1 to 256 bytes of utf-8 without control or format characters, not only whitespace";

/// The length of a [`SessionId`].
const ID_LEN: usize = 20;

/// At most this many characters of a rejected value are quoted in an error.
const ECHO_CHARS: usize = 64;

/// The identity of a session: which deployment, agent and chat thread it belongs to.
///
/// Every part is validated on construction and on deserialization, so a value of this type is
/// always valid:
/// - `installation`, `agent` and `platform`: 1 to [`MAX_LABEL_BYTES`](Self::MAX_LABEL_BYTES)
///   bytes of `[a-z0-9-]`, neither starting nor ending with `-` (like a DNS label, so they can be
///   Kubernetes label values);
/// - `thread`: 1 to [`MAX_THREAD_BYTES`](Self::MAX_THREAD_BYTES) bytes of UTF-8 without control
///   characters ([`char::is_control`]), Unicode format characters (general category `Cf`, such as
///   U+202E RIGHT-TO-LEFT OVERRIDE, U+200B ZERO WIDTH SPACE or U+FEFF) or line and paragraph
///   separators (U+2028, U+2029), and not only whitespace. Any script and emoji are allowed, but
///   not emoji sequences joined with U+200D ZERO WIDTH JOINER or tag characters, which are `Cf`.
///   No Unicode normalization is applied: `"café"` precomposed and decomposed are two threads.
///   Path-like values such as `"../x"` are fine: a thread is never used as a path.
///
/// `Debug` redacts the thread, and there is deliberately no `Display`: log [`id`](Self::id).
///
/// Serialized (with serde) as a map of the four parts; deserializing validates them.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct SessionIdentity {
    installation: String,
    agent: String,
    platform: String,
    thread: String,
    /// Derived from the four parts at construction.
    id: SessionId,
}

impl SessionIdentity {
    /// The maximum length, in bytes, of `installation`, `agent` and `platform`.
    pub const MAX_LABEL_BYTES: usize = 63;

    /// The maximum length, in bytes of UTF-8, of `thread`.
    pub const MAX_THREAD_BYTES: usize = 256;

    /// Validates the four parts and builds the identity.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidIdentity`] naming the first invalid part (`installation`, `agent`,
    /// `platform` or `thread`, checked in that order) and what is wrong with it. The problem text
    /// may quote an invalid installation, agent or platform (escaped and cut to 64 characters),
    /// but never the thread.
    pub fn new(
        installation: impl Into<String>,
        agent: impl Into<String>,
        platform: impl Into<String>,
        thread: impl Into<String>,
    ) -> Result<Self, Error> {
        let installation = installation.into();
        let agent = agent.into();
        let platform = platform.into();
        let thread = thread.into();
        check_label("installation", &installation)?;
        check_label("agent", &agent)?;
        check_label("platform", &platform)?;
        check_thread(&thread)?;
        let id = SessionId::from_digest(&digest_of(&canonical_encoding(
            &installation,
            &agent,
            &platform,
            &thread,
        )));
        Ok(Self {
            installation,
            agent,
            platform,
            thread,
            id,
        })
    }

    /// The broker deployment, e.g. `prod-bot`.
    pub fn installation(&self) -> &str {
        &self.installation
    }

    /// The configured agent, e.g. `claude`.
    pub fn agent(&self) -> &str {
        &self.agent
    }

    /// The chat platform, e.g. `discord`.
    pub fn platform(&self) -> &str {
        &self.platform
    }

    /// The thread on the platform, e.g. a Discord channel id or Slack `channel:thread_ts`.
    ///
    /// Sensitive: never put it in a path, an object name, a label or a log. Use
    /// [`id`](Self::id) there.
    pub fn thread(&self) -> &str {
        &self.thread
    }

    /// The session id: the first 20 characters of the lowercase RFC 4648 base32 (no padding) of
    /// the SHA-256 of [`canonical_encoding`](Self::canonical_encoding).
    ///
    /// 20 characters carry 100 bits, so an accidental collision is negligible. Stable forever.
    pub fn id(&self) -> SessionId {
        self.id
    }

    /// Checks that the identity belongs to `installation`, the one a runtime serves.
    ///
    /// # Errors
    /// [`Error::InvalidIdentity`] for the `installation` part when it is another.
    pub fn require_installation(&self, installation: &str) -> Result<(), Error> {
        if self.installation == installation {
            return Ok(());
        }
        Err(Error::InvalidIdentity {
            part: "installation",
            problem: format!("belongs to another installation than {installation}"),
        })
    }

    /// The full SHA-256 of [`canonical_encoding`](Self::canonical_encoding), of which the
    /// [`SessionId`] is a prefix.
    ///
    /// For backends that record the full hash next to the short id (e.g. a Kubernetes annotation
    /// checked before adopting an object), so a short-id collision or a tampered object is
    /// detected.
    pub fn digest(&self) -> [u8; 32] {
        digest_of(&self.canonical_encoding())
    }

    /// The unambiguous byte encoding of the identity that the [`SessionId`] is hashed from.
    ///
    /// The ASCII domain tag `openab-session-id/v1`, then for each part in the order
    /// `installation`, `agent`, `platform`, `thread`: its UTF-8 length in bytes as a big-endian
    /// `u32`, then its bytes.
    ///
    /// The length prefixes make the encoding injective: reading it from the start, each length
    /// says exactly where its part ends, so the four parts can be recovered and two different
    /// identities never encode alike. Plain concatenation would not be: `("ab", "c")` and
    /// `("a", "bc")` both concatenate to `abc`. Separators would work only as long as no part can
    /// contain the separator; length prefixes need no such rule. The domain tag keeps these hashes
    /// apart from any other SHA-256 use and versions the scheme.
    ///
    /// Stable forever: checked-in test vectors pin it.
    pub fn canonical_encoding(&self) -> Vec<u8> {
        canonical_encoding(&self.installation, &self.agent, &self.platform, &self.thread)
    }
}

impl fmt::Debug for SessionIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionIdentity")
            .field("installation", &self.installation)
            .field("agent", &self.agent)
            .field("platform", &self.platform)
            .field("thread", &Redacted(self.thread.len()))
            .field("id", &format_args!("{}", self.id))
            .finish()
    }
}

/// Shows a redacted value as `<redacted N bytes>`.
struct Redacted(usize);

impl fmt::Debug for Redacted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "<redacted {} bytes>", self.0)
    }
}

/// The wire form of a [`SessionIdentity`] when deserializing.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawIdentity {
    installation: String,
    agent: String,
    platform: String,
    thread: String,
}

/// The wire form of a [`SessionIdentity`] when serializing.
#[derive(Serialize)]
struct RawIdentityRef<'a> {
    installation: &'a str,
    agent: &'a str,
    platform: &'a str,
    thread: &'a str,
}

impl Serialize for SessionIdentity {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        RawIdentityRef {
            installation: &self.installation,
            agent: &self.agent,
            platform: &self.platform,
            thread: &self.thread,
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for SessionIdentity {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = RawIdentity::deserialize(deserializer)?;
        SessionIdentity::new(raw.installation, raw.agent, raw.platform, raw.thread).map_err(de::Error::custom)
    }
}

fn canonical_encoding(installation: &str, agent: &str, platform: &str, thread: &str) -> Vec<u8> {
    let parts = [installation, agent, platform, thread];
    let len = DOMAIN_TAG.len() + parts.iter().map(|p| 4 + p.len()).sum::<usize>();
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(DOMAIN_TAG);
    for part in parts {
        // Validation bounds every part to 256 bytes, far below u32::MAX.
        let part_len = u32::try_from(part.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&part_len.to_be_bytes());
        out.extend_from_slice(part.as_bytes());
    }
    out
}

fn digest_of(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

fn invalid(part: &'static str, problem: String) -> Error {
    Error::InvalidIdentity { part, problem }
}

/// Quotes a value for an error: at most [`ECHO_CHARS`] characters, everything outside printable
/// ASCII escaped, so the message stays one plain line whatever the input.
fn echo(value: &str) -> String {
    let mut out = String::from("\"");
    for c in value.chars().take(ECHO_CHARS) {
        out.extend(c.escape_default());
    }
    if value.chars().nth(ECHO_CHARS).is_some() {
        out.push_str("\"...");
    } else {
        out.push('"');
    }
    out
}

fn check_label(part: &'static str, value: &str) -> Result<(), Error> {
    if value.is_empty() {
        return Err(invalid(part, format!("is empty; {LABEL_RULE}")));
    }
    if value.len() > SessionIdentity::MAX_LABEL_BYTES {
        return Err(invalid(
            part,
            format!("{} is {} bytes long; {LABEL_RULE}", echo(value), value.len()),
        ));
    }
    if let Some(c) = value.chars().find(|c| !matches!(c, 'a'..='z' | '0'..='9' | '-')) {
        return Err(invalid(
            part,
            format!("{} contains '{}'; {LABEL_RULE}", echo(value), c.escape_default()),
        ));
    }
    if value.starts_with('-') || value.ends_with('-') {
        return Err(invalid(
            part,
            format!("{} starts or ends with '-'; {LABEL_RULE}", echo(value)),
        ));
    }
    Ok(())
}

/// Validates a thread. Never quotes it: only its length and the code point and offset of a
/// forbidden character are reported.
fn check_thread(value: &str) -> Result<(), Error> {
    const PART: &str = "thread";
    if value.is_empty() {
        return Err(invalid(PART, format!("is empty; {THREAD_RULE}")));
    }
    if value.len() > SessionIdentity::MAX_THREAD_BYTES {
        return Err(invalid(
            PART,
            format!("is {} bytes long; {THREAD_RULE}", value.len()),
        ));
    }
    for (offset, c) in value.char_indices() {
        let kind = if c.is_control() {
            "a control character"
        } else if is_format(c) {
            "a unicode format character"
        } else if matches!(c, '\u{2028}' | '\u{2029}') {
            "a line or paragraph separator"
        } else {
            continue;
        };
        return Err(invalid(
            PART,
            format!(
                "contains {kind} (U+{:04X}) at byte {offset}; {THREAD_RULE}",
                u32::from(c)
            ),
        ));
    }
    if value.chars().all(char::is_whitespace) {
        return Err(invalid(PART, format!("is only whitespace; {THREAD_RULE}")));
    }
    Ok(())
}

/// Unicode general category `Cf` (format characters), as of Unicode 15.1, as inclusive ranges.
///
/// These are invisible and can make one thread look like another, reorder text (bidi controls) or
/// hide content (tag characters), so threads must not contain them.
const FORMAT_RANGES: &[(u32, u32)] = &[
    (0x00AD, 0x00AD),
    (0x0600, 0x0605),
    (0x061C, 0x061C),
    (0x06DD, 0x06DD),
    (0x070F, 0x070F),
    (0x0890, 0x0891),
    (0x08E2, 0x08E2),
    (0x180E, 0x180E),
    (0x200B, 0x200F),
    (0x202A, 0x202E),
    (0x2060, 0x2064),
    (0x2066, 0x206F),
    (0xFEFF, 0xFEFF),
    (0xFFF9, 0xFFFB),
    (0x110BD, 0x110BD),
    (0x110CD, 0x110CD),
    (0x13430, 0x1343F),
    (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),
    (0xE0001, 0xE0001),
    (0xE0020, 0xE007F),
];

fn is_format(c: char) -> bool {
    let c = u32::from(c);
    FORMAT_RANGES
        .iter()
        .any(|&(first, last)| (first..=last).contains(&c))
}

/// The name of a session: 20 characters of lowercase base32 (`a-z`, `2-7`).
///
/// Computed by [`SessionIdentity::id`]; the only form of a session that may appear in paths,
/// object names, labels and logs. It is `Copy`, and orders and compares as its string.
///
/// `Display` and [`as_str`](Self::as_str) give the bare id; `Debug` gives `SessionId("…")`.
/// Serialized (with serde) as a string; deserializing validates it like [`parse`](Self::parse).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId([u8; ID_LEN]);

impl SessionId {
    /// The length of every session id, in characters (and bytes: they are ASCII).
    pub const LEN: usize = ID_LEN;

    /// Parses a session id: exactly 20 characters of `a-z` and `2-7`.
    ///
    /// Any such string is accepted, whether or not some identity hashes to it.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidIdentity`] with part `session id` for any other string.
    pub fn parse(s: &str) -> Result<Self, Error> {
        const PART: &str = "session id";
        const RULE: &str = "must be exactly 20 characters of a-z and 2-7";
        let Ok(bytes) = <[u8; Self::LEN]>::try_from(s.as_bytes()) else {
            return Err(invalid(
                PART,
                format!("{} is {} bytes long; {RULE}", echo(s), s.len()),
            ));
        };
        if let Some(c) = s.chars().find(|&c| !is_base32_lower(c)) {
            return Err(invalid(
                PART,
                format!("{} contains '{}'; {RULE}", echo(s), c.escape_default()),
            ));
        }
        Ok(Self(bytes))
    }

    /// The id as a string slice.
    pub fn as_str(&self) -> &str {
        // Every constructor checks that the bytes are ASCII base32.
        std::str::from_utf8(&self.0).expect("a session id is ascii")
    }

    fn from_digest(digest: &[u8; 32]) -> Self {
        let encoded = data_encoding::BASE32_NOPAD.encode(digest);
        let mut id = [0u8; Self::LEN];
        for (out, b) in id.iter_mut().zip(encoded.bytes()) {
            *out = b.to_ascii_lowercase();
        }
        Self(id)
    }
}

fn is_base32_lower(c: char) -> bool {
    matches!(c, 'a'..='z' | '2'..='7')
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SessionId({:?})", self.as_str())
    }
}

impl FromStr for SessionId {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        Self::parse(s)
    }
}

impl AsRef<str> for SessionId {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl Serialize for SessionId {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for SessionId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct IdVisitor;

        impl Visitor<'_> for IdVisitor {
            type Value = SessionId;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a session id: 20 characters of a-z and 2-7")
            }

            fn visit_str<E: de::Error>(self, s: &str) -> Result<SessionId, E> {
                SessionId::parse(s).map_err(E::custom)
            }
        }

        deserializer.deserialize_str(IdVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_ranges_are_sorted_and_disjoint() {
        for &(first, last) in FORMAT_RANGES {
            assert!(first <= last && char::from_u32(last).is_some());
        }
        for pair in FORMAT_RANGES.windows(2) {
            assert!(pair[0].1 < pair[1].0, "{pair:x?}");
        }
    }

    #[test]
    fn format_characters_are_detected_at_range_edges() {
        for &(first, last) in FORMAT_RANGES {
            for c in [first, last] {
                assert!(is_format(char::from_u32(c).unwrap()));
            }
        }
        for c in [
            'a',
            ' ',
            '\u{AC}',
            '\u{AE}',
            '\u{200A}',
            '\u{2010}',
            '\u{FE0F}',
            '\u{E0080}',
            '🧵',
        ] {
            assert!(!is_format(c), "{c:?}");
        }
    }
}
