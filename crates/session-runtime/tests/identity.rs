//! Session identity: validation, the pinned session id function, and its injectivity.

use std::collections::HashSet;
use std::str::FromStr;

use proptest::prelude::*;
use serde::Deserialize;
use session_runtime::{Error, SessionId, SessionIdentity};

/// One entry of `data/identity-vectors.json`, produced by `data/gen_identity_vectors.py`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Vector {
    note: String,
    installation: String,
    agent: String,
    platform: String,
    thread: String,
    id: String,
}

fn vectors() -> Vec<Vector> {
    serde_json::from_str(include_str!("data/identity-vectors.json")).expect("vectors parse")
}

fn valid(installation: &str, agent: &str, platform: &str, thread: &str) -> SessionIdentity {
    SessionIdentity::new(installation, agent, platform, thread).expect("valid identity")
}

fn is_id_shaped(id: &str) -> bool {
    id.len() == 20 && id.bytes().all(|b| matches!(b, b'a'..=b'z' | b'2'..=b'7'))
}

/// Splits a canonical encoding back into its four parts; `None` if it is malformed.
fn decode(mut bytes: &[u8]) -> Option<[String; 4]> {
    bytes = bytes.strip_prefix(b"openab-session-id/v1".as_slice())?;
    let mut parts: [String; 4] = Default::default();
    for part in &mut parts {
        let (len, rest) = bytes.split_first_chunk::<4>()?;
        let len = usize::try_from(u32::from_be_bytes(*len)).ok()?;
        if rest.len() < len {
            return None;
        }
        let (value, rest) = rest.split_at(len);
        *part = String::from_utf8(value.to_vec()).ok()?;
        bytes = rest;
    }
    bytes.is_empty().then_some(parts)
}

fn parts(identity: &SessionIdentity) -> [String; 4] {
    [
        identity.installation().to_owned(),
        identity.agent().to_owned(),
        identity.platform().to_owned(),
        identity.thread().to_owned(),
    ]
}

/// Asserts that `SessionIdentity::new` rejects the parts for `expected_part`, and that neither
/// the problem nor the whole message quotes the thread.
fn assert_rejected(
    installation: &str,
    agent: &str,
    platform: &str,
    thread: &str,
    expected_part: &str,
) -> String {
    let err =
        SessionIdentity::new(installation, agent, platform, thread).expect_err("identity must be rejected");
    let message = err.to_string();
    let debug = format!("{err:?}");
    match err {
        Error::InvalidIdentity { part, problem } => {
            assert_eq!(part, expected_part, "wrong part in {message:?}");
            assert!(!problem.is_empty());
            assert!(
                problem.starts_with(|c: char| c.is_ascii_lowercase() || c == '"'),
                "not lower-case: {problem}"
            );
            // Too short a value would match the rule text by chance; tests use distinctive ones.
            if thread.trim().chars().count() >= 4 {
                assert!(!problem.contains(thread), "problem quotes the thread: {problem}");
                assert!(!message.contains(thread), "message quotes the thread: {message}");
                assert!(!debug.contains(thread), "debug quotes the thread: {debug}");
            }
            problem
        }
        other => panic!("expected InvalidIdentity, got {other:?}"),
    }
}

#[test]
fn vectors_pin_the_session_id() {
    let vectors = vectors();
    assert!(vectors.len() >= 12);
    for v in &vectors {
        let identity = valid(&v.installation, &v.agent, &v.platform, &v.thread);
        assert_eq!(identity.id().as_str(), v.id, "vector {:?}", v.note);
        assert_eq!(
            identity.id(),
            SessionId::parse(&v.id).unwrap(),
            "vector {:?}",
            v.note
        );
        assert_eq!(identity.id().to_string(), v.id);
        assert_eq!(
            decode(&identity.canonical_encoding()),
            Some(parts(&identity)),
            "vector {:?}",
            v.note
        );
    }
    let ids: HashSet<&str> = vectors.iter().map(|v| v.id.as_str()).collect();
    assert_eq!(ids.len(), vectors.len(), "vector ids must be distinct");
}

