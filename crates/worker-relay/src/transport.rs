//! Byte transports the protocol runs over, and [`Connector`]s that open them: TCP (the Pod IP),
//! a child process's stdio (`kubectl exec ... oab-relay connect`, the `pods/exec` reach) and a
//! WebSocket (AgentCore's `/ws`).

use std::ffi::OsString;
use std::fmt;
use std::io;
use std::pin::Pin;
use std::process::Stdio;
use std::task::{Context, Poll};

use async_trait::async_trait;
use bytes::BytesMut;
use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream, ReadBuf};
use tokio::net::TcpStream;
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use crate::protocol::MAX_PAYLOAD;

/// A [`Connector`]'s answer that reconnecting will not change, such as a service that denied
/// access: returned inside an [`io::Error`] ([`Refusal::into_io`]), it makes the client give up at
/// once with an [`Error::Backend`](session_runtime::Error::Backend) of the same message and
/// [`retryable`](Refusal::retryable) flag, where any other connect error is retried with backoff.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    retryable: bool,
    message: String,
}

impl Refusal {
    /// A refusal; `retryable` says whether the same attach may succeed later (e.g. once
    /// credentials were refreshed), as [`Error::retryable`](session_runtime::Error::retryable) does.
    pub fn new(retryable: bool, message: impl Into<String>) -> Self {
        Self {
            retryable,
            message: message.into(),
        }
    }

    /// Whether a later attach may succeed.
    pub fn retryable(&self) -> bool {
        self.retryable
    }

    /// What was refused, and why.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The refusal as an [`io::Error`] for [`Connector::connect`].
    pub fn into_io(self) -> io::Error {
        io::Error::new(io::ErrorKind::PermissionDenied, self)
    }

    /// The refusal inside `error`, if it carries one.
    pub fn from_io(error: &io::Error) -> Option<&Refusal> {
        error.get_ref().and_then(|inner| inner.downcast_ref::<Refusal>())
    }
}

/// An ordered, reliable, full-duplex byte stream.
pub trait ByteStream: AsyncRead + AsyncWrite + Send + Unpin {}

impl<T: AsyncRead + AsyncWrite + Send + Unpin + ?Sized> ByteStream for T {}

/// A boxed [`ByteStream`]: what a [`Connector`] opens.
pub type Transport = Box<dyn ByteStream>;

/// Opens a fresh transport to one relay; called again after every drop.
#[async_trait]
pub trait Connector: fmt::Debug + Send + Sync {
    /// Opens a new transport.
    ///
    /// # Errors
    /// Whatever prevented the connection; the client retries with backoff, unless the error
    /// carries a [`Refusal`].
    async fn connect(&self) -> io::Result<Transport>;
}

/// Connects over TCP (the worker's address and relay port).
#[derive(Debug, Clone)]
pub struct TcpConnector {
    addr: String,
}

impl TcpConnector {
    /// A connector to `addr` (`host:port`).
    pub fn new(addr: impl Into<String>) -> Self {
        Self { addr: addr.into() }
    }
}

#[async_trait]
impl Connector for TcpConnector {
    async fn connect(&self) -> io::Result<Transport> {
        let stream = TcpStream::connect(&self.addr).await?;
        stream.set_nodelay(true)?;
        Ok(Box::new(stream))
    }
}

/// Runs a command per connection and speaks over its stdin and stdout, e.g.
/// `kubectl exec -i <pod> -- /oab/oab-relay connect`. Its stderr goes to the broker's stderr; the
/// process is killed when the transport is dropped.
#[derive(Debug, Clone)]
pub struct CommandConnector {
    program: OsString,
    args: Vec<OsString>,
}

impl CommandConnector {
    /// A connector running `program` with `args`.
    pub fn new(program: impl Into<OsString>, args: impl IntoIterator<Item = impl Into<OsString>>) -> Self {
        Self {
            program: program.into(),
            args: args.into_iter().map(Into::into).collect(),
        }
    }
}

#[async_trait]
impl Connector for CommandConnector {
    async fn connect(&self) -> io::Result<Transport> {
        let mut child = Command::new(&self.program)
            .args(&self.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(io::Error::other("the command's pipes were not created"));
        };
        Ok(Box::new(CommandStream {
            _child: child,
            stdout,
            stdin,
        }))
    }
}

/// A child process's stdout and stdin as one stream; dropping it kills the child.
#[derive(Debug)]
struct CommandStream {
    _child: Child,
    stdout: ChildStdout,
    stdin: ChildStdin,
}

impl AsyncRead for CommandStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stdout).poll_read(cx, buf)
    }
}

impl AsyncWrite for CommandStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stdin).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stdin).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stdin).poll_shutdown(cx)
    }
}

/// Connects to a relay's `/ws` over plain `ws://` (tests, or a relay behind a TLS-terminating
/// proxy on the same host). AgentCore needs a SigV4-signed `wss://` handshake: its backend opens
/// the socket itself and passes it to [`websocket_stream`].
#[derive(Debug, Clone)]
pub struct WebSocketConnector {
    url: String,
    headers: Vec<(String, String)>,
}

impl WebSocketConnector {
    /// A connector to `url`, e.g. `ws://127.0.0.1:8080/ws`.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            headers: Vec::new(),
        }
    }

    /// Sends `name: value` with every upgrade request (e.g. AgentCore's session header, as the
    /// platform passes it to the container).
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }
}

