//! An unbound relay: a warm pool's worker, started before its session is known, that a broker
//! binds to a session with one `bind` connection (see the crate's "Binding a warm relay").
//!
//! Until it is bound it opens channels only under the key of its bind token's hash, accepts on
//! them only a `bind` carrying that token, and starts no agent; a hello fails at the channel (no
//! session key exists yet), with the same empty refusal a wrong token gets from a bound relay. The
//! first valid `bind` makes a [`Relay`] for its session, generation and token hash (the
//! template's configuration, with the binding's working directory and environment), and from
//! then on a connection under that session's key is that relay's, exactly as if it had been
//! started with them; a connection under the bind key can still only bind (the same binding
//! again is answered `bound`, another one `already-bound`).

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::{conn, refuse, Refusal, Relay, RelayTemplate};
use crate::channel::{self, ChannelKey};
use crate::protocol::{Binding, ErrorCode, Frame, FrameReader, Peer, ReadError};
use crate::token::TokenHash;

/// A relay started without a session (`oab-relay serve --unbound`), waiting to be bound.
///
/// Cheap to clone; clones share the relay. Use it within a Tokio runtime, as [`Relay`].
#[derive(Debug, Clone)]
pub struct UnboundRelay {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    template: RelayTemplate,
    bind_token_hash: TokenHash,
    bind_key: ChannelKey,
    handshake_timeout: Duration,
    state: Mutex<State>,
    /// Notified when the relay is bound or stopped.
    changed: Notify,
    /// Cancelled when the relay stopped before it was bound, or its bound relay finished.
    done: CancellationToken,
}

#[derive(Debug, Default)]
struct State {
    bound: Option<Bound>,
    /// Asked to stop before it was bound: it never will be.
    stopped: bool,
}

#[derive(Debug, Clone)]
struct Bound {
    binding: Binding,
    relay: Relay,
    key: ChannelKey,
}

impl UnboundRelay {
    /// An unbound relay that accepts binds carrying a token that hashes to `bind_token_hash`, and
    /// once bound serves the relay `template` configures for the binding's session, generation
    /// and token hash (with the binding's working directory, if it names one, and environment).
    /// `handshake_timeout` bounds each connection's channel handshake and its `bind`.
    pub fn new(template: RelayTemplate, bind_token_hash: TokenHash, handshake_timeout: Duration) -> Self {
        Self {
            inner: Arc::new(Inner {
                template,
                bind_token_hash,
                bind_key: ChannelKey::for_bind(&bind_token_hash),
                handshake_timeout,
                state: Mutex::new(State::default()),
                changed: Notify::new(),
                done: CancellationToken::new(),
            }),
        }
    }

    /// Accepts connections on `listener` until the relay finishes (or stops unbound).
    ///
    /// # Errors
    /// As [`Relay::serve_tcp`].
    pub async fn serve_tcp(&self, listener: TcpListener) -> std::io::Result<()> {
        super::accept_until(&listener, &self.inner.done, |stream| {
            let relay = self.clone();
            tokio::spawn(async move { relay.serve_connection(stream).await });
        })
        .await
    }

