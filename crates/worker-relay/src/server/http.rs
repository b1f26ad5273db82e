//! AgentCore's container contract on one port: `GET /ping`, `GET /ws` (the framed protocol in
//! WebSocket binary messages) and `POST /invocations`. One request per connection.
//!
//! Served for one relay, or for the [`Front`] that takes its session from AgentCore's header.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_tungstenite::WebSocketStream;

use super::agentcore::Front;
use super::{AgentState, Relay};
use crate::agentcore::{parse_wipe_request, wipe_answer, SESSION_HEADER};
use crate::protocol::VERSION;

/// The longest request head accepted: AgentCore adds its platform headers and up to 20
/// allow-listed ones (values up to 4 KiB) to what the client sent.
const MAX_HEAD: usize = 64 * 1024;
/// The most request headers accepted, for the same reason.
const MAX_HEADERS: usize = 128;
/// The longest `/invocations` body accepted.
const MAX_BODY: usize = 1 << 20;

struct Request {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    /// Bytes received after the head.
    rest: Vec<u8>,
}

impl Request {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }

    fn header_has_token(&self, name: &str, token: &str) -> bool {
        self.header(name).is_some_and(|value| {
            value
                .split(',')
                .any(|part| part.trim().eq_ignore_ascii_case(token))
        })
    }
}

/// Who answers: one relay, or the AgentCore front that starts a relay per generation.
pub(super) enum Target {
    Relay(Relay),
    AgentCore(Arc<Front>),
}

impl Target {
    fn relay(&self) -> Option<Relay> {
        match self {
            Self::Relay(relay) => Some(relay.clone()),
            Self::AgentCore(front) => front.current(),
        }
    }
}

pub(super) async fn serve(target: Target, mut stream: TcpStream, patience: Duration) {
    let request = match tokio::time::timeout(patience, read_head(&mut stream)).await {
        Ok(Ok(Some(request))) => request,
        Ok(Ok(None)) => return respond(&mut stream, 400, "Bad Request", "bad request\n").await,
        Ok(Err(_)) | Err(_) => return,
    };
    let path = request.path.split('?').next().unwrap_or_default().to_owned();
    match (request.method.as_str(), path.as_str()) {
        ("GET" | "HEAD", "/ping") => {
            let (busy, last) = target
                .relay()
                .map_or((false, 0), |relay| relay.inner.status_for_ping());
            let status = if busy { "HealthyBusy" } else { "Healthy" };
            let body = format!(r#"{{"status":"{status}","time_of_last_update":{last}}}"#);
            respond_json(&mut stream, 200, "OK", &body).await;
        }
        ("GET", "/ws") => match target {
            Target::Relay(relay) => {
                if let Some(transport) = upgrade(stream, &request).await {
                    relay.serve_connection(transport).await;
                }
            }
            Target::AgentCore(front) => match front.admit(request.header(SESSION_HEADER)) {
                Ok(()) => {
                    if let Some(transport) = upgrade(stream, &request).await {
                        front.serve_connection(transport).await;
                    }
                }
                Err(refusal) => {
                    respond(&mut stream, refusal.status, refusal.reason, &refusal.body).await;
                }
            },
        },
        ("POST", "/invocations") => {
            let Some(payload) = read_body(&mut stream, &request).await else {
                return respond(&mut stream, 413, "Payload Too Large", "body too large\n").await;
            };
            if let (Target::AgentCore(front), Some(token)) = (&target, parse_wipe_request(&payload)) {
                return match front.wipe(request.header(SESSION_HEADER), &token).await {
                    Ok(removed) => respond_json(&mut stream, 200, "OK", &wipe_answer(removed)).await,
                    Err(refusal) => respond(&mut stream, refusal.status, refusal.reason, &refusal.body).await,
                };
            }
            let body = match target.relay() {
                Some(relay) => relay_document(&relay),
                None => format!(r#"{{"relay":"oab-relay","protocol":{VERSION},"agent":"not-started"}}"#),
            };
            respond_json(&mut stream, 200, "OK", &body).await;
        }
        (_, "/ping" | "/ws" | "/invocations") => {
            respond(&mut stream, 405, "Method Not Allowed", "method not allowed\n").await
        }
        _ => respond(&mut stream, 404, "Not Found", "not found\n").await,
    }
}

/// The `/invocations` answer: what the relay and its agent are doing.
fn relay_document(relay: &Relay) -> String {
    let status = relay.status();
    let agent = match status.agent {
        AgentState::NotStarted => "not-started",
        AgentState::Running { .. } => "running",
        AgentState::Exited { .. } => "exited",
        AgentState::SpawnFailed { .. } => "spawn-failed",
    };
    let config = &relay.inner.config;
    format!(
        concat!(
            r#"{{"relay":"oab-relay","protocol":{},"session":"{}","generation":{},"agent":"{}","#,
            r#""connected":{},"buffered_bytes":{},"output_last":{},"output_acked":{},"input_accepted":{}}}"#
        ),
        VERSION,
        config.session,
        config.generation,
        agent,
        status.connected,
        status.buffered_bytes,
        status.output_last,
        status.output_acked,
        status.input_accepted,
    )
}

/// Reads a request head; `None` if it is malformed or too long.
async fn read_head(stream: &mut TcpStream) -> std::io::Result<Option<Request>> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 2048];
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut request = httparse::Request::new(&mut headers);
        match request.parse(&buf) {
            Ok(httparse::Status::Complete(len)) => {
                let method = request.method.unwrap_or_default().to_owned();
                let path = request.path.unwrap_or_default().to_owned();
                let headers = request
                    .headers
                    .iter()
                    .map(|h| (h.name.to_owned(), String::from_utf8_lossy(h.value).into_owned()))
                    .collect();
                return Ok(Some(Request {
                    method,
                    path,
                    headers,
                    rest: buf[len..].to_vec(),
                }));
            }
            Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => {}
            Ok(httparse::Status::Partial) | Err(_) => return Ok(None),
        }
    }
}

