//! Parsing and validation of the `[session_runtime]` configuration section.

use std::path::Path;
use std::time::Duration;

use session_runtime::config::{
    AgentCoreConfig, AgentStderr, IdleTtl, KubernetesConfig, NetworkMode, Reach, ReadonlyMount,
    ResourceLimits, RuntimeKind, SandboxMode, SessionRuntimeConfig, StorageMode,
};
use session_runtime::{Error, Retention, RetentionPolicy};

/// The example of DESIGN.md section 3, with `storage = "per-session"` added (needed since 0.2 for
/// its per-session keys).
const DESIGN_EXAMPLE: &str = r#"
[session_runtime]
type = "local"                # local | kubernetes | agentcore; default local
installation = "prod-bot"
idle_ttl = "30m"
[session_runtime.retention]
reset = "delete"
ended = "delete"
retain_for = "7d"
[session_runtime.local]
storage = "per-session"
root = "/var/lib/openab/sessions"
sandbox = "auto"              # auto | bubblewrap | landlock | none
network = "host"              # host | none
readonly = ["/opt/openab/skills:/skills"]
[session_runtime.kubernetes]
namespace = "openab-sessions"
profile = "isolated-worker"   # names a cluster-owned profile; the broker cannot change it
reach = "pod-ip"              # pod-ip | exec
[session_runtime.agentcore]
runtime_arn = "arn:aws:bedrock-agentcore:us-east-1:123456789012:runtime/example"
region = "us-east-1"
"#;

const MINUTE: u64 = 60;
const HOUR: u64 = 60 * MINUTE;
const DAY: u64 = 24 * HOUR;

/// The key and reason of an `InvalidConfig` error; panics on any other outcome.
#[track_caller]
fn invalid_config(result: Result<SessionRuntimeConfig, Error>) -> (String, String) {
    match result {
        Err(Error::InvalidConfig { key, reason }) => (key, reason),
        Err(other) => panic!("expected InvalidConfig, got {other:?}"),
        Ok(config) => panic!("expected InvalidConfig, got {config:?}"),
    }
}

/// Asserts that `section` (a section body) fails with `InvalidConfig` for exactly `key`, and
/// returns the reason.
#[track_caller]
fn section_error(section: &str, key: &str) -> String {
    let (got, reason) = invalid_config(SessionRuntimeConfig::from_toml_section(section));
    assert_eq!(got, key, "reason: {reason}");
    assert!(!reason.is_empty());
    reason
}

/// Asserts that `document` (a whole file) fails with `InvalidConfig` for exactly `key`, and
/// returns the reason.
#[track_caller]
fn document_error(document: &str, key: &str) -> String {
    let (got, reason) = invalid_config(SessionRuntimeConfig::from_toml_document(document));
    assert_eq!(got, key, "reason: {reason}");
    assert!(!reason.is_empty());
    reason
}

#[test]
fn empty_section_is_the_local_runtime_with_upstreams_behaviour() {
    let config = SessionRuntimeConfig::from_toml_section("").unwrap();
    assert_eq!(config, SessionRuntimeConfig::default());
    assert_eq!(config.runtime, RuntimeKind::Local);
    assert_eq!(config.installation, "openab");
    assert_eq!(config.local.storage, StorageMode::Shared);
    assert_eq!(config.idle_ttl, None, "unset stays visible as unset");
    assert_eq!(
        config.effective_idle_ttl(),
        None,
        "upstream has no runtime idle timer"
    );
    assert_eq!(
        config.local.effective_terminate_grace(),
        Duration::from_millis(1500)
    );
    assert_eq!(config.retention, RetentionPolicy::default());
    assert_eq!(config.retention.reset, Retention::Delete);
    assert_eq!(config.retention.ended, Retention::Delete);
    assert_eq!(config.retention.expired, Retention::Delete);
    assert_eq!(config.retention.retain_for, None);
    assert_eq!(config.local.root, None);
    assert_eq!(config.local.sandbox, SandboxMode::None);
    assert_eq!(config.local.network, None);
    assert_eq!(config.local.effective_network(), NetworkMode::Host);
    assert!(config.local.readonly.is_empty());
    assert_eq!(config.local.home_template, None);
    assert_eq!(config.local.limits, None);
    assert_eq!(config.local.terminate_grace, None);
    assert_eq!(config.local.agent_stderr, None);
    assert_eq!(
        config.local.effective_agent_stderr(),
        AgentStderr::Discard,
        "upstream v0.8.x gives the agent /dev/null"
    );
    assert_eq!(config.kubernetes, None);
    assert_eq!(config.agentcore, None);
    config.validate().unwrap();
}

#[test]
fn document_without_the_section_is_the_default() {
    let config = SessionRuntimeConfig::from_toml_document("").unwrap();
    assert_eq!(config, SessionRuntimeConfig::default());
    let config = SessionRuntimeConfig::from_toml_document("[agent]\ncommand = \"kiro-cli\"\n").unwrap();
    assert_eq!(config, SessionRuntimeConfig::default());
    let config = SessionRuntimeConfig::from_toml_document("[session_runtime]\n").unwrap();
    assert_eq!(config, SessionRuntimeConfig::default());
}

