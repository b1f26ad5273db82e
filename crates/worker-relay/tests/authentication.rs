//! The channel between broker and relay, attacked from outside with the real `oab-relay`: a
//! captured exchange replayed with a larger epoch, a token holder pushing the epoch, a listener
//! at the address the broker dials, a relay with another secret, a client with a wrong token
//! fishing for the generation; and the default listener reached over IPv6 and IPv4.

mod common;

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use common::{within, RelayOptions, RelayProcess};
use session_runtime::{Attachment, Error, Fence};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use worker_relay::protocol::{Frame, Welcome};
use worker_relay::{BrokerKey, ClientConfig, Connector, RelayClient, TcpConnector, Transport};

/// What one recorded connection carried: the broker's bytes and the relay's.
#[derive(Debug, Default)]
struct Recorded {
    sent: Vec<u8>,
    received: Vec<u8>,
}

/// A TCP connector that records the bytes of its first connection, both ways.
#[derive(Debug)]
struct Recording {
    inner: TcpConnector,
    connects: AtomicUsize,
    first: Arc<Mutex<Recorded>>,
}

impl Recording {
    fn new(addr: SocketAddr) -> Arc<Self> {
        Arc::new(Self {
            inner: TcpConnector::new(addr.to_string()),
            connects: AtomicUsize::new(0),
            first: Arc::default(),
        })
    }

    fn sent(&self) -> Vec<u8> {
        self.first.lock().expect("lock").sent.clone()
    }

    fn received(&self) -> Vec<u8> {
        self.first.lock().expect("lock").received.clone()
    }
}

#[async_trait]
impl Connector for Recording {
    async fn connect(&self) -> io::Result<Transport> {
        let stream = self.inner.connect().await?;
        let first = self.connects.fetch_add(1, Ordering::SeqCst) == 0;
        Ok(Box::new(Tee {
            inner: stream,
            record: first.then(|| Arc::clone(&self.first)),
        }))
    }
}

/// The most a recording keeps per direction.
const RECORD_LIMIT: usize = 1 << 20;

struct Tee {
    inner: Transport,
    record: Option<Arc<Mutex<Recorded>>>,
}

impl AsyncRead for Tee {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let read = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let (Poll::Ready(Ok(())), Some(record)) = (&read, &self.record) {
            let mut record = record.lock().expect("lock");
            if record.received.len() < RECORD_LIMIT {
                record.received.extend_from_slice(&buf.filled()[before..]);
            }
        }
        read
    }
}

impl AsyncWrite for Tee {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let (Poll::Ready(Ok(n)), Some(record)) = (&written, &self.record) {
            let mut record = record.lock().expect("lock");
            if record.sent.len() < RECORD_LIMIT {
                record.sent.extend_from_slice(&buf[..*n]);
            }
        }
        written
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|window| window == needle)
}

async fn round_trip(attachment: &mut Attachment, text: &str) -> Result<(), String> {
    attachment
        .input()
        .write_line(text)
        .await
        .map_err(|error| format!("write: {error}"))?;
    let mut reader = tokio::io::BufReader::new(attachment.output());
    loop {
        let mut line = String::new();
        let read = tokio::time::timeout(
            Duration::from_secs(10),
            tokio::io::AsyncBufReadExt::read_line(&mut reader, &mut line),
        )
        .await
        .map_err(|_| format!("no echo of {text:?} in time"))?;
        match read {
            Ok(0) => return Err(format!("the output ended before the echo of {text:?}")),
            Ok(_) if line.trim_end() == text => return Ok(()),
            Ok(_) => {}
            Err(error) => return Err(format!("read: {error} ({:?})", Error::from_io(&error))),
        }
    }
}

