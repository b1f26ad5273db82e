//! Talking to a session's worker: `POST /invocations` streamed back to the client, the `/ws`
//! upgrade spliced byte for byte (as AgentCore's front does), and `GET /ping`.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use crate::error::{ErrorKind, ServiceError};
use crate::http::{self, BodyFraming, Conn, HttpError, Request, ResponseHead};
use crate::sessions::Session;
use crate::websocket::{self, WebSocketLimits};
use crate::SESSION_HEADER;

/// How long connecting to a worker and reading its response head may take.
const WORKER_PATIENCE: Duration = Duration::from_secs(30);
/// Request headers the front passes on to `/invocations` (AgentCore's contract).
const INVOKE_HEADERS: [&str; 9] = [
    "content-type",
    "accept",
    "x-amzn-bedrock-agentcore-runtime-user-id",
    "x-amzn-trace-id",
    "traceparent",
    "tracestate",
    "baggage",
    "mcp-session-id",
    "mcp-protocol-version",
];
/// Handshake headers passed on to the worker's `/ws`.
const WEBSOCKET_HEADERS: [&str; 4] = [
    "sec-websocket-key",
    "sec-websocket-version",
    "sec-websocket-protocol",
    "sec-websocket-extensions",
];

/// What the client connection may do after an exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum After {
    /// Read the next request.
    KeepAlive,
    /// Close it (a cut stream, a finished WebSocket, a broken client).
    Close,
}

/// Why a worker exchange failed before anything was sent to the client.
fn unreachable_worker(what: impl std::fmt::Display) -> ServiceError {
    ServiceError::new(
        ErrorKind::RuntimeClientError,
        format!("The runtime session's container could not be reached: {what}"),
    )
}

async fn connect(addr: SocketAddr) -> Result<TcpStream, ServiceError> {
    if !addr.ip().is_loopback() {
        return Err(unreachable_worker(format!("{addr} is not loopback")));
    }
    match tokio::time::timeout(WORKER_PATIENCE, TcpStream::connect(addr)).await {
        Ok(Ok(stream)) => Ok(stream),
        Ok(Err(e)) => Err(unreachable_worker(e)),
        Err(_) => Err(unreachable_worker("connect timed out")),
    }
}

async fn head_within(
    conn: &mut Conn<TcpStream>,
    stopped: &CancellationToken,
) -> Result<ResponseHead, ServiceError> {
    tokio::select! {
        _ = stopped.cancelled() => Err(unreachable_worker("the session was stopped")),
        head = tokio::time::timeout(WORKER_PATIENCE, conn.read_response_head()) => match head {
            Ok(Ok(head)) => Ok(head),
            Ok(Err(e)) => Err(unreachable_worker(e)),
            Err(_) => Err(unreachable_worker("no response head in time")),
        },
    }
}

/// The invocation exchange, up to the worker's response head: the caller answers errors.
pub(crate) struct Invocation {
    worker: Conn<TcpStream>,
    head: ResponseHead,
}

/// The size of the chunks a chunked invocation body is forwarded in.
const INVOCATION_CHUNK: usize = 16;