#[test]
fn design_example_parses_to_the_expected_values() {
    let config = SessionRuntimeConfig::from_toml_document(DESIGN_EXAMPLE).unwrap();
    assert_eq!(config.runtime, RuntimeKind::Local);
    assert_eq!(config.installation, "prod-bot");
    assert_eq!(
        config.idle_ttl,
        Some(IdleTtl::After(Duration::from_secs(30 * MINUTE)))
    );
    assert_eq!(config.retention.reset, Retention::Delete);
    assert_eq!(config.retention.ended, Retention::Delete);
    assert_eq!(config.retention.expired, Retention::Delete);
    assert_eq!(config.retention.retain_for, Some(Duration::from_secs(7 * DAY)));
    assert_eq!(
        config.local.root.as_deref(),
        Some(Path::new("/var/lib/openab/sessions"))
    );
    assert_eq!(config.local.sandbox, SandboxMode::Auto);
    assert_eq!(config.local.network, Some(NetworkMode::Host));
    assert_eq!(config.local.effective_network(), NetworkMode::Host);
    assert_eq!(
        config.local.readonly,
        vec![ReadonlyMount::new("/opt/openab/skills", "/skills").unwrap()]
    );
    assert_eq!(config.local.readonly[0].host(), Path::new("/opt/openab/skills"));
    assert_eq!(config.local.readonly[0].target(), Path::new("/skills"));
    assert_eq!(config.local.terminate_grace, None);
    assert_eq!(config.local.effective_terminate_grace(), Duration::from_secs(5));

    let kubernetes = config.kubernetes.as_ref().unwrap();
    assert_eq!(
        kubernetes,
        &KubernetesConfig::new("openab-sessions", "isolated-worker")
    );
    assert_eq!(kubernetes.reach, Reach::PodIp);
    assert_eq!(kubernetes.start_timeout, Duration::from_secs(120));

    let agentcore = config.agentcore.as_ref().unwrap();
    assert_eq!(
        agentcore.runtime_arn,
        "arn:aws:bedrock-agentcore:us-east-1:123456789012:runtime/example"
    );
    assert_eq!(agentcore.region.as_deref(), Some("us-east-1"));
    assert_eq!(agentcore.qualifier, None);
    assert_eq!(agentcore.effective_region(), Some("us-east-1"));
    assert_eq!(agentcore.effective_qualifier(), "DEFAULT");
}

#[test]
fn whole_document_ignores_other_tables() {
    let document = format!(
        r#"
[agent]
command = "kiro-cli"
args = ["acp", "--trust-all-tools"]
working_dir = "/home/agent"
whatever = {{ nested = 1 }}

[discord]
bot_token = "${{DISCORD_TOKEN}}"
allowed_channels = ["1"]

[pool]
max_sessions = 10
{DESIGN_EXAMPLE}
[reactions]
enabled = true
"#
    );
    let config = SessionRuntimeConfig::from_toml_document(&document).unwrap();
    assert_eq!(
        config,
        SessionRuntimeConfig::from_toml_document(DESIGN_EXAMPLE).unwrap()
    );
}

#[test]
fn section_and_document_agree() {
    let section = r#"
type = "kubernetes"
installation = "staging"
idle_ttl = "4h"
[retention]
ended = "retain"
expired = "retain"
retain_for = "90s"
[local]
storage = "per-session"
sandbox = "bubblewrap"
network = "none"
home_template = "/etc/openab/home"
terminate_grace = "2m30s"
[local.limits]
memory = "2Gi"
pids = 512
cpu = 1.5
[kubernetes]
namespace = "sessions"
profile = "worker"
reach = "exec"
start_timeout = "5m"
"#;
    let from_section = SessionRuntimeConfig::from_toml_section(section).unwrap();
    let document = section
        .replace("[retention]", "[session_runtime.retention]")
        .replace("[local]", "[session_runtime.local]")
        .replace("[local.limits]", "[session_runtime.local.limits]")
        .replace("[kubernetes]", "[session_runtime.kubernetes]");
    let from_document =
        SessionRuntimeConfig::from_toml_document(&format!("[session_runtime]\n{document}")).unwrap();
    assert_eq!(from_section, from_document);

    let config = from_section;
    assert_eq!(config.runtime, RuntimeKind::Kubernetes);
    assert_eq!(config.installation, "staging");
    assert_eq!(
        config.idle_ttl,
        Some(IdleTtl::After(Duration::from_secs(4 * HOUR)))
    );
    assert_eq!(config.retention.reset, Retention::Delete);
    assert_eq!(config.retention.ended, Retention::Retain);
    assert_eq!(config.retention.expired, Retention::Retain);
    assert_eq!(config.retention.retain_for, Some(Duration::from_secs(90)));
    assert_eq!(config.local.sandbox, SandboxMode::Bubblewrap);
    assert_eq!(config.local.network, Some(NetworkMode::None));
    assert_eq!(
        config.local.home_template.as_deref(),
        Some(Path::new("/etc/openab/home"))
    );
    assert_eq!(
        config.local.terminate_grace,
        Some(Duration::from_secs(2 * MINUTE + 30))
    );
    let limits = config.local.limits.as_ref().unwrap();
    assert_eq!(limits.memory, Some(2 * 1024 * 1024 * 1024));
    assert_eq!(limits.pids, Some(512));
    assert_eq!(limits.cpu, Some(1.5));
    let kubernetes = config.kubernetes.as_ref().unwrap();
    assert_eq!(kubernetes.namespace, "sessions");
    assert_eq!(kubernetes.profile, "worker");
    assert_eq!(kubernetes.reach, Reach::Exec);
    assert_eq!(kubernetes.start_timeout, Duration::from_secs(5 * MINUTE));
}

