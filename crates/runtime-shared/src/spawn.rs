//! The agent's command line, working directory and environment, as upstream's
//! `AcpConnection::spawn` builds them.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Stdio;

use session_runtime::AgentCommand;

/// `PATH` when the broker has none: upstream's fallback, on every platform.
pub(crate) const FALLBACK_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// The user name when the broker has none: upstream's fallback.
pub(crate) const FALLBACK_USER: &str = "agent";

/// The agent's whole environment: upstream clears the broker's, so nothing else reaches the agent
/// (not the chat platform's bot token, not a cloud credential).
///
/// Order, each step winning over the one before: the baseline (HOME, PATH, USER, and Windows'
/// own variables), then `agent.env` verbatim, then each `agent.inherit_env` name that
/// `agent.env` does not set and `broker` has. `broker` reads the broker's environment; it is a
/// parameter so that tests need not change the process's own.
pub(crate) fn environment(
    agent: &AgentCommand,
    working_dir: &Path,
    broker: impl Fn(&str) -> Option<String>,
) -> BTreeMap<String, String> {
    let working_dir = working_dir.to_string_lossy().into_owned();
    let mut env = BTreeMap::new();
    // HOME is the broker's own: agents find their logins (~/.codex, ~/.claude, ~/.config/gh) there.
    env.insert(
        "HOME".to_owned(),
        broker("HOME").unwrap_or_else(|| working_dir.clone()),
    );
    env.insert(
        "PATH".to_owned(),
        broker("PATH").unwrap_or_else(|| FALLBACK_PATH.to_owned()),
    );
    if cfg!(unix) {
        env.insert(
            "USER".to_owned(),
            broker("USER").unwrap_or_else(|| FALLBACK_USER.to_owned()),
        );
    }
    if cfg!(windows) {
        // USERPROFILE is Windows' HOME; SystemRoot is needed to load system libraries at all.
        env.insert(
            "USERPROFILE".to_owned(),
            broker("USERPROFILE").unwrap_or_else(|| working_dir.clone()),
        );
        env.insert(
            "USERNAME".to_owned(),
            broker("USERNAME").unwrap_or_else(|| FALLBACK_USER.to_owned()),
        );
        for key in ["SystemRoot", "SystemDrive"] {
            if let Some(value) = broker(key) {
                env.insert(key.to_owned(), value);
            }
        }
    }
    env.extend(agent.env.iter().map(|(key, value)| (key.clone(), value.clone())));
    for key in &agent.inherit_env {
        if agent.env.contains_key(key) {
            continue;
        }
        if let Some(value) = broker(key) {
            env.insert(key.clone(), value);
        }
    }
    env
}

/// The broker's variable `key`, as upstream reads it (`std::env::var`: a value that is not UTF-8
/// counts as unset).
pub(crate) fn broker_env(key: &str) -> Option<String> {
    std::env::var(key).ok()
}

/// The command that starts the agent: piped stdin and stdout, stderr piped only when it is
/// logged, the working directory, the environment, and a process group of its own.
pub(crate) fn command(
    agent: &AgentCommand,
    working_dir: &Path,
    env: &BTreeMap<String, String>,
    pipe_stderr: bool,
) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(&agent.program);
    command
        .args(&agent.args)
        .current_dir(working_dir)
        .env_clear()
        .envs(env)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(if pipe_stderr {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        // Upstream does not kill on drop either; stopping is explicit (or the runtime's Drop).
        .kill_on_drop(false);
    // Its own group, so that stopping the agent stops what it started, and a signal meant for
    // the broker's group (a Ctrl-C in a terminal) does not reach the agent.
    #[cfg(unix)]
    command.process_group(0);
    #[cfg(windows)]
    command.creation_flags(CREATE_NEW_PROCESS_GROUP);
    command
}

/// Windows' `CREATE_NEW_PROCESS_GROUP` process creation flag.
#[cfg(windows)]
const CREATE_NEW_PROCESS_GROUP: u32 = 0x0000_0200;

#[cfg(test)]
mod tests {
    use super::*;

    fn broker(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: BTreeMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |key| vars.get(key).cloned()
    }

    #[test]
    fn the_broker_environment_is_cleared_but_for_the_baseline() {
        let agent = AgentCommand::new("agent");
        let env = environment(
            &agent,
            Path::new("/srv/work"),
            broker(&[
                ("HOME", "/home/bot"),
                ("PATH", "/opt/bin"),
                ("USER", "bot"),
                ("DISCORD_BOT_TOKEN", "secret"),
            ]),
        );
        assert_eq!(env.get("HOME").map(String::as_str), Some("/home/bot"));
        assert_eq!(env.get("PATH").map(String::as_str), Some("/opt/bin"));
        assert!(!env.contains_key("DISCORD_BOT_TOKEN"), "{env:?}");
        if cfg!(unix) {
            assert_eq!(env.get("USER").map(String::as_str), Some("bot"));
            assert_eq!(env.len(), 3, "{env:?}");
        }
    }

    #[test]
    fn the_baseline_falls_back_as_upstream_does() {
        let env = environment(&AgentCommand::new("agent"), Path::new("/srv/work"), broker(&[]));
        assert_eq!(env.get("HOME").map(String::as_str), Some("/srv/work"));
        assert_eq!(env.get("PATH").map(String::as_str), Some(FALLBACK_PATH));
        if cfg!(unix) {
            assert_eq!(env.get("USER").map(String::as_str), Some(FALLBACK_USER));
        }
    }

    #[test]
    fn explicit_env_wins_over_inherited_and_missing_inherited_names_are_skipped() {
        let agent = AgentCommand::new("agent")
            .env("API_KEY", "explicit")
            .env("PATH", "/agent/bin")
            .inherit_env("API_KEY")
            .inherit_env("REGION")
            .inherit_env("ABSENT");
        let env = environment(
            &agent,
            Path::new("/w"),
            broker(&[("API_KEY", "from-broker"), ("REGION", "eu"), ("PATH", "/usr/bin")]),
        );
        assert_eq!(env.get("API_KEY").map(String::as_str), Some("explicit"));
        assert_eq!(
            env.get("PATH").map(String::as_str),
            Some("/agent/bin"),
            "explicit env wins over the baseline"
        );
        assert_eq!(env.get("REGION").map(String::as_str), Some("eu"));
        assert!(!env.contains_key("ABSENT"));
    }
}
