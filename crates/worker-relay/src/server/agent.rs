//! The agent process: spawning it, pumping its stdout into the output log, reaping it (and,
//! as an init process, every orphan), and signalling its process group.

use std::collections::VecDeque;
use std::io;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, BytesMut};
use rustix::process::{Pid, Signal, WaitOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{ChildStdin, ChildStdout};
use tokio::signal::unix::{signal, SignalKind};

use super::log::DATA_PREFIX;
use super::Inner;
use crate::protocol::{ExitStatus, RelaySignal, RESERVED_ENV_PREFIX};

/// Bytes read from the agent's stdout at a time (and so the largest output data item).
pub(crate) const READ_CHUNK: usize = 256 * 1024;

/// Below this much room left in the read buffer, the next read gets a fresh buffer.
const MIN_READ: usize = 64 * 1024;

/// Exhausted read buffers kept for reuse once the output read into them is acknowledged.
const SPARE_BUFFERS: usize = 4;

/// The size asked for the agent's stdin and stdout pipes (the kernel's default is 64 KiB):
/// larger pipes mean fewer wake-ups per megabyte.
const PIPE_SIZE: usize = 1 << 20;

/// A started agent: its pid (which is also its process group id).
pub(crate) struct Spawned {
    pub(crate) pid: u32,
}

/// Starts the agent in its own process group, with stdin fed from the broker's input, stdout
/// piped to the output log and stderr passed through (its tail kept), and starts the tasks that pump its input
/// and output and reap it.
pub(crate) fn spawn(inner: &Arc<Inner>) -> io::Result<Spawned> {
    let config = &inner.config;
    // Listen for SIGCHLD before the child exists, so its exit cannot be missed.
    let sigchld = signal(SignalKind::child())?;
    let mut command = std::process::Command::new(&config.program);
    command
        .args(&config.args)
        .current_dir(&config.working_dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    std::os::unix::process::CommandExt::process_group(&mut command, 0);
    // The relay's own variables (the token hashes, the bind token's hash of an unbound relay,
    // the session) are not the agent's business.
    for (key, _) in std::env::vars_os() {
        if is_relay_variable(&key) {
            command.env_remove(key);
        }
    }
    // A binding's environment, after the relay's own: it wins for the same name.
    for (name, value) in &config.env {
        if !is_relay_variable(name) {
            command.env(name, value);
        }
    }
    let mut child = command.spawn()?;
    let pid = child.id();
    let (Some(stdin), Some(stdout), Some(stderr)) =
        (child.stdin.take(), child.stdout.take(), child.stderr.take())
    else {
        return Err(io::Error::other("the agent's pipes were not created"));
    };
    // Best effort: an unprivileged process may be limited to less.
    let _ = rustix::pipe::fcntl_setpipe_size(&stdin, PIPE_SIZE);
    let _ = rustix::pipe::fcntl_setpipe_size(&stdout, PIPE_SIZE);
    // The child is reaped by `reap` below, never through `child`.
    drop(child);
    let stdin = ChildStdin::from_std(stdin)?;
    let stdout = ChildStdout::from_std(stdout)?;
    let stderr = tokio::process::ChildStderr::from_std(stderr)?;
    tokio::spawn(pump_stdin(Arc::clone(inner), stdin));
    tokio::spawn(pump_stdout(Arc::clone(inner), stdout));
    tokio::spawn(super::stderr::pump(Arc::clone(inner), stderr));
    tokio::spawn(reap(Arc::clone(inner), pid, sigchld));
    Ok(Spawned { pid })
}

/// Whether `name` is one of the relay's own environment variables, which the agent never sees.
fn is_relay_variable(name: &std::ffi::OsStr) -> bool {
    name.as_encoded_bytes()
        .starts_with(RESERVED_ENV_PREFIX.as_bytes())
}

/// Writes the broker's input to the agent's stdin, in order, until the relay is done. It runs
/// apart from the connections: while the agent does not read, only this task waits, and the
/// acknowledgements, heartbeats and signals behind the input still arrive.
async fn pump_stdin(inner: Arc<Inner>, stdin: ChildStdin) {
    let mut stdin = Some(stdin);
    while let Some((seq, payload)) = inner.next_input().await {
        let len = payload.as_ref().map_or(0, |bytes| bytes.len());
        match payload {
            Some(bytes) => {
                if let Some(pipe) = stdin.as_mut() {
                    if let Err(error) = pipe.write_all(&bytes).await {
                        // The agent closed its stdin or exited; what it did not read is gone
                        // with it, exactly as with a pipe.
                        tracing::debug!(%error, "the agent's stdin is closed");
                        stdin = None;
                    }
                }
            }
            None => {
                if let Some(mut pipe) = stdin.take() {
                    let _ = pipe.shutdown().await;
                }
            }
        }
        inner.input_written(seq, len);
    }
}

/// Moves the agent's stdout into the output log until EOF, respecting the log's bound.
async fn pump_stdout(inner: Arc<Inner>, mut stdout: ChildStdout) {
    let mut buf = BytesMut::new();
    let mut retired = VecDeque::with_capacity(SPARE_BUFFERS);
    // Created once, not per read: it registers a waiter when first polled.
    let drain_deadline = inner.drain_deadline();
    tokio::pin!(drain_deadline);
    loop {
        if !inner.wait_for_output_room().await {
            break;
        }
        // Each item is split off the front of `buf` without copying; what is left of the
        // allocation takes the next reads, so small reads share one buffer instead of pinning
        // (and faulting in) a fresh one each. A new buffer is allocated only once the rest is
        // too small for a worthwhile read.
        buf.clear();
        if buf.capacity() < DATA_PREFIX + MIN_READ {
            buf = fresh_buffer(&inner, &mut retired, std::mem::take(&mut buf));
        }
        buf.put_bytes(0, DATA_PREFIX);
        let mut room = (&mut buf).limit(READ_CHUNK);
        let read = tokio::select! {
            read = stdout.read_buf(&mut room) => read,
            () = &mut drain_deadline => {
                tracing::warn!("the agent exited but its stdout stays open (a descendant holds it); closing the stream");
                break;
            }
        };
        match read {
            Ok(0) => break,
            Ok(_) => inner.push_output_frame(buf.split()),
            Err(error) => {
                tracing::warn!(%error, "reading the agent's stdout failed");
                break;
            }
        }
    }
    inner.stdout_closed();
}

/// A read buffer with room for a whole [`READ_CHUNK`]: a retired buffer whose items were all
/// acknowledged and dropped, reclaimed in place, or the allocation of an acknowledged item the
/// output log kept, or else a new one. `used` (an exhausted buffer) joins the retired ones; the
/// oldest is let go when there are too many.
///
/// Reusing buffers matters for throughput: a new quarter-megabyte allocation per read is fresh
/// memory from the allocator (mapped, or the heap top grown back after a trim), so every page of
/// it faults on first write, which cost more than the copies themselves.
fn fresh_buffer(inner: &Inner, retired: &mut VecDeque<BytesMut>, used: BytesMut) -> BytesMut {
    if retired.len() == SPARE_BUFFERS {
        retired.pop_front();
    }
    retired.push_back(used);
    // The oldest are the likeliest to be acknowledged already.
    for _ in 0..retired.len() {
        let Some(mut candidate) = retired.pop_front() else {
            break;
        };
        if candidate.try_reclaim(DATA_PREFIX + READ_CHUNK) {
            return candidate;
        }
        retired.push_back(candidate);
    }
    inner
        .reuse_output_buffer(DATA_PREFIX + READ_CHUNK)
        .unwrap_or_else(|| BytesMut::with_capacity(DATA_PREFIX + READ_CHUNK))
}

/// Reaps the agent (and, with `reap_orphans`, every other child that becomes a zombie) and
/// records how the agent ended.
async fn reap(inner: Arc<Inner>, pid: u32, mut sigchld: tokio::signal::unix::Signal) {
    let Some(agent) = Pid::from_raw(pid as i32) else {
        return;
    };
    let reap_all = inner.config.reap_orphans;
    let mut agent_done = false;
    loop {
        loop {
            let waited = if reap_all {
                rustix::process::wait(WaitOptions::NOHANG)
            } else {
                rustix::process::waitpid(Some(agent), WaitOptions::NOHANG)
            };
            match waited {
                Ok(Some((reaped, status))) => {
                    if reaped == agent {
                        let exit = if let Some(signal) = status.terminating_signal() {
                            ExitStatus::Signal(signal)
                        } else {
                            ExitStatus::Code(status.exit_status().unwrap_or(-1))
                        };
                        agent_done = true;
                        inner.agent_exited(exit);
                    } else {
                        tracing::debug!(pid = reaped.as_raw_nonzero().get(), "reaped an orphan");
                    }
                    if !reap_all {
                        break;
                    }
                }
                Ok(None) => break,
                Err(error) => {
                    if error != rustix::io::Errno::CHILD {
                        tracing::warn!(%error, "waitpid failed");
                    }
                    if !agent_done && !reap_all {
                        // Someone else reaped it: the status is lost.
                        agent_done = true;
                        inner.agent_exited(ExitStatus::Code(-1));
                    }
                    break;
                }
            }
        }
        if agent_done && !reap_all {
            return;
        }
        tokio::select! {
            _ = sigchld.recv() => {}
            // SIGCHLD can be coalesced or missed around a fork; poll now and then as well.
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
            () = inner.done.cancelled() => return,
        }
    }
}

/// Sends `signal` to the agent's process group; `ESRCH` (nothing left) is not an error.
pub(crate) fn signal_group(pid: u32, signal: RelaySignal) {
    let Some(group) = Pid::from_raw(pid as i32) else {
        return;
    };
    let signal = match signal {
        RelaySignal::Terminate => Signal::TERM,
        RelaySignal::Kill => Signal::KILL,
        RelaySignal::Interrupt => Signal::INT,
    };
    match rustix::process::kill_process_group(group, signal) {
        Ok(()) | Err(rustix::io::Errno::SRCH) => {}
        Err(error) => tracing::warn!(%error, "signalling the agent's process group failed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::token::{BIND_TOKEN_HASH_ENV, TOKEN_HASH_ENV};

    #[test]
    fn the_relay_s_own_variables_are_recognised() {
        for name in [
            TOKEN_HASH_ENV,
            BIND_TOKEN_HASH_ENV,
            "OAB_RELAY_SESSION",
            "OAB_RELAY_GENERATION",
        ] {
            assert!(is_relay_variable(name.as_ref()), "{name}");
        }
        for name in ["OAB_RELAYX", "oab_relay_session", "HOME", ""] {
            assert!(!is_relay_variable(name.as_ref()), "{name}");
        }
    }
}