#[async_trait]
impl Connector for WebSocketConnector {
    async fn connect(&self) -> io::Result<Transport> {
        let mut request = self
            .url
            .as_str()
            .into_client_request()
            .map_err(io::Error::other)?;
        for (name, value) in &self.headers {
            let name = http::HeaderName::try_from(name.as_str()).map_err(io::Error::other)?;
            let value = http::HeaderValue::try_from(value.as_str()).map_err(io::Error::other)?;
            request.headers_mut().append(name, value);
        }
        let uri = request.uri();
        if uri.scheme_str() != Some("ws") {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "only ws:// URLs are supported here; open wss:// yourself and use websocket_stream",
            ));
        }
        let host = uri.host().unwrap_or_default().trim_matches(['[', ']']).to_owned();
        let port = uri.port_u16().unwrap_or(80);
        let stream = TcpStream::connect((host.as_str(), port)).await?;
        stream.set_nodelay(true)?;
        let (socket, _) =
            tokio_tungstenite::client_async_with_config(request, stream, Some(websocket_config()))
                .await
                .map_err(io::Error::other)?;
        Ok(Box::new(websocket_stream(socket)))
    }
}

/// WebSocket limits for the protocol: a message never needs more than two frames' worth.
pub(crate) fn websocket_config() -> WebSocketConfig {
    WebSocketConfig::default()
        .max_message_size(Some(2 * MAX_PAYLOAD))
        .max_frame_size(Some(2 * MAX_PAYLOAD))
}

/// The largest WebSocket message the bridge sends: AgentCore closes a connection that carries a
/// frame above 32 KB (a service quota), and tungstenite sends each message as one frame. Half the
/// quota leaves room whether "KB" means 1,000 or 1,024 bytes, and for the frame's own header.
pub const MAX_WEBSOCKET_MESSAGE: usize = 16 * 1024;

/// The most WebSocket messages the bridge sends per second: AgentCore allows 250 frames per
/// second per connection; 200 (after a burst of 40) leaves room for the control frames (pong,
/// close) tungstenite sends on its own. With [`MAX_WEBSOCKET_MESSAGE`] that is 3.2 MB/s each way,
/// far above any agent's output rate.
pub const MAX_WEBSOCKET_MESSAGES_PER_SECOND: u32 = 200;

/// A token bucket for outgoing messages: [`PACE_BURST`] may go at once, then one more every
/// `1 s / MAX_WEBSOCKET_MESSAGES_PER_SECOND`. Any one-second window so holds at most
/// `PACE_BURST + MAX_WEBSOCKET_MESSAGES_PER_SECOND` messages (240, under AgentCore's 250), while a
/// chat's occasional messages never wait.
struct MessagePace {
    tokens: f64,
    refilled: tokio::time::Instant,
}

/// How many messages may go back to back before the pace applies.
const PACE_BURST: f64 = 40.0;

impl MessagePace {
    fn new() -> Self {
        Self {
            tokens: PACE_BURST,
            refilled: tokio::time::Instant::now(),
        }
    }

    /// Waits until one more message may go, and takes its token.
    async fn next(&mut self) {
        let rate = f64::from(MAX_WEBSOCKET_MESSAGES_PER_SECOND);
        let now = tokio::time::Instant::now();
        let earned = now.duration_since(self.refilled).as_secs_f64() * rate;
        self.tokens = (self.tokens + earned).min(PACE_BURST);
        self.refilled = now;
        if self.tokens < 1.0 {
            let wait = std::time::Duration::from_secs_f64((1.0 - self.tokens) / rate);
            tokio::time::sleep(wait).await;
            self.tokens = 1.0;
            self.refilled = tokio::time::Instant::now();
        }
        self.tokens -= 1.0;
    }
}

/// Turns an open WebSocket into a byte stream: bytes written go out as binary messages of at most
/// [`MAX_WEBSOCKET_MESSAGE`] bytes, at most [`MAX_WEBSOCKET_MESSAGES_PER_SECOND`] a second (a
/// burst waits, and what the writer adds meanwhile joins the next message), and binary messages
/// received are read back in order (message boundaries carry no meaning; the protocol's own
/// framing does). A close or text message ends the stream. A task bridges the two; it ends when
/// both sides are closed.
pub fn websocket_stream<S>(socket: WebSocketStream<S>) -> DuplexStream
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (near, far) = tokio::io::duplex(256 * 1024);
    tokio::spawn(bridge(socket, far));
    near
}

async fn bridge<S>(socket: WebSocketStream<S>, far: DuplexStream)
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (mut far_read, mut far_write) = tokio::io::split(far);
    let (mut sink, mut stream) = socket.split();
    let outgoing = async move {
        let mut pace = MessagePace::new();
        let mut buf = BytesMut::with_capacity(64 * 1024);
        'read: loop {
            buf.reserve(64 * 1024);
            match far_read.read_buf(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    while !buf.is_empty() {
                        pace.next().await;
                        let take = buf.len().min(MAX_WEBSOCKET_MESSAGE);
                        if sink
                            .send(Message::Binary(buf.split_to(take).freeze()))
                            .await
                            .is_err()
                        {
                            break 'read;
                        }
                    }
                }
            }
        }
        let _ = sink.close().await;
    };
    let incoming = async move {
        while let Some(message) = stream.next().await {
            match message {
                Ok(Message::Binary(bytes)) => {
                    if far_write.write_all(&bytes).await.is_err() {
                        break;
                    }
                }
                Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_)) => {}
                Ok(Message::Close(_) | Message::Text(_)) | Err(_) => {
                    tracing::debug!(?message, "the WebSocket ended");
                    break;
                }
            }
        }
        let _ = far_write.shutdown().await;
    };
    tokio::join!(outgoing, incoming);
}
