//! AgentCore mode: a relay front that takes its session from the platform and runs one relay per
//! worker generation.
//!
//! In a Pod the relay is told its session, generation and token hash through its environment.
//! An AgentCore runtime's environment is shared by all its sessions, and its microVM lives as long
//! as the runtime session, across the broker's worker generations. So the front:
//!
//! - binds to the [`RuntimeSessionId`] in the [`SESSION_HEADER`] of the first `/ws` request and
//!   refuses any other one afterwards (one microVM serves one runtime session);
//! - reads each connection's hello before any relay sees it and admits only the session the id
//!   names, with the token whose hash the id carries;
//! - gives a hello of the current generation to the current relay (resume, takeover), one of an
//!   older generation to it too (which refuses it as stale), and for a newer generation retires
//!   the current relay, killing its agent and waiting for it to be gone, before a relay for the
//!   new generation starts the new agent: two generations never touch the storage at once;
//! - starts an agent only for a generation newer than any that ran on the session storage before,
//!   in this microVM or an earlier one (the floor is kept in the storage), so a broker that
//!   reconnects after its microVM was stopped is refused instead of reviving its generation;
//! - on a wipe request (an `/invocations` body from [`wipe_request`](crate::agentcore::wipe_request)
//!   with the bound session's token) retires the agent, empties the session storage and starts
//!   no agent again: AgentCore cannot delete session storage, so a closing broker does it here.

use std::fmt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, DuplexStream, ReadBuf};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::{check_epoch_not_ahead, http, refuse, Relay, RelayConfig};
use crate::agentcore::{RuntimeSessionId, SESSION_HEADER};
use crate::channel::{self, ChannelKey};
use crate::protocol::{decode_frame, ErrorCode, Frame, Hello, Peer};
use crate::token::{Token, TokenHash};

/// `(session, generation, token hash) -> configuration` of one generation's relay.
type MakeConfig = dyn Fn(&str, u64, TokenHash) -> RelayConfig + Send + Sync;

/// Makes the configuration of the relay for one generation.
pub struct RelayTemplate(Box<MakeConfig>);

impl RelayTemplate {
    /// A template calling `make` for each new generation.
    pub fn new(make: impl Fn(&str, u64, TokenHash) -> RelayConfig + Send + Sync + 'static) -> Self {
        Self(Box::new(make))
    }
}

impl RelayTemplate {
    /// The configuration of the relay for `generation` of `session`.
    pub(super) fn make(&self, session: &str, generation: u64, token_hash: TokenHash) -> RelayConfig {
        (self.0)(session, generation, token_hash)
    }
}

impl fmt::Debug for RelayTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RelayTemplate")
    }
}

/// Serves AgentCore's container contract (`GET /ping`, WebSocket `GET /ws`, `POST /invocations`)
/// for the runtime session AgentCore names; see the module documentation.
#[derive(Debug, Clone)]
pub struct AgentCoreServer {
    front: Arc<Front>,
}

#[derive(Debug)]
pub(super) struct Front {
    template: RelayTemplate,
    /// The session storage the agents work in: emptied by a wipe.
    storage: PathBuf,
    /// Set by a wipe: the runtime session is over, no agent starts again.
    wiped: AtomicBool,
    handshake_timeout: Duration,
    bound: Mutex<Option<RuntimeSessionId>>,
    current: Mutex<Option<Relay>>,
    /// Serializes generation changes: a retire and the start of its successor are one step.
    switching: tokio::sync::Mutex<()>,
    stopped: CancellationToken,
}

/// An HTTP refusal of a `/ws` request, before the upgrade.
#[derive(Debug)]
pub(super) struct HttpRefusal {
    pub(super) status: u16,
    pub(super) reason: &'static str,
    pub(super) body: String,
}