#[test]
fn vectors_cover_the_edge_cases() {
    let vectors = vectors();
    let has = |f: &dyn Fn(&Vector) -> bool| vectors.iter().any(f);
    assert!(
        has(&|v| v.thread.chars().any(|c| c as u32 >= 0x1F300)),
        "emoji thread"
    );
    assert!(has(
        &|v| !v.thread.is_ascii() && !v.thread.chars().any(|c| c as u32 >= 0x1F300)
    ));
    assert!(has(&|v| v.installation.len() == 63
        && v.agent.len() == 63
        && v.platform.len() == 63));
    assert!(has(&|v| v.thread.len() == 256 && v.thread.is_ascii()));
    assert!(has(&|v| v.thread.len() == 256 && !v.thread.is_ascii()));
    assert!(has(&|v| v.thread == "C0123ABC:1712345678.000100"));
    assert!(has(
        &|v| v.thread.len() >= 17 && v.thread.bytes().all(|b| b.is_ascii_digit())
    ));
    // Pairs that plain concatenation would merge, across two different part boundaries.
    let concat = |v: &Vector| format!("{}{}{}{}", v.installation, v.agent, v.platform, v.thread);
    let mut merged = 0;
    for (i, a) in vectors.iter().enumerate() {
        for b in &vectors[i + 1..] {
            if concat(a) == concat(b) {
                assert_ne!(a.id, b.id);
                merged += 1;
            }
        }
    }
    assert!(merged >= 2, "need vectors that collide under naive concatenation");
}

#[test]
fn canonical_encoding_is_length_prefixed() {
    let identity = valid("ab", "c", "slack", "🧵");
    let mut expected = b"openab-session-id/v1".to_vec();
    expected.extend_from_slice(&[0, 0, 0, 2, b'a', b'b']);
    expected.extend_from_slice(&[0, 0, 0, 1, b'c']);
    expected.extend_from_slice(&[0, 0, 0, 5, b's', b'l', b'a', b'c', b'k']);
    expected.extend_from_slice(&[0, 0, 0, 4, 0xF0, 0x9F, 0xA7, 0xB5]);
    assert_eq!(identity.canonical_encoding(), expected);
    let other = valid("a", "bc", "slack", "🧵");
    assert_ne!(identity.canonical_encoding(), other.canonical_encoding());
    assert_ne!(identity.id(), other.id());
}

#[test]
fn digest_extends_the_session_id() {
    let identity = valid("prod", "claude", "discord", "1234567890123456789");
    let digest = identity.digest();
    let encoded = data_encoding::BASE32_NOPAD.encode(&digest).to_ascii_lowercase();
    assert_eq!(&encoded[..20], identity.id().as_str());
}

#[test]
fn rejects_empty_parts() {
    assert_rejected("", "claude", "discord", "secret-thread", "installation");
    assert_rejected("prod", "", "discord", "secret-thread", "agent");
    assert_rejected("prod", "claude", "", "secret-thread", "platform");
    assert_rejected("prod", "claude", "discord", "", "thread");
}

#[test]
fn rejects_bad_labels() {
    for bad in [
        "Prod", "pro d", "prod_bot", "-prod", "prod-", "-", "prod.bot", "prød", "prod\0", "prod\n",
    ] {
        let problem = assert_rejected(bad, "claude", "discord", "secret-thread", "installation");
        assert!(problem.contains("a-z, 0-9 and '-'"), "{problem}");
    }
    let long_agent = "a".repeat(64);
    assert_rejected("prod", &long_agent, "discord", "secret-thread", "agent");
    assert_rejected("prod", "claude", "Discord", "secret-thread", "platform");
    // 63 bytes is the maximum.
    valid(&"a".repeat(63), &"b".repeat(63), &"c".repeat(63), "1");
}

