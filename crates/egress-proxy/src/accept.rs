//! The accept loop of both proxies: the local runtime's per-session sockets and the gateway's
//! TCP listener. Each connection takes a place within a limit before it is served; one beyond
//! the limit is refused at once, and a shortage of descriptors or memory makes the loop wait
//! rather than spin.

use std::future::Future;
use std::io;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;

use crate::bounds;

/// A listener the loop accepts from.
pub trait Listener: Send + Sync + 'static {
    /// Its connections.
    type Stream: AsyncRead + AsyncWrite + Send + Unpin + 'static;

    /// The next connection.
    fn accept_stream(&self) -> impl Future<Output = io::Result<Self::Stream>> + Send;

    /// Writes what `stream`'s socket takes now of `bytes`, never waiting.
    fn try_write(stream: &Self::Stream, bytes: &[u8]);
}

impl Listener for TcpListener {
    type Stream = TcpStream;

    async fn accept_stream(&self) -> io::Result<TcpStream> {
        self.accept().await.map(|(stream, _)| stream)
    }

    fn try_write(stream: &TcpStream, bytes: &[u8]) {
        let _ = stream.try_write(bytes);
    }
}

impl Listener for UnixListener {
    type Stream = UnixStream;

    async fn accept_stream(&self) -> io::Result<UnixStream> {
        self.accept().await.map(|(stream, _)| stream)
    }

    fn try_write(stream: &UnixStream, bytes: &[u8]) {
        let _ = stream.try_write(bytes);
    }
}

/// How the loop bounds and reports its connections.
pub struct Limits<T, R> {
    /// A place for one more connection (held while it is served), or why there is none.
    pub take: T,
    /// Logs a refusal (counted and rate-limited by the caller's bounds).
    pub refused: R,
    /// Whether a connection over the limit is answered [`bounds::OVER_LIMIT`] (an HTTP `503`)
    /// before it is closed: for a proxy, not for a raw byte stream.
    pub answer_http: bool,
}

impl<T, R> std::fmt::Debug for Limits<T, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limits")
            .field("answer_http", &self.answer_http)
            .finish_non_exhaustive()
    }
}

/// Accepts connections on `listener` until `stop`, handing each to `handle` with its place
/// (`handle` keeps it as long as the connection lasts, and ends at `stop`).
pub async fn accept_loop<L, P, T, R, F, Fut>(
    listener: L,
    stop: CancellationToken,
    limits: Limits<T, R>,
    handle: F,
) where
    L: Listener,
    T: Fn() -> Result<P, String> + Send,
    R: Fn(&str) + Send,
    P: Send,
    F: Fn(L::Stream, P, CancellationToken) -> Fut + Send,
    Fut: Future<Output = ()> + Send + 'static,
{
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept_stream() => accepted,
        };
        let stream = match accepted {
            Ok(stream) => stream,
            Err(error) if bounds::accept_exhausted(&error) => {
                (limits.refused)(&format!("cannot accept a connection now, waiting: {error}"));
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(bounds::ACCEPT_BACKOFF) => continue,
                }
            }
            // The client went away before its connection was accepted; nothing is held.
            Err(_) => continue,
        };
        let place = match (limits.take)() {
            Ok(place) => place,
            Err(reason) => {
                if limits.answer_http {
                    // Never waits: a client that does not read its answer just loses it.
                    L::try_write(&stream, bounds::OVER_LIMIT);
                }
                drop(stream);
                (limits.refused)(&reason);
                // A flood costs at most one accept per pause: a client that opens connections
                // in a loop cannot make the proxy spin for it. New connections wait in the
                // kernel's queue meanwhile.
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(bounds::REFUSAL_PAUSE) => continue,
                }
            }
        };
        tokio::spawn(handle(stream, place, stop.clone()));
    }
}
