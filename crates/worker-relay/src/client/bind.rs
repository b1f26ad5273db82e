//! The broker side of the bind exchange: [`bind`] claims an unbound relay for a session.

use std::io;
use std::time::Duration;

use tokio::io::{AsyncWriteExt, BufWriter};

use crate::channel::{self, ChannelKey, HandshakeError};
use crate::protocol::{Bind, Binding, ErrorCode, Frame, FrameReader, Peer, ReadError};
use crate::token::Token;
use crate::transport::{Connector, Refusal};

/// Why a [`bind`] did not bind the relay.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BindError {
    /// The binding breaks a rule of the protocol (see [`Binding`]); nothing was sent.
    #[error("the binding is invalid: {field}: {reason}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The transport could not be opened (a connector's [`Refusal`] says whether to retry).
    #[error("connecting to the relay failed: {0}")]
    Connect(#[source] io::Error),
    /// The transport failed or closed before the answer arrived; the bind may or may not have
    /// taken effect, and binding again with the same binding is safe.
    #[error("the relay connection broke: {0}")]
    Io(#[source] io::Error),
    /// The channel did not open: the relay refused the bind key (another bind token, or a relay
    /// started bound, which has no bind key), or the peer does not hold the bind token's hash (an
    /// impostor), or it speaks no channel.
    #[error("the bind channel was not authenticated: {0}")]
    Unauthenticated(#[source] HandshakeError),
    /// `bad-token`: the relay holds the bind token's hash, but the token was not its preimage.
    #[error("the relay refused the bind token: {message}")]
    BadToken {
        /// The relay's message.
        message: String,
    },
    /// `already-bound`: the relay is bound to another binding; nothing changed.
    #[error("the relay is already bound: {message}")]
    AlreadyBound {
        /// The relay's message (which binding it has).
        message: String,
    },
    /// Another refusal (e.g. `bad-frame` from a relay that holds the binding to other rules,
    /// `internal` from one shutting down).
    #[error("the relay refused the bind: {code}: {message}")]
    Rejected {
        /// Its code.
        code: ErrorCode,
        /// Its message.
        message: String,
    },
    /// The relay answered something the protocol does not allow here.
    #[error("protocol violation by the relay: {0}")]
    Protocol(String),
    /// No answer within the timeout; the bind may or may not have taken effect.
    #[error("no answer to the bind within {0:?}")]
    Timeout(Duration),
}

impl BindError {
    /// Whether binding again (with the same binding) may succeed: the answer was lost or the
    /// relay was not reachable yet, as opposed to a refusal that will not change.
    pub fn is_retryable(&self) -> bool {
        match self {
            BindError::Connect(error) => Refusal::from_io(error).is_none_or(|refusal| refusal.retryable()),
            BindError::Io(_) | BindError::Timeout(_) => true,
            BindError::Rejected { code, .. } => {
                matches!(code, ErrorCode::HandshakeTimeout | ErrorCode::IdleTimeout)
            }
            BindError::Invalid { .. }
            | BindError::Unauthenticated(_)
            | BindError::BadToken { .. }
            | BindError::AlreadyBound { .. }
            | BindError::Protocol(_) => false,
        }
    }
}

/// Binds the unbound relay `connector` reaches to `binding`, presenting `bind_token` (the relay
/// holds its hash, e.g. from [`BrokerKey::bind_token`](crate::BrokerKey::bind_token)).
///
/// Opens the channel keyed by the bind token's hash, sends one `bind` and waits for `bound`. Once
/// it returns `Ok`, connect to the relay as to one started with the binding's session,
/// generation and token hash ([`RelayClient`](crate::RelayClient)).
///
/// # Idempotency
/// Binding a relay again to the same binding (the same session, generation, token hash, working
/// directory and environment, in the same order) succeeds again: a broker that lost the first
/// answer retries. Another binding fails with [`BindError::AlreadyBound`] and changes nothing.
///
/// # Errors
/// [`BindError`]: [`Invalid`](BindError::Invalid) before anything is sent,
/// [`Unauthenticated`](BindError::Unauthenticated) if the relay does not take this bind token (or
/// was started bound), [`AlreadyBound`](BindError::AlreadyBound), [`BadToken`](BindError::BadToken),
/// [`Rejected`](BindError::Rejected) for other refusals, and [`Connect`](BindError::Connect),
/// [`Io`](BindError::Io) or [`Timeout`](BindError::Timeout) (whole exchange, `timeout`) when the
/// answer did not arrive; [`BindError::is_retryable`] tells them apart.
///
/// # Cancellation
/// Dropping the future abandons the connection; the bind may or may not have taken effect.
pub async fn bind(
    connector: &dyn Connector,
    bind_token: &Token,
    binding: &Binding,
    timeout: Duration,
) -> Result<(), BindError> {
    binding
        .check()
        .map_err(|(field, reason)| BindError::Invalid { field, reason })?;
    let frame = Frame::Bind(Bind {
        bind_token: *bind_token,
        binding: binding.clone(),
    });
    let bytes = frame.to_bytes().map_err(|_| BindError::Invalid {
        field: "bind",
        reason: "cannot be encoded",
    })?;
    let key = ChannelKey::for_bind(&bind_token.hash());
    let exchange = async {
        let transport = connector.connect().await.map_err(BindError::Connect)?;
        // Nothing but the handshake goes out before the peer proved it holds the bind hash.
        let secure = channel::initiate(transport, &key)
            .await
            .map_err(|error| match error {
                HandshakeError::Io(error) => BindError::Io(error),
                other => BindError::Unauthenticated(other),
            })?;
        let (read_half, write_half) = tokio::io::split(secure);
        let mut writer = BufWriter::new(write_half);
        writer.write_all(&bytes).await.map_err(BindError::Io)?;
        writer.flush().await.map_err(BindError::Io)?;
        let mut reader = FrameReader::new(read_half, Peer::Relay);
        match reader.next().await {
            Ok(Some(Frame::Bound { generation })) if generation == binding.generation => Ok(()),
            Ok(Some(Frame::Bound { generation })) => Err(BindError::Protocol(format!(
                "bound to generation {generation}, but {} was asked",
                binding.generation
            ))),
            Ok(Some(Frame::Error { code, message })) => Err(match code {
                ErrorCode::AlreadyBound => BindError::AlreadyBound { message },
                ErrorCode::BadToken => BindError::BadToken { message },
                code => BindError::Rejected { code, message },
            }),
            Ok(Some(other)) => Err(BindError::Protocol(format!(
                "expected bound, got {}",
                other.frame_type()
            ))),
            Ok(None) => Err(BindError::Io(io::ErrorKind::UnexpectedEof.into())),
            Err(ReadError::Io(error)) => Err(BindError::Io(error)),
            Err(ReadError::Truncated { .. }) => Err(BindError::Io(io::ErrorKind::UnexpectedEof.into())),
            Err(error) => Err(BindError::Protocol(error.to_string())),
        }
    };
    let result = tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| BindError::Timeout(timeout))?;
    match &result {
        Ok(()) => tracing::info!(
            session = %binding.session,
            generation = binding.generation,
            "relay bound"
        ),
        Err(error) => tracing::info!(
            session = %binding.session,
            generation = binding.generation,
            %error,
            "binding the relay failed"
        ),
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::token::TokenHash;

    #[test]
    fn retryable_failures_are_the_ones_a_retry_can_change() {
        assert!(BindError::Io(io::ErrorKind::UnexpectedEof.into()).is_retryable());
        assert!(BindError::Timeout(Duration::from_secs(1)).is_retryable());
        assert!(BindError::Connect(io::ErrorKind::ConnectionRefused.into()).is_retryable());
        assert!(!BindError::AlreadyBound {
            message: String::new()
        }
        .is_retryable());
        assert!(!BindError::BadToken {
            message: String::new()
        }
        .is_retryable());
        assert!(!BindError::Unauthenticated(HandshakeError::Refused).is_retryable());
    }

    #[derive(Debug)]
    struct Unreachable;

    #[async_trait::async_trait]
    impl Connector for Unreachable {
        async fn connect(&self) -> io::Result<crate::Transport> {
            panic!("an invalid binding is never sent");
        }
    }

    #[tokio::test]
    async fn an_invalid_binding_is_refused_before_connecting() {
        let binding = Binding::new("s", 1, TokenHash::from_bytes([0; 32])).env("OAB_RELAY_X", "v");
        let token = Token::from_bytes([1; 32]);
        let error = bind(&Unreachable, &token, &binding, Duration::from_secs(1))
            .await
            .expect_err("invalid");
        assert!(
            matches!(
                error,
                BindError::Invalid {
                    field: "env name",
                    ..
                }
            ),
            "{error}"
        );
    }
}
