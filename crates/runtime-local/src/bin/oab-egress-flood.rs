//! `oab-egress-flood`: a hostile agent's flood of its own egress proxy, for the tests and the
//! benchmark of the proxy's per-session bounds (`tests/egress_proxy.rs`,
//! `benches/egress_flood.rs`). Built only with the `testing` feature; not meant to be installed.
//!
//! ```text
//! oab-egress-flood SOCKET COUNT MODE
//! ```
//!
//! It opens up to `COUNT` connections to the Unix socket `SOCKET` (a session's proxy), as fast as
//! it can, and keeps every one it opened: with `MODE` = `idle` it sends nothing (a connection
//! flood); with `slow` it sends the start of a request head and never finishes it (a
//! slow-loris). A connection the proxy refuses or ends is counted and closed. With `churn` it
//! opens and closes connections, `COUNT` at a time, without pause until its stdin ends (what
//! keeps the proxy's accept loop busiest). It runs in a process of its own, as an agent does,
//! so that its descriptors are not the proxy's.
//!
//! It writes `opened N refused M` on stdout once it has tried `COUNT` connections (`churning`
//! at once for `churn`), then holds them until its stdin ends, and exits 0; with bad arguments
//! it exits 2 saying why.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;

/// How long one connection may take to be made: a proxy that stopped accepting must not stall
/// the flood (a full queue refuses a non-blocking connect at once; this bounds anything else).
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// How the flood uses each connection it opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Send nothing.
    Idle,
    /// Send part of a request head, never its end.
    Slow,
    /// Open and close connections until stdin ends.
    Churn,
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [socket, count, mode] = args.as_slice() else {
        eprintln!("oab-egress-flood: usage: oab-egress-flood SOCKET COUNT idle|slow|churn");
        return ExitCode::from(2);
    };
    let socket = PathBuf::from(socket);
    let Ok(count) = count.parse::<usize>() else {
        eprintln!("oab-egress-flood: COUNT must be a number, found {count:?}");
        return ExitCode::from(2);
    };
    let mode = match mode.as_str() {
        "idle" => Mode::Idle,
        "slow" => Mode::Slow,
        "churn" => Mode::Churn,
        other => {
            eprintln!("oab-egress-flood: MODE must be idle, slow or churn, found {other:?}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("oab-egress-flood: starting tokio: {error}");
            return ExitCode::from(2);
        }
    };
    if mode == Mode::Churn {
        let ended = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        std::thread::spawn({
            let ended = std::sync::Arc::clone(&ended);
            move || {
                let _ = std::io::stdin().read_to_end(&mut Vec::new());
                ended.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        });
        println!("churning");
        let _ = std::io::stdout().flush();
        runtime.block_on(churn(&socket, count, &ended));
        return ExitCode::SUCCESS;
    }
    let held = runtime.block_on(flood(&socket, count, mode));
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    drop(held);
    ExitCode::SUCCESS
}

/// Opens `count` connections at a time and closes them, until `ended`.
async fn churn(socket: &Path, count: usize, ended: &std::sync::atomic::AtomicBool) {
    while !ended.load(std::sync::atomic::Ordering::Relaxed) {
        let mut batch = Vec::with_capacity(count);
        for _ in 0..count {
            if let Some(stream) = open(socket, Mode::Idle).await {
                batch.push(stream);
            }
        }
        drop(batch);
        tokio::task::yield_now().await;
    }
}

/// Opens the flood's connections, reports them, and returns those still open.
async fn flood(socket: &Path, count: usize, mode: Mode) -> Vec<UnixStream> {
    let mut held = Vec::with_capacity(count);
    let mut refused = 0usize;
    for _ in 0..count {
        match open(socket, mode).await {
            Some(stream) => held.push(stream),
            None => refused += 1,
        }
    }
    // A connection the proxy answered and closed (it is over its limit) reads as ended.
    tokio::time::sleep(Duration::from_millis(200)).await;
    held.retain(|stream| {
        let mut probe = [0u8; 64];
        let open =
            matches!(stream.try_read(&mut probe), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
        if !open {
            refused += 1;
        }
        open
    });
    println!("opened {} refused {refused}", held.len());
    let _ = std::io::stdout().flush();
    held
}

/// One connection of the flood, or `None` if it could not be made or used.
async fn open(socket: &Path, mode: Mode) -> Option<UnixStream> {
    let mut stream = tokio::time::timeout(CONNECT_TIMEOUT, UnixStream::connect(socket))
        .await
        .ok()?
        .ok()?;
    if mode == Mode::Slow {
        tokio::time::timeout(CONNECT_TIMEOUT, stream.write_all(b"CONNECT "))
            .await
            .ok()?
            .ok()?;
    }
    Some(stream)
}