/// Reads the request body, framed by `Content-Length` or `Transfer-Encoding: chunked` (a front
/// that streams the body on sends the latter); `None` if it is too large, malformed, or ends
/// early.
async fn read_body(stream: &mut TcpStream, request: &Request) -> Option<Vec<u8>> {
    let chunked = request.header("transfer-encoding").is_some_and(|value| {
        value
            .rsplit(',')
            .next()
            .is_some_and(|last| last.trim().eq_ignore_ascii_case("chunked"))
    });
    if chunked {
        return read_chunked_body(stream, request.rest.clone()).await;
    }
    let length = match request.header("content-length") {
        None => 0,
        Some(value) => match value.trim().parse::<usize>() {
            Ok(length) if length <= MAX_BODY => length,
            _ => return None,
        },
    };
    let mut body = request.rest.clone();
    body.truncate(length);
    let mut chunk = [0u8; 8192];
    while body.len() < length {
        let want = (length - body.len()).min(chunk.len());
        match stream.read(&mut chunk[..want]).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => body.extend_from_slice(&chunk[..n]),
        }
    }
    Some(body)
}

/// Reads a chunked body whose first bytes are `received`: chunks until the last one, then the
/// trailers up to the empty line. `None` past [`MAX_BODY`], on a malformed chunk or an early end.
async fn read_chunked_body(stream: &mut TcpStream, mut received: Vec<u8>) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    let mut at = 0;
    loop {
        let (size_len, size) = loop {
            match httparse::parse_chunk_size(&received[at..]) {
                Ok(httparse::Status::Complete((len, size))) => break (len, size),
                Ok(httparse::Status::Partial) => read_more(stream, &mut received).await?,
                Err(_) => return None,
            }
        };
        let size = usize::try_from(size)
            .ok()
            .filter(|size| body.len() + size <= MAX_BODY)?;
        at += size_len;
        if size == 0 {
            // Trailers (ignored) end with an empty line.
            loop {
                let rest = &received[at..];
                if rest.starts_with(b"\r\n") {
                    return Some(body);
                }
                match rest.windows(4).position(|w| w == b"\r\n\r\n") {
                    Some(_) => return Some(body),
                    None => read_more(stream, &mut received).await?,
                }
            }
        }
        while received.len() < at + size + 2 {
            read_more(stream, &mut received).await?;
        }
        body.extend_from_slice(&received[at..at + size]);
        if &received[at + size..at + size + 2] != b"\r\n" {
            return None;
        }
        at += size + 2;
    }
}

/// Appends what `stream` has next to `received`; `None` at its end or past the body's bound.
async fn read_more(stream: &mut TcpStream, received: &mut Vec<u8>) -> Option<()> {
    if received.len() > MAX_BODY + MAX_HEAD {
        return None;
    }
    let mut chunk = [0u8; 8192];
    match stream.read(&mut chunk).await {
        Ok(0) | Err(_) => None,
        Ok(n) => {
            received.extend_from_slice(&chunk[..n]);
            Some(())
        }
    }
}

/// Completes a WebSocket upgrade and returns the socket as a byte stream; answers 400 and returns
/// `None` for a request that is not one.
async fn upgrade(mut stream: TcpStream, request: &Request) -> Option<DuplexStream> {
    let key = request.header("sec-websocket-key").map(str::trim);
    let acceptable = request.header_has_token("upgrade", "websocket")
        && request.header_has_token("connection", "upgrade")
        && request.header("sec-websocket-version").map(str::trim) == Some("13");
    let (Some(key), true, true) = (key, acceptable, request.rest.is_empty()) else {
        respond(&mut stream, 400, "Bad Request", "not a websocket upgrade\n").await;
        return None;
    };
    let response = format!(
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: {}\r\n\r\n",
        derive_accept_key(key.as_bytes())
    );
    stream.write_all(response.as_bytes()).await.ok()?;
    let config = crate::transport::websocket_config();
    let socket = WebSocketStream::from_raw_socket(stream, Role::Server, Some(config)).await;
    Some(crate::transport::websocket_stream(socket))
}

async fn respond_json(stream: &mut TcpStream, status: u16, reason: &str, body: &str) {
    write_response(stream, status, reason, "application/json", body).await;
}

async fn respond(stream: &mut TcpStream, status: u16, reason: &str, body: &str) {
    write_response(stream, status, reason, "text/plain; charset=utf-8", body).await;
}

async fn write_response(stream: &mut TcpStream, status: u16, reason: &str, content_type: &str, body: &str) {
    let response = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.shutdown().await;
}