    /// Serves one connection: the channel handshake under the bind key or, once bound, the
    /// session's key; a bind connection is served here, a session connection by the bound relay.
    ///
    /// # Cancellation
    /// Dropping the future closes the connection.
    pub async fn serve_connection<S>(&self, stream: S)
    where
        S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        let bound = self.inner.state.lock().bound.clone();
        let mut keys = vec![&self.inner.bind_key];
        if let Some(bound) = &bound {
            keys.push(&bound.key);
        }
        let handshake = channel::respond_any(stream, &keys);
        let opened = tokio::select! {
            opened = tokio::time::timeout(self.inner.handshake_timeout, handshake) => opened,
            () = self.inner.done.cancelled() => return,
        };
        match (opened, bound) {
            (Ok(Ok((secure, 0))), _) => self.serve_bind(secure).await,
            (Ok(Ok((secure, _))), Some(bound)) => bound.relay.serve_authenticated(secure).await,
            (Ok(Ok(_)), None) => {}
            (Ok(Err(error)), _) => tracing::info!(%error, "a connection failed the channel handshake"),
            (Err(_), _) => tracing::info!("a connection did not complete the channel handshake in time"),
        }
    }

    /// Serves a connection opened under the bind key: its one `bind`, answered `bound` or refused.
    async fn serve_bind<S>(&self, stream: S)
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let (read_half, mut write_half) = tokio::io::split(stream);
        let mut reader = FrameReader::new(read_half, Peer::Broker);
        let first = tokio::time::timeout(self.inner.handshake_timeout, reader.next()).await;
        let answer = match first {
            Err(_) => Err((
                ErrorCode::HandshakeTimeout,
                format!("no bind within {:?}", self.inner.handshake_timeout),
            )),
            Ok(Err(ReadError::Frame(error))) => Err((error.code(), error.to_string())),
            Ok(Err(_) | Ok(None)) => return,
            Ok(Ok(Some(Frame::Bind(bind)))) => {
                // The token first, in constant time: without it, nothing else is looked at.
                if self.inner.bind_token_hash.verify(&bind.bind_token) {
                    self.bind(bind.binding)
                } else {
                    Err((ErrorCode::BadToken, "the bind token does not match".into()))
                }
            }
            Ok(Ok(Some(other))) => Err((
                ErrorCode::UnexpectedFrame,
                format!("expected a bind, got {}", other.frame_type()),
            )),
        };
        match answer {
            Ok(generation) => {
                let bound = Frame::Bound { generation };
                if crate::protocol::write_frame(&mut write_half, &bound)
                    .await
                    .is_ok()
                {
                    let _ = write_half.flush().await;
                    let _ = write_half.shutdown().await;
                }
            }
            Err((code, message)) => refuse(&mut write_half, code, message).await,
        }
        // Close after the peer did, so that the answer is not lost to a reset.
        conn::linger(reader.into_inner()).await;
    }

    /// Binds the relay to `binding`, or checks that it already is bound to exactly that; the
    /// bound generation.
    fn bind(&self, binding: Binding) -> Result<u64, Refusal> {
        let mut state = self.inner.state.lock();
        if let Some(bound) = &state.bound {
            if bound.binding == binding {
                tracing::info!(
                    session = %binding.session,
                    generation = binding.generation,
                    "the same binding again; already bound"
                );
                return Ok(binding.generation);
            }
            return Err((
                ErrorCode::AlreadyBound,
                format!(
                    "this relay is bound to generation {} of session {}, not to this binding",
                    bound.binding.generation, bound.binding.session
                ),
            ));
        }
        if state.stopped {
            return Err((ErrorCode::Internal, "the relay is shutting down".into()));
        }
        let mut config = self
            .inner
            .template
            .make(&binding.session, binding.generation, binding.token_hash);
        if !binding.working_dir.is_empty() {
            config = config.working_dir(&binding.working_dir);
        }
        config = config.agent_env(binding.env.iter().cloned());
        let relay = Relay::new(config).map_err(|error| (ErrorCode::Internal, error.to_string()))?;
        // Names only: the values may be secrets.
        tracing::info!(
            session = %binding.session,
            generation = binding.generation,
            working_dir = %binding.working_dir,
            env = ?binding.env.iter().map(|(name, _)| name.as_str()).collect::<Vec<_>>(),
            "relay bound"
        );
        let generation = binding.generation;
        state.bound = Some(Bound {
            key: ChannelKey::derive(&binding.session, &binding.token_hash),
            binding,
            relay: relay.clone(),
        });
        drop(state);
        let done = self.inner.done.clone();
        tokio::spawn(async move {
            relay.finished().await;
            done.cancel();
        });
        self.inner.changed.notify_waiters();
        Ok(generation)
    }

    /// The relay serving the bound session, once bound.
    pub fn bound(&self) -> Option<Relay> {
        self.inner
            .state
            .lock()
            .bound
            .as_ref()
            .map(|bound| bound.relay.clone())
    }

    /// What the relay is bound to, once bound.
    pub fn binding(&self) -> Option<Binding> {
        self.inner
            .state
            .lock()
            .bound
            .as_ref()
            .map(|bound| bound.binding.clone())
    }

    /// As [`Relay::terminate`] once bound; before, the relay stops: it refuses every later bind
    /// and finishes with 0.
    pub fn terminate(&self, grace: Duration) {
        let bound = {
            let mut state = self.inner.state.lock();
            if state.bound.is_none() {
                state.stopped = true;
            }
            state.bound.as_ref().map(|bound| bound.relay.clone())
        };
        match bound {
            Some(relay) => relay.terminate(grace),
            None => {
                self.inner.done.cancel();
                self.inner.changed.notify_waiters();
            }
        }
    }

    /// Waits until the relay is done: as [`Relay::finished`] once bound, or 0 once stopped before
    /// it was bound.
    pub async fn finished(&self) -> i32 {
        loop {
            let changed = self.inner.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let relay = {
                let state = self.inner.state.lock();
                if state.stopped {
                    return 0;
                }
                state.bound.as_ref().map(|bound| bound.relay.clone())
            };
            if let Some(relay) = relay {
                return relay.finished().await;
            }
            changed.await;
        }
    }
}
