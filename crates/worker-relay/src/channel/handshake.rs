//! The two-message `NNpsk0` handshake that opens a [`SecureStream`].

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::{ChannelKey, SecureStream};

/// The Noise protocol name: pattern, DH, cipher and hash.
const NOISE_PARAMS: &str = "Noise_NNpsk0_25519_ChaChaPoly_SHA256";

/// Mixed into the handshake hash: a peer speaking anything else fails to authenticate.
const PROLOGUE: &[u8] = b"oab-relay channel 1";

/// Length of each handshake message: an X25519 public key and the tag of an empty payload.
const MESSAGE_LEN: usize = 32 + 16;

/// Room for a handshake message's (empty) payload.
const PAYLOAD_ROOM: usize = 64;

/// Why a handshake did not open a channel.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// The transport failed or closed during the handshake.
    #[error("the transport failed during the channel handshake: {0}")]
    Io(#[from] io::Error),
    /// The peer's handshake message did not authenticate: it does not hold this session
    /// generation's secret (an impostor, or a worker of another session or generation).
    #[error(
        "the peer does not hold this session's channel key (its handshake message did not authenticate)"
    )]
    PeerUnauthenticated,
    /// The relay refused this broker's first message: the broker's key for the session does not
    /// match the relay's (another broker key, another generation, another session).
    #[error("the relay refused the channel handshake: the keys for this session do not match")]
    Refused,
    /// The peer sent something that is not a handshake message of this protocol (e.g. a relay or
    /// broker that speaks no channel, or not this one).
    #[error("not a channel handshake message: {0}")]
    Malformed(&'static str),
    /// The Noise implementation failed to set up (never expected with the fixed parameters).
    #[error("the Noise handshake could not be set up: {0}")]
    Setup(#[source] snow::Error),
}

fn builder(key: &ChannelKey) -> Result<snow::Builder<'_>, HandshakeError> {
    let params = NOISE_PARAMS.parse().map_err(HandshakeError::Setup)?;
    snow::Builder::new(params)
        .prologue(PROLOGUE)
        .and_then(|builder| builder.psk(0, key.as_bytes()))
        .map_err(HandshakeError::Setup)
}

/// Opens the channel as the broker: sends the first message and checks the relay's reply.
///
/// # Errors
/// - [`HandshakeError::PeerUnauthenticated`] if the reply does not authenticate (the peer does
///   not hold `key`): nothing else was sent.
/// - [`HandshakeError::Refused`] if the relay refused the first message.
/// - [`HandshakeError::Malformed`] if the reply is not a handshake message.
/// - [`HandshakeError::Io`] if the transport failed.
///
/// # Cancellation
/// Dropping the future abandons the transport half-way; open a new one.
pub async fn initiate<T>(mut transport: T, key: &ChannelKey) -> Result<SecureStream<T>, HandshakeError>
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    let mut noise = builder(key)?.build_initiator().map_err(HandshakeError::Setup)?;
    let mut message = [0u8; MESSAGE_LEN];
    let len = noise
        .write_message(&[], &mut message)
        .map_err(HandshakeError::Setup)?;
    write_message(&mut transport, &message[..len]).await?;
    let reply = read_message(&mut transport).await?;
    if reply.is_empty() {
        return Err(HandshakeError::Refused);
    }
    let mut payload = [0u8; PAYLOAD_ROOM];
    noise
        .read_message(&reply, &mut payload)
        .map_err(|_| HandshakeError::PeerUnauthenticated)?;
    let noise = noise.into_transport_mode().map_err(HandshakeError::Setup)?;
    Ok(SecureStream::new(transport, noise))
}

/// Opens the channel as the relay: checks the broker's first message and replies. A first
/// message that does not authenticate is answered with the empty refusal, and nothing else.
///
/// # Errors
/// - [`HandshakeError::PeerUnauthenticated`] if the first message does not authenticate.
/// - [`HandshakeError::Malformed`] if it is not a handshake message.
/// - [`HandshakeError::Io`] if the transport failed.
///
/// # Cancellation
/// Dropping the future abandons the transport.
pub async fn respond<T>(transport: T, key: &ChannelKey) -> Result<SecureStream<T>, HandshakeError>
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    respond_any(transport, &[key]).await.map(|(stream, _)| stream)
}