/// Sends `bytes` on a fresh connection to `addr`, then reads (and ignores) whatever comes back
/// for a moment, as an attacker replaying a capture would.
async fn replay(addr: SocketAddr, bytes: &[u8]) {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let _ = stream.write_all(bytes).await;
    let mut sink = vec![0u8; 64 * 1024];
    let _ = tokio::time::timeout(Duration::from_millis(500), async {
        while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await;
}

/// Where the old protocol's hello kept its epoch: after the 6-byte header and the generation.
const CLEARTEXT_EPOCH_OFFSET: usize = 6 + 8;

/// Captured bytes of a real exchange (the broker's side: its hello, then input), replayed
/// verbatim and with the place a cleartext hello keeps its epoch set to `2^64 - 1`, neither
/// take the stream over nor lock the broker out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_exchange_with_a_larger_epoch_neither_takes_over_nor_locks_the_broker_out() {
    let relay = RelayProcess::start(
        common::session("replayed"),
        &["cat".into()],
        RelayOptions::default(),
    )
    .await;
    let addr = relay.tcp.expect("tcp");
    let recording = Recording::new(addr);
    let (mut current, _) = relay
        .attach_with(relay.config(5), Arc::clone(&recording) as Arc<dyn Connector>)
        .await
        .expect("attach");
    round_trip(&mut current, "before")
        .await
        .expect("the broker's stream works");

    let captured = recording.sent();
    assert!(
        captured.len() > CLEARTEXT_EPOCH_OFFSET + 8,
        "an exchange was captured"
    );
    replay(addr, &captured).await;
    let mut larger_epoch = captured.clone();
    larger_epoch[CLEARTEXT_EPOCH_OFFSET..CLEARTEXT_EPOCH_OFFSET + 8].copy_from_slice(&u64::MAX.to_be_bytes());
    replay(addr, &larger_epoch).await;

    round_trip(&mut current, "after the replays")
        .await
        .expect("the replays did not take the broker's stream over");
    assert_eq!(
        recording.connects.load(Ordering::SeqCst),
        1,
        "the broker's connection was never replaced"
    );
    drop(current);
    // A broker restarted with the next epoch still gets in: nobody pushed the epoch.
    let (mut restarted, _) = relay
        .attach_with(relay.config(6), relay.connector())
        .await
        .expect("a newer broker is not locked out");
    round_trip(&mut restarted, "restarted").await.expect("round trip");
}

/// A holder of the token (not only an eavesdropper) cannot claim an epoch far ahead of the
/// relay's clock and so fence every broker for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_holder_cannot_push_the_epoch_past_the_brokers() {
    let relay = RelayProcess::start(
        common::session("pushed"),
        &["cat".into()],
        RelayOptions::default(),
    )
    .await;
    let config = relay.config(u64::MAX).give_up_after(Duration::from_secs(1));
    let pushed = relay.attach_with(config, relay.connector()).await;
    assert!(pushed.is_err(), "an epoch of 2^64-1 must be refused");
    // The broker, whose epoch is its start time, attaches and works.
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis();
    let epoch = u64::try_from(now_ms).expect("fits");
    let (mut broker, _) = relay
        .attach_with(relay.config(epoch), relay.connector())
        .await
        .expect("the broker is not locked out");
    round_trip(&mut broker, "still mine").await.expect("round trip");
}

/// A plain listener at the address the broker dials (a reused Pod IP) that answers whatever it
/// receives with a welcome of the right generation: the broker refuses it, and it receives
/// neither the token nor a byte of input.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_impostor_listener_receives_no_input_and_no_token() {
    let session = common::session("impostor");
    let generation = 3;
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.expect("bind");
    let addr = listener.local_addr().expect("address");
    let received = Arc::new(Mutex::new(Vec::<u8>::new()));
    let impostor = {
        let received = Arc::clone(&received);
        tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    return;
                };
                let received = Arc::clone(&received);
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    let take =
                        |stream_bytes: &[u8]| received.lock().expect("lock").extend_from_slice(stream_bytes);
                    // Whatever the broker says first, then a welcome that echoes its generation.
                    if let Ok(Ok(n)) =
                        tokio::time::timeout(Duration::from_millis(300), stream.read(&mut buf)).await
                    {
                        take(&buf[..n]);
                    }
                    let welcome = Frame::Welcome(Welcome {
                        generation,
                        input_acked: 0,
                        output_first: 1,
                        pid: 1,
                        started: true,
                        exited: false,
                        working_dir: "/workspace".into(),
                    });
                    let _ = stream.write_all(&welcome.to_bytes().expect("encode")).await;
                    let _ = tokio::time::timeout(Duration::from_secs(3), async {
                        while let Ok(n) = stream.read(&mut buf).await {
                            if n == 0 {
                                break;
                            }
                            take(&buf[..n]);
                        }
                    })
                    .await;
                });
            }
        })
    };
    let token = common::key().token(session.as_str(), generation);
    let config = ClientConfig::new(session, generation, 5, token)
        .backoff(Duration::from_millis(5), Duration::from_millis(100))
        .give_up_after(Duration::from_secs(2));
    let (fence, _trigger) = Fence::new(session, generation);
    let attached = within(
        "attach to the impostor",
        RelayClient::new(config, Arc::new(TcpConnector::new(addr.to_string()))).attach(fence),
    )
    .await;
    let prompt = "the session's secret prompt";
    let refused = match attached {
        Ok(attachment) => {
            let _ = attachment.input().write_line(prompt).await;
            tokio::time::sleep(Duration::from_millis(500)).await;
            None
        }
        Err(error) => Some(error),
    };
    let received = received.lock().expect("lock").clone();
    impostor.abort();
    assert!(
        !contains(&received, token.as_bytes()),
        "the impostor received the token"
    );
    assert!(
        !contains(&received, prompt.as_bytes()),
        "the impostor received input"
    );
    match refused {
        Some(Error::Backend { retryable: false, .. }) => {}
        other => panic!("the broker must refuse the impostor, got {other:?}"),
    }
}