#[test]
fn durations_parse_to_the_right_values() {
    for (text, seconds) in [
        ("30m", 30 * MINUTE),
        ("4h", 4 * HOUR),
        ("7d", 7 * DAY),
        ("90s", 90),
        ("1h30m", HOUR + 30 * MINUTE),
        ("1h 30m", HOUR + 30 * MINUTE),
    ] {
        let section = format!("idle_ttl = \"{text}\"\n[local]\nstorage = \"per-session\"\n[retention]\nretain_for = \"{text}\"\n");
        let config = SessionRuntimeConfig::from_toml_section(&section).unwrap();
        assert_eq!(
            config.idle_ttl,
            Some(IdleTtl::After(Duration::from_secs(seconds))),
            "{text}"
        );
        assert_eq!(
            config.retention.retain_for,
            Some(Duration::from_secs(seconds)),
            "{text}"
        );
    }
}

#[test]
fn zero_idle_ttl_disables_idle_suspension() {
    for zero in ["0", "0s", "0m"] {
        let config = SessionRuntimeConfig::from_toml_section(&format!("idle_ttl = \"{zero}\"")).unwrap();
        assert_eq!(config.idle_ttl, Some(IdleTtl::Never), "{zero}");
        assert_eq!(config.effective_idle_ttl(), None, "{zero}");
    }
}

#[test]
fn an_unset_idle_ttl_is_told_apart_from_a_set_one() {
    let unset = SessionRuntimeConfig::from_toml_section("[local]\nstorage = \"per-session\"").unwrap();
    assert_eq!(unset.idle_ttl, None);
    assert_eq!(
        unset.effective_idle_ttl(),
        Some(SessionRuntimeConfig::DEFAULT_IDLE_TTL),
        "per-session storage keeps its 30 minute default"
    );
    let set = SessionRuntimeConfig::from_toml_section("idle_ttl = \"30m\"").unwrap();
    assert_eq!(
        set.idle_ttl,
        Some(IdleTtl::After(Duration::from_secs(30 * MINUTE)))
    );
    assert_eq!(set.effective_idle_ttl(), Some(Duration::from_secs(30 * MINUTE)));
    // A broker reconciling its own TTL fills in only what the operator left unset.
    let mut filled = unset.clone();
    filled
        .idle_ttl
        .get_or_insert(IdleTtl::After(Duration::from_secs(4 * HOUR)));
    assert_eq!(filled.effective_idle_ttl(), Some(Duration::from_secs(4 * HOUR)));
    let kubernetes = SessionRuntimeConfig::from_toml_section(
        "type = \"kubernetes\"\n[kubernetes]\nnamespace = \"s\"\nprofile = \"p\"",
    )
    .unwrap();
    assert_eq!(
        kubernetes.effective_idle_ttl(),
        Some(SessionRuntimeConfig::DEFAULT_IDLE_TTL)
    );
}

#[test]
fn per_session_keys_without_per_session_storage_are_refused_by_name() {
    for (body, key) in [
        ("sandbox = \"auto\"", "sandbox"),
        ("sandbox = \"bubblewrap\"", "sandbox"),
        ("root = \"/var/lib/openab/sessions\"", "root"),
        ("home_template = \"/etc/openab/home\"", "home_template"),
        ("readonly = [\"/opt/skills:/skills\"]", "readonly"),
        ("network = \"none\"", "network"),
        ("[local.limits]\npids = 5", "limits"),
    ] {
        let reason = section_error(
            &format!("[local]\n{body}"),
            &format!("session_runtime.local.{key}"),
        );
        assert!(reason.contains("storage = \"per-session\""), "{key}: {reason}");
        SessionRuntimeConfig::from_toml_section(&format!(
            "[local]\nstorage = \"per-session\"\nsandbox = \"auto\"\n{}",
            body.replace("sandbox = \"auto\"", "")
                .replace("sandbox = \"bubblewrap\"", "")
        ))
        .unwrap_or_else(|e| panic!("{key} with per-session storage: {e}"));
    }
    section_error("[retention]\nreset = \"retain\"", "session_runtime.retention");
    // terminate_grace means the same in both modes.
    let config = SessionRuntimeConfig::from_toml_section("[local]\nterminate_grace = \"3s\"").unwrap();
    assert_eq!(config.local.effective_terminate_grace(), Duration::from_secs(3));
}

#[test]
fn bad_durations_name_the_key() {
    for bad in ["soon", "", "-5m", "5", "30 minutes please"] {
        let reason = section_error(&format!("idle_ttl = \"{bad}\""), "session_runtime.idle_ttl");
        assert!(reason.contains("expected a duration"), "{reason}");
        let reason = section_error(
            &format!("[local]\nstorage = \"per-session\"\n[retention]\nretain_for = \"{bad}\""),
            "session_runtime.retention.retain_for",
        );
        assert!(reason.contains("expected a duration"), "{reason}");
        document_error(
            &format!("[session_runtime.local]\nstorage = \"per-session\"\nterminate_grace = \"{bad}\""),
            "session_runtime.local.terminate_grace",
        );
        document_error(
            &format!("[session_runtime.kubernetes]\nstart_timeout = \"{bad}\""),
            "session_runtime.kubernetes.start_timeout",
        );
    }
    let reason = document_error(
        "[session_runtime]\nidle_ttl = \"soon\"\n",
        "session_runtime.idle_ttl",
    );
    assert!(reason.contains("\"soon\""), "{reason}");
    assert!(reason.contains("line 2"), "{reason}");
}