/// As [`respond`], for a relay that accepts channels under several keys (an unbound relay once
/// bound: its bind key and its session's key): the first of `keys` the broker's first message
/// authenticates under opens the channel, and its index is returned. A first message that
/// authenticates under none gets the same empty refusal as with one key.
///
/// # Errors
/// As [`respond`].
///
/// # Cancellation
/// As [`respond`].
pub async fn respond_any<T>(
    mut transport: T,
    keys: &[&ChannelKey],
) -> Result<(SecureStream<T>, usize), HandshakeError>
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    let first = read_message(&mut transport).await?;
    let mut payload = [0u8; PAYLOAD_ROOM];
    let mut opened = None;
    if !first.is_empty() {
        for (index, key) in keys.iter().enumerate() {
            let mut noise = builder(key)?.build_responder().map_err(HandshakeError::Setup)?;
            if noise.read_message(&first, &mut payload).is_ok() {
                opened = Some((noise, index));
                break;
            }
        }
    }
    let Some((mut noise, index)) = opened else {
        // The refusal says no more than "no": not the session, not the generation.
        let _ = write_message(&mut transport, &[]).await;
        return Err(HandshakeError::PeerUnauthenticated);
    };
    let mut message = [0u8; MESSAGE_LEN];
    let len = noise
        .write_message(&[], &mut message)
        .map_err(HandshakeError::Setup)?;
    write_message(&mut transport, &message[..len]).await?;
    let noise = noise.into_transport_mode().map_err(HandshakeError::Setup)?;
    Ok((SecureStream::new(transport, noise), index))
}

