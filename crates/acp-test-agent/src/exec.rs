//! The `_openab/exec` probe: run a shell command in the agent's own
//! environment and report what happened.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::process::Command;
use tokio::task::JoinHandle;

/// How long to keep collecting output after the shell exited (a background
/// grandchild may hold the pipes open).
const DRAIN_GRACE: Duration = Duration::from_millis(500);

/// Parameters of an exec request.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ExecParams {
    /// The shell command, run as `/bin/sh -c <command>`.
    pub(crate) command: String,
    /// Working directory; must be absolute when present.
    #[serde(default)]
    pub(crate) cwd: Option<PathBuf>,
    /// Kill the command after this many milliseconds.
    #[serde(default, alias = "timeout_ms")]
    pub(crate) timeout_ms: Option<u64>,
}

type Buffer = Arc<Mutex<Vec<u8>>>;

fn collect<R>(mut pipe: R, buffer: Buffer) -> JoinHandle<()>
where
    R: AsyncRead + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        let mut chunk = vec![0u8; 16 * 1024];
        loop {
            match pipe.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if let Ok(mut data) = buffer.lock() {
                        data.extend_from_slice(&chunk[..n]);
                    }
                }
            }
        }
    })
}

fn take(buffer: &Buffer) -> String {
    let data = buffer.lock().map(|mut data| std::mem::take(&mut *data));
    String::from_utf8_lossy(&data.unwrap_or_default()).into_owned()
}

#[cfg(unix)]
fn signal_of(status: &ExitStatus) -> Option<i32> {
    std::os::unix::process::ExitStatusExt::signal(status)
}

#[cfg(not(unix))]
fn signal_of(_status: &ExitStatus) -> Option<i32> {
    None
}

/// Runs the command described by `params` (in `params.cwd`, else
/// `default_dir`, else the process cwd). Returns the JSON result object, or
/// an error message when the command could not be started.
pub(crate) async fn run(params: ExecParams, default_dir: Option<&Path>) -> Result<Value, String> {
    let mut command = Command::new("/bin/sh");
    command
        .arg("-c")
        .arg(&params.command)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    if let Some(dir) = params.cwd.as_deref().or(default_dir) {
        command.current_dir(dir);
    }
    let mut child = command
        .spawn()
        .map_err(|err| format!("cannot run /bin/sh: {err}"))?;
    let stdout: Buffer = Arc::default();
    let stderr: Buffer = Arc::default();
    let mut readers = Vec::new();
    if let Some(pipe) = child.stdout.take() {
        readers.push(collect(pipe, Arc::clone(&stdout)));
    }
    if let Some(pipe) = child.stderr.take() {
        readers.push(collect(pipe, Arc::clone(&stderr)));
    }

    let mut timed_out = false;
    let status = match params.timeout_ms {
        None => child.wait().await,
        Some(ms) => match tokio::time::timeout(Duration::from_millis(ms), child.wait()).await {
            Ok(status) => status,
            Err(_) => {
                timed_out = true;
                let _ = child.start_kill();
                child.wait().await
            }
        },
    }
    .map_err(|err| format!("waiting for the command failed: {err}"))?;

    // Once the shell has exited, at most one pipe buffer of output is left to
    // read; a background grandchild holding the pipes open must not keep the
    // answer waiting, so collection stops after a grace period.
    for mut reader in readers {
        if tokio::time::timeout(DRAIN_GRACE, &mut reader).await.is_err() {
            reader.abort();
        }
    }

    Ok(json!({
        "exitCode": status.code(),
        "signal": signal_of(&status),
        "stdout": take(&stdout),
        "stderr": take(&stderr),
        "timedOut": timed_out,
    }))
}