#[test]
fn label_errors_quote_at_most_64_characters_of_the_value() {
    let long = format!("X{}", "y".repeat(10_000));
    let problem = assert_rejected(&long, "claude", "discord", "secret-thread", "installation");
    assert!(problem.len() < 300, "{problem}");
    let problem = assert_rejected(
        "Prod\u{202E}",
        "claude",
        "discord",
        "secret-thread",
        "installation",
    );
    assert!(
        !problem.contains('\u{202E}'),
        "raw control characters must be escaped: {problem}"
    );
    assert!(problem.is_ascii(), "{problem}");
}

#[test]
fn rejects_bad_threads() {
    let nul = "secret-channel\0value";
    let problem = assert_rejected("prod", "claude", "discord", nul, "thread");
    assert!(problem.contains("control"), "{problem}");
    for format_char in [
        '\u{202E}',
        '\u{200B}',
        '\u{FEFF}',
        '\u{00AD}',
        '\u{2066}',
        '\u{E0041}',
    ] {
        let thread = format!("secret{format_char}value");
        let problem = assert_rejected("prod", "claude", "discord", &thread, "thread");
        assert!(problem.contains("format"), "{problem}");
    }
    assert_rejected("prod", "claude", "discord", "\u{202E}", "thread");
    for c in ['\t', '\n', '\r', '\u{7F}', '\u{85}', '\u{2028}', '\u{2029}'] {
        assert_rejected("prod", "claude", "discord", &format!("secret{c}value"), "thread");
    }

    let too_long = "S".repeat(257);
    let problem = assert_rejected("prod", "claude", "discord", &too_long, "thread");
    assert!(problem.contains("257"), "{problem}");
    assert!(!problem.contains("SSSS"), "{problem}");
    let huge = "Q".repeat(10 * 1024);
    assert_rejected("prod", "claude", "discord", &huge, "thread");
    // 257 bytes of multi-byte characters: the limit is in bytes.
    let wide = format!("{}a", "é".repeat(128));
    assert_rejected("prod", "claude", "discord", &wide, "thread");

    for blank in [" ", "   ", "\u{3000}", " \u{A0} "] {
        let problem = assert_rejected("prod", "claude", "discord", blank, "thread");
        assert!(problem.contains("whitespace"), "{problem}");
    }
}

#[test]
fn thread_checks_run_after_the_labels() {
    assert_rejected("BAD", "claude", "discord", "", "installation");
}

#[test]
fn accepts_path_like_and_unicode_threads() {
    let longest_ascii = "t".repeat(256);
    let longest_emoji = "🧵".repeat(64);
    for thread in [
        "../../etc/passwd",
        "/abs",
        "..",
        "🧵🚀",
        "❤\u{FE0F}",
        "スレッド",
        "مرحبا",
        " padded ",
        "C0123ABC:1712345678.000100",
        "1234567890123456789",
        &longest_ascii,
        &longest_emoji,
    ] {
        let identity = valid("prod", "claude", "discord", thread);
        assert_eq!(identity.thread(), thread);
        assert!(is_id_shaped(identity.id().as_str()), "{}", identity.id());
    }
}

#[test]
fn getters_return_the_parts() {
    let identity = valid("prod-bot", "claude", "slack", "C1:2.3");
    assert_eq!(identity.installation(), "prod-bot");
    assert_eq!(identity.agent(), "claude");
    assert_eq!(identity.platform(), "slack");
    assert_eq!(identity.thread(), "C1:2.3");
    assert_eq!(identity, identity.clone());
}

#[test]
fn debug_redacts_the_thread() {
    let thread = "D0SECRET:1712345678.000100";
    let identity = valid("prod", "claude", "slack", thread);
    let debug = format!("{identity:?}");
    let pretty = format!("{identity:#?}");
    for text in [&debug, &pretty] {
        assert!(!text.contains(thread), "{text}");
        assert!(!text.contains("SECRET"), "{text}");
        assert!(text.contains("prod") && text.contains("claude") && text.contains("slack"));
        assert!(
            text.contains(&format!("<redacted {} bytes>", thread.len())),
            "{text}"
        );
        assert!(text.contains(identity.id().as_str()), "{text}");
    }
    assert_eq!(
        debug,
        format!(
            "SessionIdentity {{ installation: \"prod\", agent: \"claude\", platform: \"slack\", \
             thread: <redacted 26 bytes>, id: {} }}",
            identity.id()
        )
    );
}