/// A real `oab-relay` holding another secret (another broker key's token hash) at the address
/// the broker dials: the broker refuses it, and it never sees the broker's token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_with_the_wrong_secret_is_refused_and_never_sees_the_token() {
    let session = common::session("wrong-secret");
    let other_key = BrokerKey::new(b"another installation's broker key".to_vec());
    let relay = RelayProcess::start(
        session,
        &["cat".into()],
        RelayOptions {
            token_hash: Some(other_key.token(session.as_str(), 1).hash().to_hex()),
            ..RelayOptions::default()
        },
    )
    .await;
    let recording = Recording::new(relay.tcp.expect("tcp"));
    let config = relay.config(5).give_up_after(Duration::from_secs(2));
    let attached = relay
        .attach_with(config, Arc::clone(&recording) as Arc<dyn Connector>)
        .await;
    let token = common::key().token(session.as_str(), 1);
    assert!(
        !contains(&recording.sent(), token.as_bytes()),
        "the broker's token reached a relay that does not hold its secret"
    );
    match attached {
        Err(Error::Backend { retryable: false, .. }) => {}
        other => panic!("the broker must refuse the relay, got {:?}", other.map(|_| ())),
    }
}

/// A client with a wrong token (and so the wrong channel key) learns nothing of the relay's
/// generation: not in the relay's bytes, not in the error it gets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_with_a_wrong_token_learns_no_generation() {
    let generation = 48_879_123;
    let session = common::session("fishing");
    let relay = RelayProcess::start(
        session,
        &["cat".into()],
        RelayOptions {
            generation,
            ..RelayOptions::default()
        },
    )
    .await;
    let recording = Recording::new(relay.tcp.expect("tcp"));
    let fishing_key = BrokerKey::new(b"a guess".to_vec());
    let config = ClientConfig::with_key(session, 1, 5, &fishing_key)
        .backoff(Duration::from_millis(5), Duration::from_millis(100))
        .give_up_after(Duration::from_secs(2));
    let (fence, _trigger) = Fence::new(session, 1);
    let attached = within(
        "the fishing attach",
        RelayClient::new(config, Arc::clone(&recording) as Arc<dyn Connector>).attach(fence),
    )
    .await;
    let error = match attached {
        Ok(_) => panic!("a wrong token must not attach"),
        Err(error) => error,
    };
    let mut told = format!("{error} {error:?}");
    let mut source = std::error::Error::source(&error);
    while let Some(inner) = source {
        told.push_str(&format!(" {inner}"));
        source = inner.source();
    }
    let decimal = generation.to_string();
    assert!(
        !told.contains(&decimal),
        "the error discloses the generation: {told}"
    );
    let received = recording.received();
    assert!(
        !contains(&received, decimal.as_bytes()) && !contains(&received, &generation.to_be_bytes()),
        "the relay's bytes disclose the generation: {:?}",
        String::from_utf8_lossy(&received)
    );
}

/// Whether something already listens on the default port (then the test cannot start a relay
/// on it).
fn default_port_taken() -> bool {
    // One at a time: an IPv6 wildcard may be dual-stack and clash with the IPv4 one.
    let port = worker_relay::server::DEFAULT_PORT;
    std::net::TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).is_err()
        || std::net::TcpListener::bind((Ipv6Addr::UNSPECIFIED, port)).is_err()
}

/// The relay's default listener (what a worker Pod runs) is reached by an IPv6 client (a
/// broker dialing an IPv6 Pod IP) and by an IPv4 one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_listener_is_reached_over_ipv6_and_ipv4() {
    if std::net::TcpListener::bind((Ipv6Addr::LOCALHOST, 0)).is_err() {
        eprintln!("skipped: this host has no IPv6 loopback");
        return;
    }
    if default_port_taken() {
        eprintln!("skipped: port {} is in use", worker_relay::server::DEFAULT_PORT);
        return;
    }
    let relay = RelayProcess::start(
        common::session("dual-stack"),
        &["cat".into()],
        RelayOptions {
            default_listener: true,
            ..RelayOptions::default()
        },
    )
    .await;
    let port = relay.tcp.expect("the default listener").port();
    for (epoch, host) in [
        (5, format!("[{}]", Ipv6Addr::LOCALHOST)),
        (6, Ipv4Addr::LOCALHOST.to_string()),
    ] {
        let connector: Arc<dyn Connector> = Arc::new(TcpConnector::new(format!("{host}:{port}")));
        let config = relay.config(epoch).give_up_after(Duration::from_secs(2));
        let (mut attachment, _) = relay
            .attach_with(config, connector)
            .await
            .unwrap_or_else(|error| panic!("a client on {host} reaches the relay: {error}"));
        round_trip(&mut attachment, &format!("over {host}"))
            .await
            .expect("round trip");
    }
}