impl AgentCoreServer {
    /// A front whose relays come from `template` and whose agents work in `storage` (the session
    /// storage mount, emptied by a wipe request); a connection has `handshake_timeout` to send
    /// its hello.
    pub fn new(template: RelayTemplate, storage: impl Into<PathBuf>, handshake_timeout: Duration) -> Self {
        Self {
            front: Arc::new(Front {
                template,
                storage: storage.into(),
                wiped: AtomicBool::new(false),
                handshake_timeout,
                bound: Mutex::new(None),
                current: Mutex::new(None),
                switching: tokio::sync::Mutex::new(()),
                stopped: CancellationToken::new(),
            }),
        }
    }

    /// Serves `listener` until [`stop`](Self::stop).
    ///
    /// # Errors
    /// Never for a single failed accept; the signature leaves room for a fatal listener failure.
    pub async fn serve(&self, listener: TcpListener) -> std::io::Result<()> {
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                () = self.front.stopped.cancelled() => return Ok(()),
            };
            match accepted {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    let target = http::Target::AgentCore(Arc::clone(&self.front));
                    tokio::spawn(http::serve(target, stream, self.front.handshake_timeout));
                }
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    /// The runtime session this front serves, once the first `/ws` request named it.
    pub fn bound(&self) -> Option<RuntimeSessionId> {
        self.front.bound.lock().clone()
    }

    /// The relay of the newest generation, if one was started.
    pub fn current(&self) -> Option<Relay> {
        self.front.current()
    }

    /// Stops accepting connections and stops the current agent (`SIGTERM`, then `SIGKILL` after
    /// `grace`); returns what the relay process should exit with once it is done.
    pub async fn stop(&self, grace: Duration) -> i32 {
        self.front.stopped.cancel();
        let _switch = self.front.switching.lock().await;
        let Some(relay) = self.front.current() else {
            return 0;
        };
        relay.terminate(grace);
        relay.finished().await
    }
}

impl Front {
    pub(super) fn current(&self) -> Option<Relay> {
        self.current.lock().clone()
    }

    /// Checks a `/ws` request's runtime session id, binding the front to the first one.
    pub(super) fn admit(&self, header: Option<&str>) -> Result<(), HttpRefusal> {
        let refusal = |status, reason, body: String| HttpRefusal { status, reason, body };
        let Some(header) = header else {
            return Err(refusal(
                400,
                "Bad Request",
                format!("no {SESSION_HEADER} header\n"),
            ));
        };
        let id: RuntimeSessionId = header
            .trim()
            .parse()
            .map_err(|error| refusal(400, "Bad Request", format!("{SESSION_HEADER}: {error}\n")))?;
        let mut bound = self.bound.lock();
        match &*bound {
            Some(existing) if *existing != id => Err(refusal(
                409,
                "Conflict",
                format!("this worker serves runtime session {existing}, not {id}\n"),
            )),
            Some(_) => Ok(()),
            None => {
                tracing::info!(
                    session = id.session(),
                    incarnation = id.incarnation(),
                    "bound to the runtime session"
                );
                *bound = Some(id);
                Ok(())
            }
        }
    }

    /// Deletes the contents of the session storage for the broker (the token must be the bound
    /// runtime session's): the current agent is retired first, and no agent starts afterwards.
    /// Returns how many entries were removed.
    pub(super) async fn wipe(&self, header: Option<&str>, token: &Token) -> Result<usize, HttpRefusal> {
        self.admit(header)?;
        let Some(bound) = self.bound.lock().clone() else {
            return Err(HttpRefusal {
                status: 500,
                reason: "Internal Server Error",
                body: "not bound\n".into(),
            });
        };
        if !bound.token_hash().verify(token) {
            return Err(HttpRefusal {
                status: 403,
                reason: "Forbidden",
                body: "the token does not match\n".into(),
            });
        }
        let _switch = self.switching.lock().await;
        self.wiped.store(true, Ordering::SeqCst);
        if let Some(relay) = self.current() {
            relay.retire().await;
        }
        let storage = self.storage.clone();
        let removed = tokio::task::spawn_blocking(move || {
            let removed = empty_dir(&storage)?;
            // A later microVM on this storage (AgentCore starts one for any request) starts nothing.
            GenerationFloor::new(&storage).write(CLOSED)?;
            Ok(removed)
        })
        .await
        .map_err(|error| std::io::Error::other(error.to_string()))
        .and_then(|result| result)
        .map_err(|error| HttpRefusal {
            status: 500,
            reason: "Internal Server Error",
            body: format!(
                "deleting the session storage {}: {error}\n",
                self.storage.display()
            ),
        })?;
        tracing::info!(session = bound.session(), removed, "session storage deleted");
        Ok(removed)
    }