#[test]
fn wrong_types_name_the_key() {
    section_error("idle_ttl = 5", "session_runtime.idle_ttl");
    section_error("installation = 7", "session_runtime.installation");
    section_error("type = true", "session_runtime.type");
    section_error("local = \"yes\"", "session_runtime.local");
    section_error(
        "[local]\nstorage = \"per-session\"\nroot = 5",
        "session_runtime.local.root",
    );
    section_error(
        "[local]\nstorage = \"per-session\"\nreadonly = \"/a:/b\"",
        "session_runtime.local.readonly",
    );
    section_error(
        "[local]\nstorage = \"per-session\"\n[local.limits]\npids = -1",
        "session_runtime.local.limits.pids",
    );
    section_error(
        "[local]\nstorage = \"per-session\"\n[local.limits]\ncpu = \"lots\"",
        "session_runtime.local.limits.cpu",
    );
    section_error(
        "[local]\nstorage = \"per-session\"\n[retention]\nreset = 1",
        "session_runtime.retention.reset",
    );
    document_error("session_runtime = 3", "session_runtime");
}

#[test]
fn unknown_keys_name_the_full_path() {
    let reason = section_error("idle_tll = \"30m\"", "session_runtime.idle_tll");
    assert!(
        reason.contains("idle_ttl"),
        "the accepted keys are listed: {reason}"
    );
    section_error(
        "[local]\nstorage = \"per-session\"\nsandbx = \"auto\"",
        "session_runtime.local.sandbx",
    );
    section_error(
        "[local]\nstorage = \"per-session\"\n[local.limits]\nswap = \"1Gi\"",
        "session_runtime.local.limits.swap",
    );
    section_error(
        "[local]\nstorage = \"per-session\"\n[retention]\nsuspended = \"retain\"",
        "session_runtime.retention.suspended",
    );
    section_error(
        "type = \"kubernetes\"\n[kubernetes]\nnamespace = \"a\"\nprofile = \"b\"\nimage = \"evil\"",
        "session_runtime.kubernetes.image",
    );
    section_error(
        "[agentcore]\nruntime_arn = \"x\"\naccess_key_id = \"y\"",
        "session_runtime.agentcore.access_key_id",
    );
    section_error("[docker]\nimage = \"x\"", "session_runtime.docker");

    let reason = document_error(
        "[session_runtime]\ntype = \"local\"\nsandbox = \"none\"\n",
        "session_runtime.sandbox",
    );
    assert!(reason.contains("line 3"), "{reason}");
    let reason = document_error(
        "[session_runtime.local]\nstorage = \"per-session\"\nsandbx = \"auto\"\n",
        "session_runtime.local.sandbx",
    );
    assert!(
        reason.contains("sandbox"),
        "the accepted keys are listed: {reason}"
    );
}

#[test]
fn agent_stderr_defaults_keep_each_modes_behaviour() {
    let shared = SessionRuntimeConfig::from_toml_section("").unwrap();
    assert_eq!(shared.local.agent_stderr, None);
    assert_eq!(shared.local.effective_agent_stderr(), AgentStderr::Discard);
    let per_session = SessionRuntimeConfig::from_toml_section("[local]\nstorage = \"per-session\"").unwrap();
    assert_eq!(per_session.local.agent_stderr, None);
    assert_eq!(per_session.local.effective_agent_stderr(), AgentStderr::Warn);
    assert_eq!(AgentStderr::Discard.level(), None);
    assert_eq!(AgentStderr::Warn.level(), Some(tracing::Level::WARN));
}

#[test]
fn agent_stderr_parses_every_value_in_both_storage_modes() {
    for storage in ["shared", "per-session"] {
        for value in AgentStderr::ALL {
            let section = format!("[local]\nstorage = \"{storage}\"\nagent_stderr = \"{value}\"");
            let config = SessionRuntimeConfig::from_toml_section(&section).unwrap();
            assert_eq!(config.local.agent_stderr, Some(value), "{section}");
            assert_eq!(config.local.effective_agent_stderr(), value, "{section}");
            let document =
                format!("[session_runtime.local]\nstorage = \"{storage}\"\nagent_stderr = \"{value}\"");
            assert_eq!(
                SessionRuntimeConfig::from_toml_document(&document).unwrap(),
                config,
                "{document}"
            );
        }
    }
    assert_eq!(
        AgentStderr::ALL.map(|v| v.as_str()),
        ["discard", "error", "warn", "info", "debug", "trace"]
    );
}

#[test]
fn a_bad_agent_stderr_value_names_the_key_and_lists_the_valid_ones() {
    for bad in ["\"warning\"", "\"WARN\"", "\"\"", "\"off\"", "3", "true"] {
        let reason = section_error(
            &format!("[local]\nagent_stderr = {bad}"),
            "session_runtime.local.agent_stderr",
        );
        if bad.starts_with('"') {
            for valid in AgentStderr::ALL {
                assert!(reason.contains(valid.as_str()), "{bad}: {reason}");
            }
        }
        document_error(
            &format!("[session_runtime.local]\nstorage = \"per-session\"\nagent_stderr = {bad}"),
            "session_runtime.local.agent_stderr",
        );
    }
}