/// Writes one handshake message: `u16be len | bytes`.
async fn write_message<T: AsyncWrite + Unpin>(transport: &mut T, message: &[u8]) -> io::Result<()> {
    let len = u16::try_from(message.len()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let mut out = Vec::with_capacity(2 + message.len());
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(message);
    transport.write_all(&out).await?;
    transport.flush().await
}

/// Reads one handshake message: [`MESSAGE_LEN`] bytes, or none (the refusal). Any other length
/// is not this protocol (a peer without the channel, or another version), refused before reading
/// further so that such a peer never leaves the reader waiting.
async fn read_message<T: AsyncRead + Unpin>(transport: &mut T) -> Result<Vec<u8>, HandshakeError> {
    let mut len = [0u8; 2];
    transport.read_exact(&mut len).await?;
    let len = usize::from(u16::from_be_bytes(len));
    if len != MESSAGE_LEN && len != 0 {
        return Err(HandshakeError::Malformed(
            "a handshake message of a length this protocol never sends (a peer without the channel?)",
        ));
    }
    let mut message = vec![0u8; len];
    transport.read_exact(&mut message).await?;
    Ok(message)
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::token::TokenHash;

    fn key(byte: u8) -> ChannelKey {
        ChannelKey::derive("session", &TokenHash::from_bytes([byte; 32]))
    }

    #[tokio::test]
    async fn matching_keys_open_a_channel_both_ways() {
        let (near, far) = tokio::io::duplex(1 << 16);
        let relay = tokio::spawn(async move { respond(far, &key(1)).await });
        let mut broker = initiate(near, &key(1)).await.expect("broker side");
        let mut relay = relay.await.expect("task").expect("relay side");
        broker.write_all(b"hello").await.expect("write");
        broker.flush().await.expect("flush");
        let mut got = [0u8; 5];
        relay.read_exact(&mut got).await.expect("read");
        assert_eq!(&got, b"hello");
        relay.write_all(b"welcome").await.expect("write");
        relay.flush().await.expect("flush");
        let mut got = [0u8; 7];
        broker.read_exact(&mut got).await.expect("read");
        assert_eq!(&got, b"welcome");
    }

    #[tokio::test]
    async fn a_relay_with_another_key_refuses_and_the_broker_hears_refused() {
        let (near, far) = tokio::io::duplex(1 << 16);
        let relay = tokio::spawn(async move { respond(far, &key(2)).await });
        let broker = initiate(near, &key(1)).await;
        assert!(matches!(broker, Err(HandshakeError::Refused)), "{broker:?}");
        let relay = relay.await.expect("task");
        assert!(
            matches!(relay, Err(HandshakeError::PeerUnauthenticated)),
            "{relay:?}"
        );
    }

    #[tokio::test]
    async fn a_relay_with_several_keys_opens_under_the_one_the_broker_holds() {
        for (broker_key, expected) in [(1u8, Some(0)), (2, Some(1)), (3, None)] {
            let (near, far) = tokio::io::duplex(1 << 16);
            let relay = tokio::spawn(async move {
                respond_any(far, &[&key(1), &key(2)])
                    .await
                    .map(|(_, index)| index)
            });
            let broker = initiate(near, &key(broker_key)).await;
            let relay = relay.await.expect("task");
            match expected {
                Some(index) => {
                    assert!(broker.is_ok(), "{broker:?}");
                    assert_eq!(relay.expect("opened"), index);
                }
                None => {
                    assert!(matches!(broker, Err(HandshakeError::Refused)), "{broker:?}");
                    assert!(matches!(relay, Err(HandshakeError::PeerUnauthenticated)));
                }
            }
        }
    }

    #[tokio::test]
    async fn a_reply_without_the_key_is_unauthenticated() {
        let (near, mut far) = tokio::io::duplex(1 << 16);
        let impostor = tokio::spawn(async move {
            let mut first = [0u8; 2 + MESSAGE_LEN];
            far.read_exact(&mut first).await.expect("first message");
            // Whatever a listener without the key answers with.
            let mut reply = vec![0, MESSAGE_LEN as u8];
            reply.extend_from_slice(&[7u8; MESSAGE_LEN]);
            far.write_all(&reply).await.expect("reply");
            far
        });
        let broker = initiate(near, &key(1)).await;
        assert!(
            matches!(broker, Err(HandshakeError::PeerUnauthenticated)),
            "{broker:?}"
        );
        drop(impostor.await);
    }

    #[tokio::test]
    async fn a_replayed_first_message_opens_nothing_the_replayer_can_use() {
        // Record a real first message.
        let (near, mut far) = tokio::io::duplex(1 << 16);
        let broker = tokio::spawn(async move { initiate(near, &key(1)).await.map(|_| ()) });
        let mut first = [0u8; 2 + MESSAGE_LEN];
        far.read_exact(&mut first).await.expect("first message");
        drop(far);
        drop(broker.await);
        // Replay it: the relay answers, but records sealed under the recorded connection's keys
        // (or any the replayer can make) do not open.
        let (mut replayer, far) = tokio::io::duplex(1 << 16);
        let relay = tokio::spawn(async move {
            let mut stream = respond(far, &key(1))
                .await
                .expect("the replayed message authenticates");
            let mut byte = [0u8; 1];
            stream.read_exact(&mut byte).await
        });
        replayer.write_all(&first).await.expect("replay");
        let mut reply = [0u8; 2 + MESSAGE_LEN];
        replayer.read_exact(&mut reply).await.expect("reply");
        replayer
            .write_all(&[
                0, 20, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
            ])
            .await
            .expect("forged record");
        let read = relay.await.expect("task");
        assert_eq!(
            read.expect_err("a forged record never decrypts").kind(),
            io::ErrorKind::InvalidData
        );
    }

    #[tokio::test]
    async fn a_plaintext_peer_is_malformed_not_a_hang() {
        let (near, mut far) = tokio::io::duplex(1 << 16);
        tokio::spawn(async move {
            // An old relay's plaintext error frame: version 1, type 10, ...
            far.write_all(&[1, 10, 0, 0, 0, 4, 0, 1, 0, 0])
                .await
                .expect("write");
            let mut sink = Vec::new();
            let _ = far.read_to_end(&mut sink).await;
        });
        let broker = initiate(near, &key(1)).await;
        assert!(matches!(broker, Err(HandshakeError::Malformed(_))), "{broker:?}");
    }
}