    /// Opens the channel with the key of the bound runtime session (derived from the token hash
    /// its id carries), reads the connection's hello inside it, picks (or starts) the relay for
    /// its generation and hands the connection, hello included, to it. A peer that does not
    /// authenticate gets the channel's refusal and nothing else.
    pub(super) async fn serve_connection(&self, transport: DuplexStream) {
        let Some(bound) = self.bound.lock().clone() else {
            return;
        };
        let key = ChannelKey::derive(bound.session(), bound.token_hash());
        let opened = tokio::time::timeout(self.handshake_timeout, channel::respond(transport, &key)).await;
        let mut transport = match opened {
            Ok(Ok(secure)) => secure,
            Ok(Err(error)) => {
                tracing::info!(%error, "a connection failed the channel handshake");
                return;
            }
            Err(_) => {
                tracing::info!("a connection did not complete the channel handshake in time");
                return;
            }
        };
        let mut received = BytesMut::with_capacity(512);
        let hello = loop {
            match decode_frame(&received, Peer::Broker) {
                Ok(Some((Frame::Hello(hello), _))) => break hello,
                Ok(Some((frame, _))) => {
                    let message = format!("expected a hello, not {:?}", frame.frame_type());
                    return refuse(&mut transport, ErrorCode::UnexpectedFrame, message).await;
                }
                Ok(None) => {}
                Err(error) => return refuse(&mut transport, error.code(), error.to_string()).await,
            }
            let read = tokio::time::timeout(self.handshake_timeout, transport.read_buf(&mut received)).await;
            match read {
                Ok(Ok(0) | Err(_)) => return,
                Ok(Ok(_)) => {}
                Err(_) => {
                    let message = "no hello in time".to_owned();
                    return refuse(&mut transport, ErrorCode::HandshakeTimeout, message).await;
                }
            }
        };
        let relay = match self.relay_for(&hello).await {
            Ok(relay) => relay,
            Err((code, message)) => return refuse(&mut transport, code, message).await,
        };
        relay
            .serve_authenticated(Replayed {
                head: received.freeze(),
                rest: transport,
            })
            .await;
    }

    async fn relay_for(&self, hello: &Hello) -> Result<Relay, (ErrorCode, String)> {
        let Some(bound) = self.bound.lock().clone() else {
            return Err((ErrorCode::Internal, "not bound to a runtime session".into()));
        };
        // Before anything is retired for it, or told about, the hello must prove it comes from
        // the broker.
        if !bound.token_hash().verify(&hello.token) {
            return Err((ErrorCode::BadToken, "the token does not match".into()));
        }
        if hello.session != bound.session() {
            return Err((
                ErrorCode::SessionMismatch,
                format!("this worker serves another session than {}", hello.session),
            ));
        }
        check_epoch_not_ahead(hello.epoch)?;
        let _switch = self.switching.lock().await;
        if self.stopped.is_cancelled() {
            return Err((ErrorCode::Internal, "the worker is stopping".into()));
        }
        if self.wiped.load(Ordering::SeqCst) {
            return Err((
                ErrorCode::Internal,
                "the session storage was deleted: this runtime session is closed".into(),
            ));
        }
        let current = self.current();
        if let Some(relay) = current
            .as_ref()
            .filter(|r| r.config().generation >= hello.generation)
        {
            return Ok(relay.clone());
        }
        // A new agent starts only for a generation newer than every one that ever ran on this
        // storage, in this microVM or an earlier one: a broker that reconnects after its microVM
        // was stopped must not bring its generation back to life.
        let floor = GenerationFloor::new(&self.storage);
        let ran = floor.read().map_err(|error| {
            (
                ErrorCode::Internal,
                format!("reading {}: {error}", floor.path.display()),
            )
        })?;
        if hello.generation <= ran {
            let message = if ran == CLOSED {
                "this runtime session was closed and its storage deleted".to_owned()
            } else {
                format!(
                    "generation {} already ran on this session storage (the newest was {ran}); its worker is gone",
                    hello.generation
                )
            };
            return Err((ErrorCode::StaleGeneration, message));
        }
        floor.write(hello.generation).map_err(|error| {
            (
                ErrorCode::Internal,
                format!("writing {}: {error}", floor.path.display()),
            )
        })?;
        if let Some(previous) = current {
            tracing::info!(
                previous = previous.config().generation,
                next = hello.generation,
                "a newer generation: retiring the current agent"
            );
            previous.retire().await;
        }
        let config = (self.template.0)(bound.session(), hello.generation, *bound.token_hash());
        let relay = Relay::new(config).map_err(|error| (ErrorCode::Internal, error.to_string()))?;
        *self.current.lock() = Some(relay.clone());
        Ok(relay)
    }
}

