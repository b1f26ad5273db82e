//! Running shell commands inside a session's worker, through the ACP test agent's exec probe.

use std::time::Duration;

use serde_json::{json, Value};
use session_runtime::testing::{AcpClient, EXEC_METHOD};
use session_runtime::SessionId;

use crate::options::MAX_COMMAND_TIME;
use crate::{Errno, Side};

/// Quotes `text` as one word for `/bin/sh`: in single quotes, with each `'` written as `'\''`.
pub(crate) fn quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// Joins an absolute directory and a file name.
pub(crate) fn join(dir: &str, name: &str) -> String {
    format!("{}/{name}", dir.trim_end_matches('/'))
}

/// What a command did.
#[derive(Debug, Clone, Default)]
pub(crate) struct Output {
    pub(crate) exit_code: Option<i32>,
    pub(crate) signal: Option<i32>,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
    pub(crate) timed_out: bool,
}

impl Output {
    pub(crate) fn success(&self) -> bool {
        self.exit_code == Some(0)
    }

    pub(crate) fn errno(&self) -> Option<Errno> {
        Errno::from_stderr(&self.stderr)
    }

    /// Why the command did not complete normally, if it did not.
    pub(crate) fn abnormal(&self) -> Option<String> {
        if self.timed_out {
            return Some("the command did not finish in time and was killed".to_owned());
        }
        if let Some(signal) = self.signal {
            return Some(format!("the command was killed by signal {signal}"));
        }
        let detail = match first_line(&self.stderr) {
            "" => String::new(),
            line => format!(": {line}"),
        };
        match self.exit_code {
            Some(126) => Some(format!("the command could not be executed{detail}")),
            Some(127) => Some(format!("a program is missing in the worker{detail}")),
            None => Some("the command reported no exit code".to_owned()),
            Some(_) => None,
        }
    }

    /// A one-line account of a failed command for an inconclusive verdict.
    pub(crate) fn describe(&self) -> String {
        if let Some(abnormal) = self.abnormal() {
            return abnormal;
        }
        let code = self
            .exit_code
            .map_or_else(|| "none".to_owned(), |c| c.to_string());
        match first_line(&self.stderr) {
            "" => format!("exit {code} without an error message"),
            line => format!("exit {code}: {line}"),
        }
    }
}

/// The first non-empty line of `text`, trimmed, at most 200 characters.
pub(crate) fn first_line(text: &str) -> &str {
    let line = text.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("");
    match line.char_indices().nth(200) {
        Some((cut, _)) => &line[..cut],
        None => line,
    }
}

/// One attached session: its ACP client and what the suite knows about it.
#[derive(Debug)]
pub(crate) struct Worker {
    pub(crate) side: Side,
    pub(crate) id: SessionId,
    pub(crate) client: AcpClient,
}

impl Worker {
    /// Runs `command` with `/bin/sh -c` in this session's worker, killed after `limit` (at most
    /// 25 s). `Err` when the exec request itself failed (the agent did not answer, the stream was
    /// fenced, ...).
    pub(crate) async fn sh(&self, command: &str, limit: Duration) -> Result<Output, String> {
        let limit = limit.min(MAX_COMMAND_TIME);
        let millis = u64::try_from(limit.as_millis()).unwrap_or(u64::MAX);
        let params = json!({ "command": command, "timeout_ms": millis });
        let value = self
            .client
            .request(EXEC_METHOD, params)
            .await
            .map_err(|e| format!("the exec request to session {} failed: {e}", self.side))?;
        let int = |key: &str| {
            value
                .get(key)
                .and_then(Value::as_i64)
                .and_then(|v| i32::try_from(v).ok())
        };
        let text = |key: &str| value.get(key).and_then(Value::as_str).unwrap_or("").to_owned();
        Ok(Output {
            exit_code: int("exitCode"),
            signal: int("signal"),
            stdout: text("stdout"),
            stderr: text("stderr"),
            timed_out: value.get("timedOut").and_then(Value::as_bool).unwrap_or(false),
        })
    }
}

