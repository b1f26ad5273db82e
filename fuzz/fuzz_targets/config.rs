//! Fuzzes the `[session_runtime]` configuration reader, as a whole OpenAB file and as a bare
//! section: no input panics it; every refusal is `InvalidConfig` naming a key under
//! `session_runtime`; an accepted configuration validates again.
//!
//! Run: `./scripts/fuzz 300 config` (with `fuzz/config.dict`, the keys and values it knows).

#![no_main]

use libfuzzer_sys::fuzz_target;
use session_runtime::config::SessionRuntimeConfig;
use session_runtime::Error;

fn check(result: session_runtime::Result<SessionRuntimeConfig>) {
    match result {
        Ok(config) => assert!(config.validate().is_ok(), "an accepted config must validate"),
        Err(Error::InvalidConfig { key, .. }) => {
            assert!(key.starts_with("session_runtime"), "a key outside the section: {key}");
        }
        Err(other) => panic!("a config error of another kind: {other:?}"),
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        check(SessionRuntimeConfig::from_toml_document(text));
        check(SessionRuntimeConfig::from_toml_section(text));
    }
});