#[test]
fn identity_serde_round_trip_validates() {
    let identity = valid("prod", "claude", "discord", "🧵 1");
    let json = serde_json::to_string(&identity).unwrap();
    assert_eq!(
        json,
        r#"{"installation":"prod","agent":"claude","platform":"discord","thread":"🧵 1"}"#
    );
    let back: SessionIdentity = serde_json::from_str(&json).unwrap();
    assert_eq!(back, identity);
    assert_eq!(back.id(), identity.id());

    let bad = r#"{"installation":"prod","agent":"claude","platform":"discord","thread":"x\u202Esecret"}"#;
    let err = serde_json::from_str::<SessionIdentity>(bad)
        .unwrap_err()
        .to_string();
    assert!(err.contains("thread") && !err.contains("secret"), "{err}");
    let bad = r#"{"installation":"Prod","agent":"claude","platform":"discord","thread":"1"}"#;
    assert!(serde_json::from_str::<SessionIdentity>(bad).is_err());
    let missing = r#"{"installation":"prod","agent":"claude","platform":"discord"}"#;
    assert!(serde_json::from_str::<SessionIdentity>(missing).is_err());
    let extra = r#"{"installation":"prod","agent":"claude","platform":"discord","thread":"1","id":"x"}"#;
    assert!(serde_json::from_str::<SessionIdentity>(extra).is_err());
}

#[test]
fn session_id_parse_round_trip() {
    let id = valid("prod", "claude", "discord", "1").id();
    assert_eq!(SessionId::parse(id.as_str()).unwrap(), id);
    assert_eq!(SessionId::from_str(id.as_ref()).unwrap(), id);
    assert_eq!(id.as_str().parse::<SessionId>().unwrap(), id);
    assert_eq!(format!("{id}"), id.as_str());
    assert_eq!(format!("{id:?}"), format!("SessionId(\"{id}\")"));
    let copy = id;
    assert_eq!(copy, id);
    let all = SessionId::parse("abcdefghijklmnopqrst").unwrap();
    assert!(SessionId::parse("uvwxyz234567abcdefgh").unwrap() > all);
}

#[test]
fn session_id_parse_rejects_malformed() {
    for bad in [
        "",
        "abcdefghijklmnopqrs",   // 19
        "abcdefghijklmnopqrstu", // 21
        "Abcdefghijklmnopqrst",  // uppercase
        "abcdefghijklmnopqrs0",  // '0'
        "abcdefghijklmnopqrs1",  // '1'
        "abcdefghijklmnopqrs8",  // '8'
        "abcdefghijklmnopqrs9",  // '9'
        "abcdefghijklmnopqrs=",  // padding
        "abcdefghijklmnopqrs-",
        "abcdefghijklmnopqr\u{e9}", // 20 bytes, 19 characters
        "abcdefghijklmnopqrs\0",
    ] {
        match SessionId::parse(bad) {
            Err(Error::InvalidIdentity { part, problem }) => {
                assert_eq!(part, "session id", "{bad:?}");
                assert!(problem.is_ascii(), "{problem}");
            }
            other => panic!("{bad:?} was not rejected: {other:?}"),
        }
        assert!(bad.parse::<SessionId>().is_err());
    }
}