#[test]
fn unknown_runtime_type_lists_the_valid_ones() {
    let reason = section_error("type = \"docker\"", "session_runtime.type");
    for valid in ["local", "kubernetes", "agentcore"] {
        assert!(reason.contains(valid), "{reason}");
    }
    document_error("[session_runtime]\ntype = \"Local\"", "session_runtime.type");
}

#[test]
fn every_runtime_type_parses() {
    for kind in RuntimeKind::ALL {
        let section = format!(
            "type = \"{kind}\"\n[kubernetes]\nnamespace = \"a\"\nprofile = \"b\"\n[agentcore]\n\
             runtime_arn = \"arn:aws:bedrock-agentcore:eu-west-1:123456789012:runtime/x\"\n"
        );
        assert_eq!(
            SessionRuntimeConfig::from_toml_section(&section).unwrap().runtime,
            kind
        );
        assert_eq!(kind.to_string(), kind.as_str());
    }
}

#[test]
fn bad_enum_values_name_the_key() {
    let reason = section_error(
        "[local]\nstorage = \"per-session\"\nsandbox = \"firejail\"",
        "session_runtime.local.sandbox",
    );
    for valid in ["auto", "bubblewrap", "landlock", "none"] {
        assert!(reason.contains(valid), "{reason}");
    }
    section_error(
        "[local]\nstorage = \"per-session\"\nnetwork = \"bridge\"",
        "session_runtime.local.network",
    );
    section_error(
        "[kubernetes]\nnamespace = \"a\"\nprofile = \"b\"\nreach = \"port-forward\"",
        "session_runtime.kubernetes.reach",
    );
    section_error(
        "[local]\nstorage = \"per-session\"\n[retention]\nended = \"archive\"",
        "session_runtime.retention.ended",
    );
}

#[test]
fn every_sandbox_and_network_value_parses() {
    for (text, mode) in [
        ("auto", SandboxMode::Auto),
        ("bubblewrap", SandboxMode::Bubblewrap),
        ("landlock", SandboxMode::Landlock),
        ("none", SandboxMode::None),
    ] {
        let config = SessionRuntimeConfig::from_toml_section(&format!(
            "[local]\nstorage = \"per-session\"\nsandbox = \"{text}\""
        ))
        .unwrap();
        assert_eq!(config.local.sandbox, mode);
        assert_eq!(mode.as_str(), text);
    }
    let config = SessionRuntimeConfig::from_toml_section(
        "[local]\nstorage = \"per-session\"\nsandbox = \"auto\"\nnetwork = \"none\"",
    )
    .unwrap();
    assert_eq!(config.local.network, Some(NetworkMode::None));
}

#[test]
fn readonly_mounts_must_be_two_absolute_paths() {
    let reason = section_error(
        "[local]\nstorage = \"per-session\"\nreadonly = [\"skills:/skills\"]",
        "session_runtime.local.readonly",
    );
    assert!(reason.contains("not absolute"), "{reason}");
    let reason = section_error(
        "[local]\nstorage = \"per-session\"\nreadonly = [\"/a:/a\", \"/opt/skills:skills\"]",
        "session_runtime.local.readonly",
    );
    assert!(reason.contains("entry 2"), "{reason}");
    for bad in [
        "/opt/skills",
        "/a:/b:rw",
        "/a:/b:ro",
        "",
        "/a:",
        ":/b",
        "/a/../etc:/b",
        "/a:/",
        "/a:/b/./c",
    ] {
        section_error(
            &format!("[local]\nstorage = \"per-session\"\nreadonly = [\"{bad}\"]"),
            "session_runtime.local.readonly",
        );
    }
    section_error(
        "[local]\nstorage = \"per-session\"\nreadonly = [\"/a:/x\", \"/b:/x\"]",
        "session_runtime.local.readonly",
    );
    section_error(
        "[local]\nstorage = \"per-session\"\nsandbox = \"none\"\nreadonly = [\"/a:/x\"]",
        "session_runtime.local.readonly",
    );

    let (key, _) = match ReadonlyMount::new("relative", "/x") {
        Err(Error::InvalidConfig { key, reason }) => (key, reason),
        other => panic!("{other:?}"),
    };
    assert_eq!(key, "session_runtime.local.readonly");
    let mount = ReadonlyMount::new("/opt/openab/skills", "/skills").unwrap();
    assert_eq!(mount.to_string(), "/opt/openab/skills:/skills");
}

#[test]
fn local_paths_must_be_absolute() {
    section_error(
        "[local]\nstorage = \"per-session\"\nroot = \"sessions\"",
        "session_runtime.local.root",
    );
    section_error(
        "[local]\nstorage = \"per-session\"\nhome_template = \"./home\"",
        "session_runtime.local.home_template",
    );
}

#[test]
fn network_none_needs_a_sandbox() {
    section_error(
        "[local]\nstorage = \"per-session\"\nsandbox = \"none\"\nnetwork = \"none\"",
        "session_runtime.local.network",
    );
}

#[test]
fn missing_backend_table_names_it() {
    let reason = section_error("type = \"kubernetes\"", "session_runtime.kubernetes");
    assert!(reason.contains("[session_runtime.kubernetes]"), "{reason}");
    document_error(
        "[session_runtime]\ntype = \"agentcore\"\n",
        "session_runtime.agentcore",
    );
}

