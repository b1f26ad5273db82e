//! The working-directory rule of `oab-runtime run`: the `cwd` of ACP `session/new` and
//! `session/load` requests is replaced with the session's own working directory.
//!
//! A client outside the session cannot know where the session's workspace is as the agent sees
//! it (`/workspace` under bubblewrap, a host path under the runtime's root otherwise), and an agent
//! given a host path of the client's fails. Only those two requests are touched: every other line,
//! JSON or not, passes byte for byte.

use serde_json::Value;

/// The ACP requests whose `cwd` names the session's working directory.
const METHODS_WITH_CWD: [&str; 2] = ["session/new", "session/load"];

/// Rewrites the `cwd` of `session/new` and `session/load` requests to one working directory.
#[derive(Debug)]
pub(crate) struct CwdRewrite {
    working_dir: String,
    announced: bool,
}

impl CwdRewrite {
    /// A rewrite to `working_dir` (the attachment's [`working_dir`]).
    ///
    /// [`working_dir`]: openab_runtime::Attachment::working_dir
    pub(crate) fn new(working_dir: impl Into<String>) -> Self {
        Self {
            working_dir: working_dir.into(),
            announced: false,
        }
    }

    /// The line to send instead of `line` (one JSON-RPC message with its line ending), or `None`
    /// to send `line` unchanged: it is not a JSON object, not a `session/new` or `session/load`
    /// request, has no `params` object, or already names the working directory. The first
    /// rewrite is said on stderr.
    pub(crate) fn apply(&mut self, line: &[u8]) -> Option<Vec<u8>> {
        let body_len = line.len() - line_ending(line).len();
        let mut message: Value = serde_json::from_slice(&line[..body_len]).ok()?;
        let method = message.get("method")?.as_str()?;
        if !METHODS_WITH_CWD.contains(&method) {
            return None;
        }
        let method = method.to_owned();
        let params = message.get_mut("params")?.as_object_mut()?;
        if params.get("cwd").and_then(Value::as_str) == Some(self.working_dir.as_str()) {
            return None;
        }
        let sent = params.insert("cwd".to_owned(), Value::String(self.working_dir.clone()));
        if !self.announced {
            self.announced = true;
            let sent = sent.map_or_else(|| "no cwd".to_owned(), |cwd| format!("cwd {cwd}"));
            eprintln!(
                "oab-runtime: {method}: {sent} replaced with the session's working directory {:?}, \
                 as in every later session/new and session/load (said once; --keep-cwd sends them \
                 unchanged)",
                self.working_dir
            );
        }
        // Serializing a `Value` cannot fail: its keys are strings.
        let mut rewritten = serde_json::to_vec(&message).ok()?;
        rewritten.extend_from_slice(line_ending(line));
        Some(rewritten)
    }
}

/// The line ending of `line`: `\r\n`, `\n`, or nothing (a last line without one).
fn line_ending(line: &[u8]) -> &[u8] {
    if line.ends_with(b"\r\n") {
        &line[line.len() - 2..]
    } else if line.ends_with(b"\n") {
        &line[line.len() - 1..]
    } else {
        &[]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rewritten(line: &[u8]) -> Option<Value> {
        let out = CwdRewrite::new("/workspace").apply(line)?;
        assert!(out.ends_with(b"\r\n"), "the line ending is kept");
        Some(serde_json::from_slice(&out).expect("JSON"))
    }

    #[test]
    fn new_and_load_get_the_session_working_directory() {
        for method in ["session/new", "session/load"] {
            let line = format!(
                r#"{{"jsonrpc":"2.0","id":7,"method":"{method}","params":{{"sessionId":"s","cwd":"/home/me/src","mcpServers":[]}}}}"#
            ) + "\r\n";
            let got = rewritten(line.as_bytes()).expect("rewritten");
            assert_eq!(got["params"]["cwd"], "/workspace", "{method}");
            assert_eq!(got["params"]["sessionId"], "s");
            assert_eq!(got["id"], 7);
            assert_eq!(got["method"], method);
        }
        // No cwd at all, and a last line without a line ending: the cwd is added, no ending.
        let out = CwdRewrite::new("/workspace")
            .apply(br#"{"id":1,"method":"session/new","params":{"mcpServers":[]}}"#)
            .expect("rewritten");
        let got: Value = serde_json::from_slice(&out).expect("JSON");
        assert_eq!(got["params"]["cwd"], "/workspace");
        assert!(!out.ends_with(b"\n"));
    }

    #[test]
    fn everything_else_is_left_alone() {
        for line in [
            &b"not json\n"[..],
            b"{\"id\":1,\"method\":\"session/prompt\",\"params\":{\"cwd\":\"/x\"}}\n",
            b"{\"id\":1,\"result\":{\"cwd\":\"/x\"}}\n",
            b"{\"id\":1,\"method\":\"session/new\",\"params\":[\"/x\"]}\n",
            b"{\"id\":1,\"method\":\"session/new\",\"params\":{\"cwd\":\"/workspace\"}}\n",
            b"[{\"method\":\"session/new\",\"params\":{\"cwd\":\"/x\"}}]\n",
            b"{\"method\":\"session/new\",\"params\":{\"cwd\":\"\xff\"}}\n",
        ] {
            assert_eq!(
                CwdRewrite::new("/workspace").apply(line),
                None,
                "{}",
                String::from_utf8_lossy(line)
            );
        }
    }
}