/// Sends `request`'s payload to the worker's `/invocations` (chunked when the client sent it so,
/// or when `chunked`) and reads its response head.
pub(crate) async fn start_invocation(
    addr: SocketAddr,
    session_id: &str,
    request: &Request,
    stopped: &CancellationToken,
    chunked: bool,
) -> Result<Invocation, ServiceError> {
    let stream = connect(addr).await?;
    let mut worker = Conn::new(stream);
    let mut head =
        format!("POST /invocations HTTP/1.1\r\nhost: {addr}\r\n{SESSION_HEADER}: {session_id}\r\n");
    for name in INVOKE_HEADERS {
        if let Some(value) = request.header(name) {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
    }
    if request.header("content-type").is_none() {
        head.push_str("content-type: application/octet-stream\r\n");
    }
    // A body the client streamed (chunked) goes on chunked, as a streaming front passes it;
    // `chunked` forces that for every body.
    let client_chunked = request
        .header("transfer-encoding")
        .is_some_and(|value| value.to_ascii_lowercase().contains("chunked"));
    let chunked = chunked || client_chunked;
    if chunked {
        head.push_str("transfer-encoding: chunked\r\nconnection: close\r\n\r\n");
    } else {
        head.push_str(&format!(
            "content-length: {}\r\nconnection: close\r\n\r\n",
            request.body.len()
        ));
    }
    let sent = async {
        worker.stream.write_all(head.as_bytes()).await?;
        if chunked {
            // Several chunks, as a stream would arrive, so a reader must loop over them.
            for piece in request.body.chunks(INVOCATION_CHUNK) {
                http::write_chunk(&mut worker.stream, piece).await?;
            }
            http::write_last_chunk(&mut worker.stream).await?;
        } else {
            worker.stream.write_all(&request.body).await?;
        }
        worker.stream.flush().await
    };
    sent.await.map_err(unreachable_worker)?;
    let head = head_within(&mut worker, stopped).await?;
    if !(200..300).contains(&head.status) {
        return Err(ServiceError::new(
            ErrorKind::RuntimeClientError,
            format!(
                "Received error ({}) from runtime. Please check your CloudWatch logs for more information.",
                head.status
            ),
        ));
    }
    Ok(Invocation { worker, head })
}

/// Streams the worker's answer to the client as a chunked body, chunk by chunk as it arrives.
///
/// `cut` ends it at once without the final chunk (the SDK sees the stream fail), as a stop or
/// the end of the worker's lifetime does.
pub(crate) async fn stream_invocation(
    invocation: Invocation,
    client: &mut TcpStream,
    session: &Session,
    session_id: &str,
    request_id: &str,
    cut: &CancellationToken,
    chunk_delay: impl Fn() -> Option<Duration>,
) -> After {
    let Invocation { mut worker, head } = invocation;
    let content_type = head
        .header("content-type")
        .unwrap_or("application/json")
        .to_owned();
    let mut framing = match BodyFraming::of(&head.headers) {
        Ok(framing) => framing,
        Err(_) => BodyFraming::ToEof,
    };
    let headers = [
        ("content-type", content_type.as_str()),
        (SESSION_HEADER, session_id),
        ("x-amzn-requestid", request_id),
    ];
    if http::write_chunked_head(client, 200, &headers, false)
        .await
        .is_err()
    {
        return After::Close;
    }
    loop {
        let piece = tokio::select! {
            _ = cut.cancelled() => return cut_off(client).await,
            piece = worker.next_body_piece(&mut framing) => piece,
        };
        match piece {
            Ok(Some(data)) => {
                if let Some(delay) = chunk_delay() {
                    tokio::select! {
                        _ = cut.cancelled() => return cut_off(client).await,
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
                session.touch();
                if http::write_chunk(client, &data).await.is_err() {
                    return After::Close;
                }
            }
            Ok(None) => {
                session.touch();
                return match http::write_last_chunk(client).await {
                    Ok(()) => After::KeepAlive,
                    Err(_) => After::Close,
                };
            }
            // The worker died mid-answer: the client's stream ends broken too.
            Err(HttpError::Io(_) | HttpError::Malformed(_)) => return cut_off(client).await,
        }
    }
}

/// Ends a client connection abruptly (no final chunk).
async fn cut_off(client: &mut TcpStream) -> After {
    let _ = client.shutdown().await;
    After::Close
}

/// The worker's answer to the upgrade: its raw head, and the connection if it switched.
pub(crate) struct Upgrade {
    pub(crate) head: ResponseHead,
    worker: Conn<TcpStream>,
}

/// Sends the client's upgrade on to the worker's `/ws`, with the session id header.
pub(crate) async fn start_upgrade(
    addr: SocketAddr,
    session_id: &str,
    request: &Request,
    stopped: &CancellationToken,
) -> Result<Upgrade, ServiceError> {
    let stream = connect(addr).await?;
    let mut worker = Conn::new(stream);
    let mut head = format!(
        "GET /ws HTTP/1.1\r\nhost: {addr}\r\nupgrade: websocket\r\nconnection: Upgrade\r\n{SESSION_HEADER}: {session_id}\r\n"
    );
    for name in WEBSOCKET_HEADERS {
        if let Some(value) = request.header(name) {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
    }
    head.push_str("\r\n");
    worker
        .stream
        .write_all(head.as_bytes())
        .await
        .map_err(unreachable_worker)?;
    let head = head_within(&mut worker, stopped).await?;
    Ok(Upgrade { head, worker })
}

/// Passes the worker's `101` on, then the frames both ways under the front's WebSocket quotas
/// ([`websocket::run`]) until either side ends, a quota is broken, or `cut` fires (then both
/// are cut at once). Frames count as session activity only when `frames_are_activity`.
pub(crate) async fn splice(
    upgrade: Upgrade,
    client: Conn<TcpStream>,
    session: &Session,
    cut: &CancellationToken,
    limits: WebSocketLimits,
    frames_are_activity: bool,
) -> websocket::Ended {
    let Upgrade { head, mut worker } = upgrade;
    let Conn {
        stream: mut client_stream,
        buffered: client_early,
    } = client;
    if client_stream.write_all(&head.raw).await.is_err() {
        return websocket::Ended::Normally;
    }
    let worker_early = std::mem::take(&mut worker.buffered);
    let (from_client, to_client) = client_stream.into_split();
    let (from_worker, to_worker) = worker.stream.into_split();
    // Bytes read past the heads belong to the first frames.
    let from_client = io::Cursor::new(client_early).chain(from_client);
    let from_worker = io::Cursor::new(worker_early).chain(from_worker);
    let on_frame = || {
        if frames_are_activity {
            session.touch();
        }
    };
    websocket::run(
        (from_client, to_client),
        (from_worker, to_worker),
        limits,
        cut,
        &on_frame,
    )
    .await
    // Dropping the halves closes both sockets: a cut reaches both peers.
}

/// What a worker's `/ping` said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PingStatus {
    /// `{"status":"HealthyBusy"}`.
    pub(crate) busy: bool,
    /// Its `time_of_last_update`, if it gave one.
    pub(crate) time_of_last_update: Option<u64>,
}

/// Asks the worker's `/ping`; `None` if it does not answer with a status in time.
pub(crate) async fn ping(addr: SocketAddr) -> Option<PingStatus> {
    let ask = async {
        let stream = connect(addr).await.ok()?;
        let mut conn = Conn::new(stream);
        let request = format!("GET /ping HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n");
        conn.stream.write_all(request.as_bytes()).await.ok()?;
        let head = conn.read_response_head().await.ok()?;
        let body = conn.read_response_body(&head).await.ok()?;
        let value: serde_json::Value = serde_json::from_slice(&body).ok()?;
        Some(PingStatus {
            busy: value.get("status")?.as_str()? == "HealthyBusy",
            time_of_last_update: value
                .get("time_of_last_update")
                .and_then(serde_json::Value::as_u64),
        })
    };
    tokio::time::timeout(Duration::from_secs(2), ask)
        .await
        .ok()
        .flatten()
}