#[test]
fn session_id_serde_is_a_validated_string() {
    let id = SessionId::parse("abcdefghijklmnopqr27").unwrap();
    assert_eq!(serde_json::to_string(&id).unwrap(), r#""abcdefghijklmnopqr27""#);
    let back: SessionId = serde_json::from_str(r#""abcdefghijklmnopqr27""#).unwrap();
    assert_eq!(back, id);
    assert!(serde_json::from_str::<SessionId>(r#""ABCDEFGHIJKLMNOPQR27""#).is_err());
    assert!(serde_json::from_str::<SessionId>(r#""abc""#).is_err());
    assert!(serde_json::from_str::<SessionId>("42").is_err());
}

fn label() -> impl Strategy<Value = String> {
    // Boundary characters on purpose: digits, '-', single characters, and the maximum length.
    prop_oneof![
        "[a-c0-9]",
        "[a-c0-9][a-c0-9-]{0,6}[a-c0-9]",
        "[a-z0-9][a-z0-9-]{61}[a-z0-9]",
    ]
}

fn thread() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-c0-9:./ \\-é🧵]{0,7}[a-c0-9:./\\-é🧵][a-c0-9:./ \\-é🧵]{0,7}",
        "[0-9]{17,20}",
        "[A-Z0-9]{9}:[0-9]{10}\\.[0-9]{6}",
        "[a-z🧵]{64}",
    ]
}

fn valid_identity() -> impl Strategy<Value = SessionIdentity> {
    (label(), label(), label(), thread())
        .prop_map(|(i, a, p, t)| SessionIdentity::new(i, a, p, t).expect("strategy yields valid parts"))
}

/// Two identities cut from the same string of `a`/`b` characters at different places, so that
/// plain concatenation would make them equal.
fn same_concatenation() -> impl Strategy<Value = (SessionIdentity, SessionIdentity)> {
    fn cut(s: &str, mut cuts: [usize; 3]) -> SessionIdentity {
        cuts.sort_unstable();
        let [x, y, z] = cuts;
        SessionIdentity::new(&s[..x], &s[x..y], &s[y..z], &s[z..]).expect("non-empty parts")
    }
    "[ab]{4,12}".prop_flat_map(|s| {
        let n = s.len();
        // Distinct cut points in 1..n keep every part non-empty.
        let cuts =
            proptest::sample::subsequence((1..n).collect::<Vec<_>>(), 3).prop_map(|v| [v[0], v[1], v[2]]);
        (Just(s), cuts.clone(), cuts).prop_map(|(s, c1, c2)| (cut(&s, c1), cut(&s, c2)))
    })
}

proptest! {
    #[test]
    fn canonical_encoding_is_injective(a in valid_identity(), b in valid_identity()) {
        let (ea, eb) = (a.canonical_encoding(), b.canonical_encoding());
        prop_assert_eq!(decode(&ea), Some(parts(&a)));
        prop_assert_eq!(decode(&eb), Some(parts(&b)));
        if a != b {
            prop_assert_ne!(ea, eb);
            prop_assert_ne!(a.id(), b.id());
        } else {
            prop_assert_eq!(a.id(), b.id());
        }
    }

    #[test]
    fn naive_concatenation_collisions_are_kept_apart((a, b) in same_concatenation()) {
        let (ea, eb) = (a.canonical_encoding(), b.canonical_encoding());
        prop_assert_eq!(decode(&ea), Some(parts(&a)));
        prop_assert_eq!(decode(&eb), Some(parts(&b)));
        prop_assert_eq!(parts(&a) == parts(&b), ea == eb);
        prop_assert_eq!(parts(&a) == parts(&b), a.id() == b.id());
    }

    #[test]
    fn ids_are_well_formed_and_round_trip(identity in valid_identity()) {
        let id = identity.id();
        prop_assert!(is_id_shaped(id.as_str()));
        prop_assert_eq!(SessionId::parse(id.as_str()).unwrap(), id);
        let json = serde_json::to_string(&identity).unwrap();
        prop_assert_eq!(serde_json::from_str::<SessionIdentity>(&json).unwrap(), identity);
    }

    #[test]
    fn arbitrary_input_never_panics(parts in proptest::array::uniform4(any::<String>())) {
        let [i, a, p, t] = parts;
        if let Err(err) = SessionIdentity::new(i, a, p, t.clone()) {
            let Error::InvalidIdentity { part, problem } = &err else {
                panic!("unexpected error kind: {err:?}");
            };
            if *part == "thread" && t.chars().count() >= 4 {
                prop_assert!(!problem.contains(&t));
            }
        }
    }

    #[test]
    fn arbitrary_session_ids_never_panic(s in any::<String>()) {
        if let Ok(id) = SessionId::parse(&s) {
            prop_assert_eq!(id.as_str(), s.as_str());
        }
    }
}