#[test]
fn kubernetes_required_keys_and_names() {
    section_error(
        "type = \"kubernetes\"\n[kubernetes]\nprofile = \"worker\"",
        "session_runtime.kubernetes.namespace",
    );
    section_error(
        "type = \"kubernetes\"\n[kubernetes]\nnamespace = \"ns\"",
        "session_runtime.kubernetes.profile",
    );
    section_error(
        "[kubernetes]\nnamespace = \"Open_AB\"\nprofile = \"worker\"",
        "session_runtime.kubernetes.namespace",
    );
    section_error(
        "[kubernetes]\nnamespace = \"ns\"\nprofile = \"Worker Profile\"",
        "session_runtime.kubernetes.profile",
    );
    section_error(
        "[kubernetes]\nnamespace = \"ns\"\nprofile = \"w\"\nstart_timeout = \"0s\"",
        "session_runtime.kubernetes.start_timeout",
    );
}

#[test]
fn agentcore_arn_region_and_qualifier_are_checked() {
    let reason = section_error(
        "type = \"agentcore\"\n[agentcore]\nruntime_arn = \"arn:aws:lambda:us-east-1:123456789012:function/x\"",
        "session_runtime.agentcore.runtime_arn",
    );
    assert!(reason.contains("bedrock-agentcore"), "{reason}");
    section_error(
        "type = \"agentcore\"\n[agentcore]\nregion = \"us-east-1\"",
        "session_runtime.agentcore.runtime_arn",
    );
    section_error(
        "[agentcore]\nruntime_arn = \"arn:aws:bedrock-agentcore:us-east-1:123456789012:runtime/x\"\nregion = \"eu-west-1\"",
        "session_runtime.agentcore.region",
    );
    section_error(
        "[agentcore]\nruntime_arn = \"arn:aws:bedrock-agentcore:us-east-1:123456789012:runtime/x\"\nqualifier = \"a b\"",
        "session_runtime.agentcore.qualifier",
    );
    let config = SessionRuntimeConfig::from_toml_section(
        "type = \"agentcore\"\n[agentcore]\n\
         runtime_arn = \"arn:aws:bedrock-agentcore:eu-west-1:123456789012:runtime/my_agent-AbC123\"\n\
         qualifier = \"prod\"",
    )
    .unwrap();
    let agentcore = config.agentcore.unwrap();
    assert_eq!(agentcore.effective_region(), Some("eu-west-1"));
    assert_eq!(agentcore.effective_qualifier(), "prod");
}

#[test]
fn bad_installation_names_the_key() {
    for bad in [
        "",
        "Prod",
        "prod_bot",
        "-prod",
        "prod-",
        "prod.bot",
        "a very long name",
        &"a".repeat(64),
    ] {
        section_error(
            &format!("installation = \"{bad}\""),
            "session_runtime.installation",
        );
    }
    for good in ["prod-bot", "a", "0", &"a".repeat(63)] {
        let config = SessionRuntimeConfig::from_toml_section(&format!("installation = \"{good}\"")).unwrap();
        assert_eq!(config.installation, good);
    }
}

#[test]
fn memory_sizes() {
    for (text, bytes) in [
        ("\"2Gi\"", 2u64 << 30),
        ("\"512Mi\"", 512 << 20),
        ("\"1G\"", 1_000_000_000),
        ("\"1.5Gi\"", 3 << 29),
        ("1048576", 1 << 20),
    ] {
        let config = SessionRuntimeConfig::from_toml_section(&format!(
            "[local]\nstorage = \"per-session\"\n[local.limits]\nmemory = {text}"
        ))
        .unwrap();
        assert_eq!(config.local.limits.unwrap().memory, Some(bytes), "{text}");
    }
    for bad in [
        "\"lots\"", "\"2GB\"", "\"-1Gi\"", "\"0\"", "0", "-5", "\"\"", "\"1 Gi\"", "true",
    ] {
        let reason = section_error(
            &format!("[local]\nstorage = \"per-session\"\n[local.limits]\nmemory = {bad}"),
            "session_runtime.local.limits.memory",
        );
        assert!(reason.contains("byte size"), "{bad}: {reason}");
    }
}

#[test]
fn limit_ranges_are_checked() {
    section_error(
        "[local]\nstorage = \"per-session\"\n[local.limits]\npids = 0",
        "session_runtime.local.limits.pids",
    );
    section_error(
        "[local]\nstorage = \"per-session\"\n[local.limits]\ncpu = 0",
        "session_runtime.local.limits.cpu",
    );
    section_error(
        "[local]\nstorage = \"per-session\"\n[local.limits]\ncpu = -1.0",
        "session_runtime.local.limits.cpu",
    );
    section_error(
        "[local]\nstorage = \"per-session\"\n[local.limits]\ncpu = nan",
        "session_runtime.local.limits.cpu",
    );
    let config = SessionRuntimeConfig::from_toml_section(
        "[local]\nstorage = \"per-session\"\n[local.limits]\ncpu = 2",
    )
    .unwrap();
    assert_eq!(config.local.limits.unwrap().cpu, Some(2.0));
    let config =
        SessionRuntimeConfig::from_toml_section("[local]\nstorage = \"per-session\"\n[local.limits]")
            .unwrap();
    assert_eq!(config.local.limits, Some(ResourceLimits::default()));
}