/// The generation floor's value once the storage was wiped: nothing may run again.
const CLOSED: u64 = u64::MAX;

/// The newest generation that started an agent on the session storage, kept in the storage
/// itself (`.oab-relay/generation`), the one place that outlives the microVM. The agent can
/// write it too; it can only harm its own session that way.
struct GenerationFloor {
    path: PathBuf,
}

impl GenerationFloor {
    fn new(storage: &Path) -> Self {
        Self {
            path: storage.join(".oab-relay").join("generation"),
        }
    }

    /// The floor; 0 if none was written (fresh storage, or no storage that outlives the microVM).
    fn read(&self) -> std::io::Result<u64> {
        match std::fs::read_to_string(&self.path) {
            Ok(text) => text
                .trim()
                .parse()
                .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "not a generation")),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(0),
            Err(error) => Err(error),
        }
    }

    /// Records `generation`, durably, before its agent starts.
    fn write(&self, generation: u64) -> std::io::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::DirBuilderExt;
        let Some(dir) = self.path.parent() else {
            return Ok(());
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
        let temporary = dir.join("generation.tmp");
        let mut file = std::fs::File::create(&temporary)?;
        file.write_all(generation.to_string().as_bytes())?;
        file.sync_all()?;
        std::fs::rename(&temporary, &self.path)?;
        // Session storage is a network file system that may refuse `fsync` on a directory
        // (reported: no such operation there); the rename is then as durable as that storage
        // makes it, which is all the floor can have. Any other failure still counts.
        match std::fs::File::open(dir)?.sync_all() {
            Err(error) if directory_sync_unsupported(&error) => {
                tracing::debug!(%error, "the session storage refuses fsync on a directory");
                Ok(())
            }
            other => other,
        }
    }
}

/// Whether `error` says the file system has no `fsync` for directories (rather than that it
/// failed).
fn directory_sync_unsupported(error: &std::io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(code) if code == rustix::io::Errno::INVAL.raw_os_error()
            || code == rustix::io::Errno::NOTSUP.raw_os_error()
            || code == rustix::io::Errno::OPNOTSUPP.raw_os_error()
    ) || error.kind() == std::io::ErrorKind::Unsupported
}

/// Removes everything inside `dir` (not `dir` itself, a mount point); symbolic links are removed,
/// never followed.
fn empty_dir(dir: &Path) -> std::io::Result<usize> {
    let mut removed = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            std::fs::remove_dir_all(&path)?;
        } else {
            std::fs::remove_file(&path)?;
        }
        removed += 1;
    }
    Ok(removed)
}

/// A connection whose first bytes were already read: they are read again, then the rest.
struct Replayed<S> {
    head: Bytes,
    rest: S,
}

impl<S: AsyncRead + Unpin> AsyncRead for Replayed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.head.has_remaining() {
            let n = self.head.len().min(buf.remaining());
            buf.put_slice(&self.head[..n]);
            self.head.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.rest).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Replayed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.rest).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.rest).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.rest).poll_shutdown(cx)
    }
}
