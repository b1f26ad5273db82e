//! A tiny stand-in for `oab-relay serve --http 127.0.0.1:0 --agentcore`, for the emulator's own
//! tests: announces its port like the relay, then serves
//!
//! - `GET /ping`: `{"status":"Healthy"}`, or `HealthyBusy` after `{"op":"busy","on":true}`, with
//!   a `time_of_last_update` that changes at every ping after `{"op":"ticking","on":true}`;
//! - `POST /invocations` with a JSON payload: `{"op":"stream","chunks":N,"gap_ms":M}` streams N
//!   SSE events; `{"op":"write","name":F,"content":C}` / `{"op":"read","name":F}` use a file in the
//!   working directory (the session storage); `{"op":"info"}` answers the pid, working directory
//!   and the session id header it received; `{"op":"startup"}` what the storage held when the
//!   worker started (before it announced) and whether a file could be written there then;
//!   `{"op":"probe"}` tries a hard link, a FIFO, a UNIX socket, an xattr, `fallocate`, a
//!   symbolic link and a rename in the storage, and a UNIX socket and a FIFO in the temporary
//!   directory, and answers each one's errno (0: it worked);
//!   `{"op":"fill","bytes":N}` writes N bytes to one file there and answers how many were
//!   written and the errno that stopped it;
//! - `GET /ws`: a WebSocket that first sends `hello <session id header>` and then echoes.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_tungstenite::tungstenite::handshake::server::{Request, Response};
use tokio_tungstenite::tungstenite::Message;

static BOOT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
/// The session storage: the working directory at start, as a path (so a storage mounted there
/// later is what every file operation reaches).
static STORAGE: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
/// What the storage held at start and whether a file could be written to it then.
static STARTUP: std::sync::OnceLock<serde_json::Value> = std::sync::OnceLock::new();
/// Whether `/ping` reports a new `time_of_last_update` each time.
static TICKING: AtomicBool = AtomicBool::new(false);
/// The `time_of_last_update` `/ping` reports.
static LAST_UPDATE: AtomicU64 = AtomicU64::new(1);

const SESSION_HEADER: &str = "x-amzn-bedrock-agentcore-runtime-session-id";

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::io::Result<()> {
    // Pids repeat across pid namespaces: a boot id tells one worker from the next.
    let boot = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let _ = BOOT.set(format!("{}-{boot}", std::process::id()));
    let storage = std::env::current_dir()?;
    let _ = STARTUP.set(serde_json::json!({
        "entries": list(&storage),
        "marker_written": std::fs::write(storage.join("startup-marker"), "x").is_ok(),
    }));
    let _ = STORAGE.set(storage);
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    println!("oab-relay: listening on http {}", listener.local_addr()?);
    let busy = Arc::new(AtomicBool::new(false));
    loop {
        let (stream, _) = listener.accept().await?;
        let busy = Arc::clone(&busy);
        tokio::spawn(async move {
            let _ = serve(stream, busy).await;
        });
    }
}

