//! Selecting a runtime from OpenAB's configuration file through the facade.

use openab_runtime::config::{RuntimeKind, SessionRuntimeConfig};
use openab_runtime::{compiled_in, from_config, AgentCommand, Error};

fn agent() -> AgentCommand {
    AgentCommand::new("acp-test-agent")
}

fn type_error(config: &str) -> String {
    let config = SessionRuntimeConfig::from_toml_document(config).expect("the config parses");
    match from_config(&config, &agent()) {
        Err(Error::InvalidConfig { key, reason }) => {
            assert_eq!(key, "session_runtime.type");
            reason
        }
        other => panic!("expected an InvalidConfig naming session_runtime.type, got {other:?}"),
    }
}

#[test]
fn a_backend_not_compiled_in_names_its_feature() {
    for (kind, config) in [
        (
            RuntimeKind::Kubernetes,
            "[session_runtime]\ntype = \"kubernetes\"\n[session_runtime.kubernetes]\nnamespace = \"s\"\nprofile = \"p\"\n",
        ),
        (
            RuntimeKind::Agentcore,
            "[session_runtime]\ntype = \"agentcore\"\n[session_runtime.agentcore]\nruntime_arn = \"arn:aws:bedrock-agentcore:us-east-1:123456789012:runtime/x\"\n",
        ),
    ] {
        if compiled_in(kind) {
            continue;
        }
        let reason = type_error(config);
        assert!(reason.contains(&format!("`{kind}` cargo feature")), "{reason}");
    }
}

#[test]
fn an_unknown_type_is_refused_before_any_backend_is_built() {
    match SessionRuntimeConfig::from_toml_document("[session_runtime]\ntype = \"docker\"\n") {
        Err(Error::InvalidConfig { key, reason }) => {
            assert_eq!(key, "session_runtime.type");
            assert!(
                reason.contains("local"),
                "the reason lists the valid types: {reason}"
            );
        }
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

#[test]
fn compiled_in_follows_the_cargo_features() {
    assert_eq!(compiled_in(RuntimeKind::Local), cfg!(feature = "local"));
    assert_eq!(compiled_in(RuntimeKind::Kubernetes), cfg!(feature = "kubernetes"));
    assert_eq!(compiled_in(RuntimeKind::Agentcore), cfg!(feature = "agentcore"));
}

#[cfg(feature = "kubernetes")]
#[test]
fn a_kubernetes_section_builds_the_kubernetes_runtime_without_contacting_a_cluster() {
    let config = SessionRuntimeConfig::from_toml_document(
        "[session_runtime]\ntype = \"kubernetes\"\n[session_runtime.kubernetes]\nnamespace = \"s\"\nprofile = \"p\"\n",
    )
    .expect("the config parses");
    let runtime = from_config(&config, &agent()).expect("a runtime; the client is inferred on first use");
    assert_eq!(runtime.name(), "kubernetes");
}

#[cfg(feature = "agentcore")]
#[test]
fn an_agentcore_section_builds_the_agentcore_runtime_without_calling_aws() {
    let state = tempfile::tempdir().expect("a state directory");
    let config = SessionRuntimeConfig::from_toml_document(&format!(
        "[session_runtime]\ntype = \"agentcore\"\n[session_runtime.agentcore]\n\
         runtime_arn = \"arn:aws:bedrock-agentcore:us-east-1:123456789012:runtime/x\"\n\
         session_storage = true\nstate_dir = \"{}\"\n",
        state.path().display()
    ))
    .expect("the config parses");
    let runtime = from_config(&config, &agent()).expect("a runtime; AWS is configured on first use");
    assert_eq!(runtime.name(), "agentcore");
    let capabilities = runtime.capabilities();
    assert_eq!(capabilities.isolation, openab_runtime::IsolationLevel::MicroVm);
    assert!(capabilities.persistent_storage);
    assert_eq!(
        capabilities.max_lifetime,
        Some(std::time::Duration::from_secs(8 * 3600))
    );
    assert!(
        state.path().join("relay.key").exists(),
        "the relay key is made in the state directory"
    );
}