/// The ACP test agent's listen probe (`acp_test_agent::LISTEN_METHOD`).
pub(crate) const LISTEN_METHOD: &str = "_openab/listen";
/// The ACP test agent's connect probe (`acp_test_agent::CONNECT_METHOD`).
pub(crate) const CONNECT_METHOD: &str = "_openab/connect";

/// A channel between processes that the network namespace decides: what the step 8 probes
/// listen on and connect to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Channel {
    /// An abstract UNIX socket (`@name`): no file, visible to the whole network namespace.
    Abstract,
    /// A TCP port on `127.0.0.1`.
    Loopback,
}

impl Channel {
    /// The `kind` of the agent's probes.
    pub(crate) fn kind(self) -> &'static str {
        match self {
            Channel::Abstract => "abstract",
            Channel::Loopback => "tcp",
        }
    }

    /// How the address is written in reports: `@name`, or `IP:PORT`.
    pub(crate) fn display(self, address: &str) -> String {
        match self {
            Channel::Abstract => format!("@{address}"),
            Channel::Loopback => address.to_owned(),
        }
    }
}

/// What a connect probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Connected {
    /// Connected, and the other end sent this.
    Received(String),
    /// Refused, with the error and its errno when the kernel gave one.
    Refused { error: String, errno: Option<i32> },
}

impl Worker {
    /// Listens on `channel` at `address` (`127.0.0.1:0` for a free loopback port) from inside
    /// this session's worker, answering each connection with `reply` until the worker ends.
    /// Returns the bound address.
    pub(crate) async fn listen(
        &self,
        channel: Channel,
        address: &str,
        reply: &str,
    ) -> Result<String, String> {
        let params = json!({ "kind": channel.kind(), "address": address, "reply": reply });
        let value = self
            .client
            .request(LISTEN_METHOD, params)
            .await
            .map_err(|e| format!("the listen request to session {} failed: {e}", self.side))?;
        value
            .get("address")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| {
                format!(
                    "the listen request to session {} returned no address: {value}",
                    self.side
                )
            })
    }

    /// Connects to `channel` at `address` from inside this session's worker and reads what the
    /// other end sends, within `limit`. `Err` when the request itself failed.
    pub(crate) async fn connect(
        &self,
        channel: Channel,
        address: &str,
        limit: Duration,
    ) -> Result<Connected, String> {
        let millis = u64::try_from(limit.min(MAX_COMMAND_TIME).as_millis()).unwrap_or(u64::MAX);
        let params = json!({ "kind": channel.kind(), "address": address, "timeout_ms": millis });
        let value = self
            .client
            .request(CONNECT_METHOD, params)
            .await
            .map_err(|e| format!("the connect request to session {} failed: {e}", self.side))?;
        let text = |key: &str| value.get(key).and_then(Value::as_str).unwrap_or("").to_owned();
        match value.get("connected").and_then(Value::as_bool) {
            Some(true) => Ok(Connected::Received(text("received"))),
            Some(false) => Ok(Connected::Refused {
                error: text("error"),
                errno: value
                    .get("errno")
                    .and_then(Value::as_i64)
                    .and_then(|v| i32::try_from(v).ok()),
            }),
            None => Err(format!(
                "the connect request to session {} returned {value}",
                self.side
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quote_survives_single_quotes() {
        assert_eq!(quote("/a b/c"), "'/a b/c'");
        assert_eq!(quote("it's"), r"'it'\''s'");
    }

    #[test]
    fn join_handles_trailing_slash() {
        assert_eq!(join("/work/", "x"), "/work/x");
        assert_eq!(join("/", "x"), "/x");
    }

    #[test]
    fn first_line_skips_blank_lines() {
        assert_eq!(first_line("\n  \n second \nthird"), "second");
        assert_eq!(first_line(""), "");
        assert_eq!(first_line(&"é".repeat(300)).chars().count(), 200);
    }
}