#[test]
fn syntax_errors_are_invalid_config_with_a_location() {
    let reason = section_error("type = \"local\"\nidle_ttl = ", "session_runtime");
    assert!(reason.contains("line 2"), "{reason}");
    let reason = document_error("[agent]\ncommand = \"x\"\n[session_runtime\n", "session_runtime");
    assert!(reason.contains("line 3"), "{reason}");
    document_error(
        "[session_runtime]\ntype = \"local\"\ntype = \"local\"\n",
        "session_runtime",
    );
}

#[test]
fn validate_checks_programmatic_configs() {
    let mut config = SessionRuntimeConfig::default();
    config.runtime = RuntimeKind::Kubernetes;
    let (key, _) = invalid_config(config.validate().map(|()| SessionRuntimeConfig::default()));
    assert_eq!(key, "session_runtime.kubernetes");
    config.kubernetes = Some(KubernetesConfig::new("ns", "worker"));
    config.validate().unwrap();
    config.agentcore = Some(AgentCoreConfig::new("nonsense"));
    let (key, _) = invalid_config(config.validate().map(|()| SessionRuntimeConfig::default()));
    assert_eq!(key, "session_runtime.agentcore.runtime_arn");
}

#[test]
fn serialization_round_trips() {
    let mut full = SessionRuntimeConfig::from_toml_document(DESIGN_EXAMPLE).unwrap();
    full.idle_ttl = None;
    full.retention.expired = Retention::Retain;
    let mut limits = ResourceLimits::default();
    limits.memory = Some(3 << 29);
    limits.pids = Some(64);
    limits.cpu = Some(0.5);
    full.local.limits = Some(limits);
    full.local.home_template = Some("/etc/openab/home".into());
    full.local.terminate_grace = Some(Duration::from_millis(1500));
    for config in [SessionRuntimeConfig::default(), full] {
        let text = toml::to_string(&config).unwrap();
        assert_eq!(
            SessionRuntimeConfig::from_toml_section(&text).unwrap(),
            config,
            "{text}"
        );
    }
}

#[test]
fn every_grace_and_timeout_is_bounded() {
    let kubernetes = "[kubernetes]\nnamespace = \"s\"\nprofile = \"p\"\n";
    for (section, key, max) in [
        (
            "idle_ttl = \"{}\"".to_owned(),
            "session_runtime.idle_ttl",
            SessionRuntimeConfig::MAX_IDLE_TTL,
        ),
        (
            "[local]\nstorage = \"per-session\"\n[retention]\nretain_for = \"{}\"".to_owned(),
            "session_runtime.retention.retain_for",
            RetentionPolicy::MAX_RETAIN_FOR,
        ),
        (
            "[local]\nstorage = \"per-session\"\nterminate_grace = \"{}\"".to_owned(),
            "session_runtime.local.terminate_grace",
            session_runtime::config::LocalConfig::MAX_TERMINATE_GRACE,
        ),
        (
            format!("{kubernetes}start_timeout = \"{{}}\""),
            "session_runtime.kubernetes.start_timeout",
            KubernetesConfig::MAX_START_TIMEOUT,
        ),
    ] {
        let at_max = section.replace("{}", &format!("{}s", max.as_secs()));
        SessionRuntimeConfig::from_toml_section(&at_max)
            .unwrap_or_else(|e| panic!("{key} at its maximum: {e}"));
        for over in [format!("{}s", max.as_secs() + 1), "100000000y".to_owned()] {
            let reason = section_error(&section.replace("{}", &over), key);
            assert!(reason.contains("longer than the most allowed"), "{key}: {reason}");
        }
    }
}

#[test]
fn limits_the_kernel_cannot_represent_are_refused() {
    for (body, key) in [
        ("cpu = 1e308", "session_runtime.local.limits.cpu"),
        ("cpu = 0.001", "session_runtime.local.limits.cpu"),
        ("cpu = 175921861.0", "session_runtime.local.limits.cpu"),
        ("pids = 4194305", "session_runtime.local.limits.pids"),
        // 2^63 bytes: one above i64::MAX, which cgroups would read as "unlimited".
        ("memory = \"8192Pi\"", "session_runtime.local.limits.memory"),
        ("memory = 1", "session_runtime.local.limits.memory"),
    ] {
        let reason = section_error(
            &format!("[local]\nstorage = \"per-session\"\n[local.limits]\n{body}"),
            key,
        );
        assert!(reason.contains("must be"), "{body}: {reason}");
    }
    for body in [
        "cpu = 0.01",
        "cpu = 175921860.0",
        "pids = 4194304",
        "memory = \"8Ei\"",
    ] {
        let section = format!("[local]\nstorage = \"per-session\"\n[local.limits]\n{body}");
        if let Err(error) = SessionRuntimeConfig::from_toml_section(&section) {
            // "8Ei" is one byte above i64::MAX: refused as well, for the same reason.
            assert!(body.contains("8Ei"), "{body}: {error}");
        }
    }
}