async fn serve(stream: TcpStream, busy: Arc<AtomicBool>) -> std::io::Result<()> {
    // Peek at the request line: a WebSocket handshake goes to tungstenite untouched.
    let mut peeked = [0u8; 16];
    loop {
        let n = stream.peek(&mut peeked).await?;
        if n == 0 {
            return Ok(());
        }
        if n >= 8 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    if peeked.starts_with(b"GET /ws") {
        return websocket(stream).await;
    }
    http(stream, busy).await
}

async fn websocket(stream: TcpStream) -> std::io::Result<()> {
    let mut session = String::new();
    // tungstenite's callback signature fixes the (large) error type.
    #[allow(clippy::result_large_err)]
    let callback = |request: &Request, response: Response| {
        session = request
            .headers()
            .get(SESSION_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("<none>")
            .to_owned();
        Ok(response)
    };
    let Ok(mut ws) = tokio_tungstenite::accept_hdr_async(stream, callback).await else {
        return Ok(());
    };
    let _ = ws.send(Message::text(format!("hello {session}"))).await;
    while let Some(Ok(message)) = ws.next().await {
        match message {
            Message::Text(text) if ws.send(Message::text(format!("echo {text}"))).await.is_err() => break,
            Message::Close(_) => break,
            _ => {}
        }
    }
    Ok(())
}

async fn http(mut stream: TcpStream, busy: Arc<AtomicBool>) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let head_end = loop {
        let mut chunk = [0u8; 4096];
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break end + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let header = |name: &str| {
        head.lines()
            .filter_map(|line| line.split_once(':'))
            .find(|(key, _)| key.trim().eq_ignore_ascii_case(name))
            .map(|(_, value)| value.trim().to_owned())
    };
    let length: usize = header("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
    let mut body = buf[head_end..].to_vec();
    while body.len() < length {
        let mut chunk = [0u8; 4096];
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    if head.starts_with("GET /ping") {
        let status = if busy.load(Ordering::Relaxed) {
            "HealthyBusy"
        } else {
            "Healthy"
        };
        if TICKING.load(Ordering::Relaxed) {
            LAST_UPDATE.fetch_add(1, Ordering::Relaxed);
        }
        let update = LAST_UPDATE.load(Ordering::Relaxed);
        return json(
            &mut stream,
            &serde_json::json!({ "status": status, "time_of_last_update": update }),
        )
        .await;
    }
    if !head.starts_with("POST /invocations") {
        return stream
            .write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            .await;
    }
    let payload: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let text = |key: &str| {
        payload
            .get(key)
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_owned()
    };
    match payload.get("op").and_then(|v| v.as_str()).unwrap_or_default() {
        "stream" => {
            let chunks = payload.get("chunks").and_then(|v| v.as_u64()).unwrap_or(3);
            let gap = Duration::from_millis(payload.get("gap_ms").and_then(|v| v.as_u64()).unwrap_or(0));
            stream
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                .await?;
            for i in 0..chunks {
                if i > 0 {
                    tokio::time::sleep(gap).await;
                }
                let event = format!("data: {i}\n\n");
                stream
                    .write_all(format!("{:x}\r\n{event}\r\n", event.len()).as_bytes())
                    .await?;
            }
            stream.write_all(b"0\r\n\r\n").await
        }
        "write" => {
            std::fs::write(in_storage(&text("name")), text("content"))?;
            json(&mut stream, &serde_json::json!({ "ok": true })).await
        }
        "read" => {
            let content = std::fs::read_to_string(in_storage(&text("name"))).ok();
            json(&mut stream, &serde_json::json!({ "content": content })).await
        }
        "busy" => {
            busy.store(
                payload.get("on").and_then(|v| v.as_bool()).unwrap_or(false),
                Ordering::Relaxed,
            );
            json(&mut stream, &serde_json::json!({ "ok": true })).await
        }
        "ticking" => {
            TICKING.store(
                payload.get("on").and_then(|v| v.as_bool()).unwrap_or(false),
                Ordering::Relaxed,
            );
            json(&mut stream, &serde_json::json!({ "ok": true })).await
        }
        "startup" => json(&mut stream, STARTUP.get().unwrap_or(&serde_json::Value::Null)).await,
        "probe" => json(&mut stream, &probe()).await,
        "fill" => {
            let bytes = payload.get("bytes").and_then(|v| v.as_u64()).unwrap_or(0);
            json(&mut stream, &fill(bytes)).await
        }
        "fail" => {
            stream
                .write_all(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n")
                .await
        }
        _ => {
            let cwd = std::env::current_dir()
                .map(|p| p.display().to_string())
                .unwrap_or_default();
            let info = serde_json::json!({
                "pid": std::process::id(),
                "boot": BOOT.get(),
                "cwd": cwd,
                "session": header(SESSION_HEADER),
                "content_type": header("content-type"),
            });
            json(&mut stream, &info).await
        }
    }
}

/// `name` in the session storage.
fn in_storage(name: &str) -> std::path::PathBuf {
    STORAGE
        .get()
        .map_or_else(|| name.into(), |storage| storage.join(name))
}

/// The names in `dir`, sorted (empty if it cannot be read).
fn list(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|entry| entry.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// 0 for success, else the errno (-1 for an error without one).
fn errno<T>(result: std::io::Result<T>) -> i32 {
    match result {
        Ok(_) => 0,
        Err(error) => error.raw_os_error().unwrap_or(-1),
    }
}

/// Each special operation the session storage is reported to refuse, tried in it.
fn probe() -> serde_json::Value {
    use rustix::fs::{FallocateFlags, FileType, Mode, XattrFlags, CWD};
    let target = in_storage("probe-target");
    let _ = std::fs::write(&target, "probe");
    let names = [
        "probe-link",
        "probe-fifo",
        "probe-socket",
        "probe-symlink",
        "probe-renamed",
    ];
    for name in names {
        let _ = std::fs::remove_file(in_storage(name));
    }
    let fifo = rustix::fs::mknodat(
        CWD,
        in_storage("probe-fifo"),
        FileType::Fifo,
        Mode::RUSR | Mode::WUSR,
        0,
    )
    .map_err(std::io::Error::from);
    let xattr =
        rustix::fs::setxattr(&target, "user.probe", b"1", XattrFlags::empty()).map_err(std::io::Error::from);
    let fallocate = std::fs::OpenOptions::new()
        .write(true)
        .open(&target)
        .and_then(|file| rustix::fs::fallocate(&file, FallocateFlags::empty(), 0, 4096).map_err(Into::into));
    let elsewhere = std::env::temp_dir();
    let socket_elsewhere = elsewhere.join(format!("probe-socket-{}", std::process::id()));
    let fifo_elsewhere = elsewhere.join(format!("probe-fifo-{}", std::process::id()));
    let made_fifo_elsewhere =
        rustix::fs::mknodat(CWD, &fifo_elsewhere, FileType::Fifo, Mode::RUSR | Mode::WUSR, 0)
            .map_err(std::io::Error::from);
    let answer = serde_json::json!({
        "socket_elsewhere": errno(std::os::unix::net::UnixListener::bind(&socket_elsewhere)),
        "fifo_elsewhere": errno(made_fifo_elsewhere),
        "hard_link": errno(std::fs::hard_link(&target, in_storage("probe-link"))),
        "fifo": errno(fifo),
        "socket": errno(std::os::unix::net::UnixListener::bind(in_storage("probe-socket"))),
        "xattr": errno(xattr),
        "fallocate": errno(fallocate),
        "symlink": errno(std::os::unix::fs::symlink("probe-target", in_storage("probe-symlink"))),
        "rename": errno(std::fs::copy(&target, in_storage("probe-copy")).and_then(|_| std::fs::rename(in_storage("probe-copy"), in_storage("probe-renamed")))),
    });
    for name in names {
        let _ = std::fs::remove_file(in_storage(name));
    }
    let _ = std::fs::remove_file(&target);
    let _ = std::fs::remove_file(&socket_elsewhere);
    let _ = std::fs::remove_file(&fifo_elsewhere);
    answer
}

/// Writes `bytes` bytes to `fill` in the storage, 64 KiB at a time, then syncs it.
fn fill(bytes: u64) -> serde_json::Value {
    use std::io::Write;
    let chunk = vec![0x5a_u8; 64 * 1024];
    let mut written = 0_u64;
    let mut stopped = 0;
    match std::fs::File::create(in_storage("fill")) {
        Ok(mut file) => {
            while written < bytes {
                let n = chunk
                    .len()
                    .min(usize::try_from(bytes - written).unwrap_or(chunk.len()));
                match file.write(&chunk[..n]) {
                    Ok(0) => break,
                    Ok(n) => written += n as u64,
                    Err(error) => {
                        stopped = error.raw_os_error().unwrap_or(-1);
                        break;
                    }
                }
            }
            if stopped == 0 {
                stopped = errno(file.sync_all());
            }
        }
        Err(error) => stopped = error.raw_os_error().unwrap_or(-1),
    }
    serde_json::json!({ "written": written, "errno": stopped })
}

async fn json(stream: &mut TcpStream, value: &serde_json::Value) -> std::io::Result<()> {
    let body = value.to_string();
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}
