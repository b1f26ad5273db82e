//! Fuzzes session identities and ids: no input panics `SessionIdentity::new` or `SessionId::parse`;
//! an accepted identity has a well-formed id that parses back; two accepted identities encode
//! alike exactly when they are equal (and then share their id); an error about the thread never
//! quotes it.
//!
//! Run: `./scripts/fuzz 300 identity`

#![no_main]

use libfuzzer_sys::fuzz_target;
use session_runtime::{Error, SessionId, SessionIdentity};

fn build(parts: &[String; 4]) -> Option<SessionIdentity> {
    let [installation, agent, platform, thread] = parts.clone();
    match SessionIdentity::new(installation, agent, platform, thread.clone()) {
        Ok(identity) => {
            let id = identity.id();
            assert_eq!(id.as_str().len(), SessionId::LEN);
            assert!(id
                .as_str()
                .bytes()
                .all(|b| b.is_ascii_lowercase() || (b'2'..=b'7').contains(&b)));
            assert_eq!(SessionId::parse(id.as_str()).ok(), Some(id));
            Some(identity)
        }
        Err(Error::InvalidIdentity { part, problem }) => {
            // (A whitespace-only thread is refused too, and trivially "found" in any message.)
            if part == "thread" && !thread.trim().is_empty() {
                assert!(!problem.contains(&thread), "an error quoted the thread");
            }
            None
        }
        Err(other) => panic!("an identity error of another kind: {other:?}"),
    }
}

fuzz_target!(|input: ([String; 4], [String; 4], String)| {
    let (first, second, id) = input;
    if let (Some(a), Some(b)) = (build(&first), build(&second)) {
        let same = first == second;
        assert_eq!(a.canonical_encoding() == b.canonical_encoding(), same);
        assert_eq!(a.id() == b.id(), same);
    }
    match SessionId::parse(&id) {
        Ok(parsed) => assert_eq!(parsed.as_str(), id),
        Err(Error::InvalidIdentity { .. }) => {}
        Err(other) => panic!("a session id error of another kind: {other:?}"),
    }
});
