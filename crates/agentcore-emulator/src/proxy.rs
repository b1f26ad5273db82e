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

/// Sends `request`'s payload to the worker's `/invocations` and reads its response head.
pub(crate) async fn start_invocation(
    addr: SocketAddr,
    session_id: &str,
    request: &Request,
    stopped: &CancellationToken,
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
    head.push_str(&format!(
        "content-length: {}\r\nconnection: close\r\n\r\n",
        request.body.len()
    ));
    let sent = async {
        worker.stream.write_all(head.as_bytes()).await?;
        worker.stream.write_all(&request.body).await?;
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

/// Passes the worker's `101` on and splices both connections until either side ends or `cut`
/// fires (then both are cut at once). Every chunk counts as session activity.
pub(crate) async fn splice(
    upgrade: Upgrade,
    client: Conn<TcpStream>,
    session: &Session,
    cut: &CancellationToken,
    chunk_delay: impl Fn() -> Option<Duration>,
) {
    let Upgrade { head, mut worker } = upgrade;
    let Conn {
        stream: mut client_stream,
        buffered: client_early,
    } = client;
    let forwarded = async {
        client_stream.write_all(&head.raw).await?;
        client_stream
            .write_all(&std::mem::take(&mut worker.buffered))
            .await?;
        worker.stream.write_all(&client_early).await?;
        io::Result::Ok(())
    };
    if forwarded.await.is_err() {
        return;
    }
    let (mut from_client, mut to_client) = client_stream.into_split();
    let (mut from_worker, mut to_worker) = worker.stream.into_split();
    let mut up = vec![0u8; 16384];
    let mut down = vec![0u8; 16384];
    let (mut client_open, mut worker_open) = (true, true);
    while client_open || worker_open {
        tokio::select! {
            _ = cut.cancelled() => break,
            read = from_client.read(&mut up), if client_open => match read {
                Ok(0) | Err(_) => {
                    client_open = false;
                    let _ = to_worker.shutdown().await;
                }
                Ok(n) => {
                    session.touch();
                    if to_worker.write_all(&up[..n]).await.is_err() {
                        break;
                    }
                }
            },
            read = from_worker.read(&mut down), if worker_open => match read {
                Ok(0) | Err(_) => {
                    worker_open = false;
                    let _ = to_client.shutdown().await;
                }
                Ok(n) => {
                    if let Some(delay) = chunk_delay() {
                        tokio::select! {
                            _ = cut.cancelled() => break,
                            _ = tokio::time::sleep(delay) => {}
                        }
                    }
                    session.touch();
                    if to_client.write_all(&down[..n]).await.is_err() {
                        break;
                    }
                }
            },
        }
    }
    // Dropping the halves closes both sockets: a cut reaches both peers.
}

/// Asks the worker's `/ping` whether it is busy (`{"status":"HealthyBusy"}`).
pub(crate) async fn is_busy(addr: SocketAddr) -> bool {
    let ask = async {
        let stream = connect(addr).await.ok()?;
        let mut conn = Conn::new(stream);
        let request = format!("GET /ping HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n");
        conn.stream.write_all(request.as_bytes()).await.ok()?;
        let head = conn.read_response_head().await.ok()?;
        let body = conn.read_response_body(&head).await.ok()?;
        let value: serde_json::Value = serde_json::from_slice(&body).ok()?;
        Some(value.get("status")?.as_str()? == "HealthyBusy")
    };
    tokio::time::timeout(Duration::from_secs(2), ask)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}