#[test]
fn allowlist_network_takes_egress_destinations() {
    let config = SessionRuntimeConfig::from_toml_section(
        "[local]\nstorage = \"per-session\"\nsandbox = \"auto\"\nnetwork = \"allowlist\"\negress = [\"API.Example.com:443\", \"127.0.0.1:8080\", \"[::1]:9000\", \"localhost:81\"]",
    )
    .unwrap();
    assert_eq!(config.local.network, Some(NetworkMode::Allowlist));
    assert_eq!(NetworkMode::Allowlist.as_str(), "allowlist");
    let egress = &config.local.egress;
    assert_eq!(egress.len(), 4);
    assert_eq!(egress[0].to_string(), "api.example.com:443");
    assert!(!egress[0].is_loopback());
    assert!(egress[0].matches("api.EXAMPLE.com", 443));
    // One spelling per destination: the fully qualified name is not a second way in.
    assert!(!egress[0].matches("api.example.com.", 443));
    assert!(!egress[0].matches("api.example.com", 80));
    assert!(!egress[0].matches("evil-api.example.com", 443));
    assert!(egress[1].is_loopback());
    assert!(egress[1].matches("127.0.0.1", 8080));
    assert!(!egress[1].matches("localhost", 8080), "a name is not an address");
    assert_eq!(egress[2].to_string(), "[::1]:9000");
    assert!(egress[2].matches("[::1]", 9000));
    assert!(egress[3].is_loopback());
    assert_eq!(egress[3].loopback_ip(), Some("127.0.0.1".parse().unwrap()));
    // It reads back what it writes.
    let written = toml::to_string(&config).unwrap();
    assert!(written.contains("\"[::1]:9000\""), "{written}");
}

#[test]
fn bad_egress_entries_name_the_key() {
    for (bad, says) in [
        ("api.example.com", "no `:PORT`"),
        ("api.example.com:0", "port"),
        ("api.example.com:70000", "port"),
        ("api.example.com:https", "port"),
        ("*.example.com:443", "wildcards"),
        ("exa mple.com:443", "DNS label"),
        ("::1:443", "brackets"),
        ("[::g]:443", "IPv6"),
        ("300.1.1.1:443", "IPv4"),
        (":443", "empty"),
        // One spelling per destination: what a resolver or port parser would also accept is
        // refused, not read as the same destination.
        ("vm.:18084", "trailing dot"),
        ("vm:018084", "leading zero"),
        ("vm:+18084", "sign"),
        ("vm:-1", "sign"),
        // A URL is refused as a URL, not as a malformed IPv6 address.
        ("http://a.com:443", "URL"),
        ("https://a.com", "URL"),
        ("a.com:443/v1", "path"),
    ] {
        let reason = section_error(
            &format!("[local]\nstorage = \"per-session\"\nsandbox = \"auto\"\nnetwork = \"allowlist\"\negress = [{bad:?}]"),
            "session_runtime.local.egress",
        );
        assert!(reason.contains(says), "{bad}: {reason}");
    }
    assert!(session_runtime::config::EgressTarget::parse("x").is_err());
}

#[test]
fn egress_needs_the_allowlist_mode_and_a_sandbox() {
    let reason = section_error(
        "[local]\nstorage = \"per-session\"\negress = [\"api.example.com:443\"]",
        "session_runtime.local.egress",
    );
    assert!(reason.contains("network = \"allowlist\""), "{reason}");
    section_error(
        "[local]\nstorage = \"per-session\"\nsandbox = \"auto\"\nnetwork = \"none\"\negress = [\"api.example.com:443\"]",
        "session_runtime.local.egress",
    );
    let reason = section_error(
        "[local]\nstorage = \"per-session\"\nsandbox = \"none\"\nnetwork = \"allowlist\"",
        "session_runtime.local.network",
    );
    assert!(reason.contains("needs a sandbox"), "{reason}");
    let reason = section_error(
        "[local]\nstorage = \"per-session\"\nsandbox = \"auto\"\nnetwork = \"allowlist\"\negress = [\"a.example:1\", \"A.example:1\"]",
        "session_runtime.local.egress",
    );
    assert!(reason.contains("entries 1 and 2"), "{reason}");
}

#[test]
fn sandboxed_sessions_get_a_network_of_their_own_unless_host_is_chosen() {
    let parse = |body: &str| SessionRuntimeConfig::from_toml_section(body).unwrap().local;
    // Unset: sandboxed sessions share no loopback and no abstract socket ...
    let local = parse("[local]\nstorage = \"per-session\"\nsandbox = \"auto\"");
    assert_eq!(local.effective_network(), NetworkMode::None);
    // ... and one setting, `egress`, reaches a model through the session's proxy.
    let local =
        parse("[local]\nstorage = \"per-session\"\nsandbox = \"auto\"\negress = [\"api.example.com:443\"]");
    assert_eq!(local.network, None);
    assert_eq!(local.effective_network(), NetworkMode::Allowlist);
    // `host` stays an explicit choice.
    let local = parse("[local]\nstorage = \"per-session\"\nsandbox = \"bubblewrap\"\nnetwork = \"host\"");
    assert_eq!(local.effective_network(), NetworkMode::Host);
    // Without a sandbox a session has the host's network, the only one a plain process has.
    let local = parse("[local]\nstorage = \"per-session\"");
    assert_eq!(local.effective_network(), NetworkMode::Host);
    let reason = section_error(
        "[local]\nstorage = \"per-session\"\nsandbox = \"auto\"\nnetwork = \"host\"\negress = [\"api.example.com:443\"]",
        "session_runtime.local.egress",
    );
    assert!(reason.contains("network = \"host\""), "{reason}");
}
