//! The agent's standard error: passed through to the relay's own, as before (a Pod's log, the
//! microVM's log), and its last lines kept, so that the exit report can say in the agent's own
//! words why it ended, above all when it could not start at all.

use std::collections::VecDeque;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::ChildStderr;

use super::Inner;
use crate::protocol::MAX_TEXT_LEN;

/// The most lines the tail keeps: a start failure's message and a little context, not a log.
const MAX_LINES: usize = 20;

/// The last bytes the agent wrote to its standard error, at most [`MAX_TEXT_LEN`].
#[derive(Debug, Default)]
pub(crate) struct StderrTail {
    bytes: VecDeque<u8>,
    /// Whether older bytes were let go, so the first kept line may be a line's end only.
    cut: bool,
}

impl StderrTail {
    pub(crate) fn push(&mut self, chunk: &[u8]) {
        self.bytes.extend(chunk);
        if self.bytes.len() > MAX_TEXT_LEN {
            self.bytes.drain(..self.bytes.len() - MAX_TEXT_LEN);
            self.cut = true;
        }
    }

    /// Its last whole lines (up to [`MAX_LINES`]), lossily decoded, without the trailing line
    /// end; at most [`MAX_TEXT_LEN`] bytes.
    pub(crate) fn text(&self) -> String {
        let (front, back) = self.bytes.as_slices();
        let mut bytes = [front, back].concat();
        if self.cut {
            // A line cut at its start says less than nothing about where it began.
            let start = bytes.iter().position(|&b| b == b'\n').map_or(0, |i| i + 1);
            bytes.drain(..start);
        }
        let text = String::from_utf8_lossy(&bytes);
        let lines: Vec<&str> = text.trim_end().lines().collect();
        let mut tail = lines[lines.len().saturating_sub(MAX_LINES)..].join("\n");
        // Replacement characters can make the decoded text longer than the bytes.
        while tail.len() > MAX_TEXT_LEN {
            let mut cut = tail.len() - MAX_TEXT_LEN;
            while !tail.is_char_boundary(cut) {
                cut += 1;
            }
            tail.drain(..cut);
        }
        tail
    }
}

/// Copies the agent's standard error to the relay's own and into the state's tail, until it
/// closes (or, when a descendant of the agent holds it open, the drain grace after the agent's
/// exit), then tells the relay it is closed.
pub(crate) async fn pump(inner: Arc<Inner>, mut stderr: ChildStderr) {
    let mut out = tokio::io::stderr();
    let mut buf = vec![0u8; 8 * 1024];
    let drain_deadline = inner.drain_deadline();
    tokio::pin!(drain_deadline);
    loop {
        let read = tokio::select! {
            read = stderr.read(&mut buf) => read,
            () = &mut drain_deadline => break,
        };
        match read {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                // The relay's own stderr going away must not stop the agent.
                let _ = out.write_all(&buf[..n]).await;
                inner.stderr_written(&buf[..n]);
            }
        }
    }
    inner.stderr_closed();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_last_whole_lines_within_the_bound() {
        let mut tail = StderrTail::default();
        assert_eq!(tail.text(), "");
        tail.push(b"starting\nerror: unexpected argument '--no-such-flag'\n");
        assert_eq!(
            tail.text(),
            "starting\nerror: unexpected argument '--no-such-flag'"
        );

        let mut tail = StderrTail::default();
        for line in 0..100 {
            tail.push(format!("line {line}\n").as_bytes());
        }
        let text = tail.text();
        assert_eq!(text.lines().count(), MAX_LINES);
        assert!(
            text.starts_with("line 80\n") && text.ends_with("line 99"),
            "{text}"
        );

        let mut tail = StderrTail::default();
        tail.push(&vec![b'x'; 3 * MAX_TEXT_LEN]);
        tail.push(b"\nthe end\n");
        assert_eq!(tail.text(), "the end", "a line cut at its start is dropped");

        let mut tail = StderrTail::default();
        tail.push(&vec![0xff; 2 * MAX_TEXT_LEN]);
        assert!(
            tail.text().len() <= MAX_TEXT_LEN,
            "replacement characters stay within the bound"
        );
    }
}
