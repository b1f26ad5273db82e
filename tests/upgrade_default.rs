//! An absent `[session_runtime]` section builds upstream's behaviour, and each step beyond it is
//! one explicit key.

use openab_runtime::config::SessionRuntimeConfig;
use openab_runtime::{AgentCommand, Error, IsolationLevel};

fn built(document: &str) -> openab_runtime::Result<std::sync::Arc<dyn openab_runtime::SessionRuntime>> {
    let config = SessionRuntimeConfig::from_toml_document(document)?;
    openab_runtime::from_config(
        &config,
        &AgentCommand::new("agent").working_dir(std::env::temp_dir()),
    )
}

#[test]
fn no_section_is_the_shared_runtime_that_isolates_nothing() {
    let runtime = built("[agent]\ncommand = \"agent\"\n").expect("runtime");
    assert_eq!(runtime.name(), "shared");
    assert_eq!(runtime.capabilities().isolation, IsolationLevel::None);
    assert!(!runtime.capabilities().persistent_storage);
}

#[cfg(target_os = "linux")]
#[test]
fn per_session_storage_is_one_key() {
    let root = tempfile::tempdir().expect("root");
    let runtime = built(&format!(
        "[session_runtime.local]\nstorage = \"per-session\"\nroot = \"{}\"\n",
        root.path().join("sessions").display()
    ))
    .expect("runtime");
    assert_eq!(runtime.name(), "local");
    assert_eq!(
        runtime.capabilities().isolation,
        IsolationLevel::None,
        "plain: no sandbox yet"
    );
    assert!(runtime.capabilities().persistent_storage);
}

#[test]
fn an_old_configuration_that_expected_a_sandbox_is_refused_by_key() {
    match built("[session_runtime.local]\nroot = \"/var/lib/openab/sessions\"\n") {
        Err(Error::InvalidConfig { key, reason }) => {
            assert_eq!(key, "session_runtime.local.root");
            assert!(reason.contains("storage = \"per-session\""), "{reason}");
        }
        Err(other) => panic!("{other:?}"),
        Ok(runtime) => panic!("built {}", runtime.name()),
    }
}

#[cfg(not(target_os = "linux"))]
#[test]
fn per_session_storage_is_unsupported_off_linux() {
    match built("[session_runtime.local]\nstorage = \"per-session\"\n") {
        Err(Error::Unsupported { runtime, operation }) => {
            assert_eq!(runtime, "local");
            assert!(operation.contains("need Linux"), "{operation}");
        }
        Err(other) => panic!("{other:?}"),
        Ok(runtime) => panic!("built {}", runtime.name()),
    }
}
