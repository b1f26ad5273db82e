//! Fencing and refusals: every bad hello gets its own error code and leaves the current
//! connection alone; a newer epoch takes over; replay overflow is an explicit `resume-gap`.

mod common;

use std::collections::HashSet;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use common::{sh, within, RelayOptions, RelayProcess};
use session_runtime::{Attachment, Error};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use worker_relay::protocol::{Frame, FrameReader, Hello, Peer, HEADER_LEN};
use worker_relay::{BrokerKey, Connector, ErrorCode, TcpConnector, Transport};

/// A TCP connector that counts connections and records the first bytes of the first one.
#[derive(Debug)]
struct Recording {
    inner: TcpConnector,
    connects: AtomicUsize,
    first_bytes: Arc<Mutex<Vec<u8>>>,
}

#[async_trait]
impl Connector for Recording {
    async fn connect(&self) -> io::Result<Transport> {
        let stream = self.inner.connect().await?;
        let first = self.connects.fetch_add(1, Ordering::SeqCst) == 0;
        Ok(Box::new(Tee {
            inner: stream,
            record: first.then(|| Arc::clone(&self.first_bytes)),
        }))
    }
}

struct Tee {
    inner: Transport,
    record: Option<Arc<Mutex<Vec<u8>>>>,
}

impl AsyncRead for Tee {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Tee {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let (Poll::Ready(Ok(n)), Some(record)) = (&written, &self.record) {
            let mut record = record.lock().expect("lock");
            if record.len() < 4096 {
                record.extend_from_slice(&buf[..*n]);
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

/// Sends `bytes` on a fresh connection and returns the relay's first frame.
async fn first_reply(relay: &RelayProcess, bytes: &[u8]) -> Frame {
    let mut stream = relay.open_channel().await;
    stream.write_all(bytes).await.expect("send");
    stream.flush().await.expect("flush");
    let mut reader = FrameReader::new(stream, Peer::Relay);
    within("reply", reader.next())
        .await
        .expect("a frame")
        .expect("a reply before close")
}

fn hello(relay: &RelayProcess, epoch: u64, nonce: u64) -> Hello {
    Hello {
        session: relay.session.as_str().to_owned(),
        generation: relay.generation,
        epoch,
        nonce,
        resume: 0,
        token: common::key().token(relay.session.as_str(), relay.generation),
    }
}

async fn round_trip(attachment: &mut Attachment, text: &str) {
    round_trip_after(attachment, text, &[]).await;
}

/// Writes `text` and reads its echo, accepting first any of `replayed`: output a previous
/// broker received but had not acknowledged yet is replayed to the broker that takes over.
async fn round_trip_after(attachment: &mut Attachment, text: &str, replayed: &[&str]) {
    attachment.input().write_line(text).await.expect("write");
    let mut reader = tokio::io::BufReader::new(attachment.output());
    loop {
        let mut line = String::new();
        within(
            "echo",
            tokio::io::AsyncBufReadExt::read_line(&mut reader, &mut line),
        )
        .await
        .expect("read");
        let line = line.trim_end();
        if line == text {
            return;
        }
        assert!(
            replayed.contains(&line),
            "unexpected output {line:?} before {text:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_bad_hello_has_its_own_code_and_the_current_connection_survives() {
    let relay = RelayProcess::start(
        common::session("refusals"),
        &["cat".into()],
        RelayOptions::default(),
    )
    .await;
    let recording = Arc::new(Recording {
        inner: TcpConnector::new(relay.tcp.expect("tcp").to_string()),
        connects: AtomicUsize::new(0),
        first_bytes: Arc::default(),
    });
    let (mut current, _) = relay
        .attach_with(relay.config(5), Arc::clone(&recording) as Arc<dyn Connector>)
        .await
        .expect("attach");
    round_trip(&mut current, "before").await;

    // What a holder of the token could send inside a channel of its own.
    let mut other_session = hello(&relay, 5, u64::MAX);
    other_session.session = common::session("elsewhere").as_str().to_owned();
    // The token checks first: a stale generation is reported only to a holder of this one's.
    let mut stale_generation = hello(&relay, 5, u64::MAX);
    stale_generation.generation = relay.generation + 1;
    let mut wrong_token = hello(&relay, 9, u64::MAX);
    wrong_token.token =
        BrokerKey::new(b"another broker's key".to_vec()).token(relay.session.as_str(), relay.generation);
    let older_epoch = hello(&relay, 4, u64::MAX);
    // The current broker's epoch with a nonce it already used: a hello sent again.
    let replayed = hello(&relay, 5, 0);
    let far_ahead = hello(&relay, u64::MAX, u64::MAX);
    let mut unsupported = Frame::Ping { nonce: 1 }.to_bytes().expect("encode").to_vec();
    unsupported[0] = 2;

    let cases: Vec<(&str, Vec<u8>, ErrorCode)> = vec![
        (
            "stale generation",
            Frame::Hello(stale_generation)
                .to_bytes()
                .expect("encode")
                .to_vec(),
            ErrorCode::StaleGeneration,
        ),
        (
            "older epoch",
            Frame::Hello(older_epoch).to_bytes().expect("encode").to_vec(),
            ErrorCode::StaleEpoch,
        ),
        (
            "wrong token",
            Frame::Hello(wrong_token).to_bytes().expect("encode").to_vec(),
            ErrorCode::BadToken,
        ),
        (
            "replayed hello",
            Frame::Hello(replayed).to_bytes().expect("encode").to_vec(),
            ErrorCode::ReplayedHello,
        ),
        (
            "epoch far ahead of the relay's clock",
            Frame::Hello(far_ahead).to_bytes().expect("encode").to_vec(),
            ErrorCode::EpochAhead,
        ),
        (
            "garbage bytes",
            b"\x00\x17\xffgarbage that is no frame at all\r\n\r\n".to_vec(),
            ErrorCode::BadFrame,
        ),
        (
            "another session",
            Frame::Hello(other_session).to_bytes().expect("encode").to_vec(),
            ErrorCode::SessionMismatch,
        ),
        (
            "another protocol version",
            unsupported,
            ErrorCode::UnsupportedVersion,
        ),
        (
            "no hello first",
            Frame::Ack { seq: 1 }.to_bytes().expect("encode").to_vec(),
            ErrorCode::UnexpectedFrame,
        ),
        (
            "oversized frame",
            vec![1, 3, 0x7f, 0xff, 0xff, 0xff],
            ErrorCode::FrameTooLarge,
        ),
    ];
    let mut codes = HashSet::new();
    for (what, bytes, expected) in cases {
        match first_reply(&relay, &bytes).await {
            Frame::Error { code, message } => {
                assert_eq!(code, expected, "{what}: {message}");
                assert!(codes.insert(code), "{what}: code {code} was already used");
            }
            other => panic!("{what}: expected an error frame, got {other:?}"),
        }
        round_trip(&mut current, what).await;
    }
    assert_eq!(
        recording.connects.load(Ordering::SeqCst),
        1,
        "the current connection was never replaced"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_epoch_takes_over_and_an_older_one_is_fenced() {
    let relay = RelayProcess::start(
        common::session("epochs"),
        &["cat".into()],
        RelayOptions::default(),
    )
    .await;
    let (mut old, _) = relay
        .attach_with(relay.config(5), relay.connector())
        .await
        .expect("attach epoch 5");
    round_trip(&mut old, "old").await;
    let (mut new, _) = relay
        .attach_with(relay.config(6), relay.connector())
        .await
        .expect("attach epoch 6");
    round_trip_after(&mut new, "new", &["old"]).await;
    let mut buf = [0u8; 16];
    let error = within("fenced read", old.output().read(&mut buf))
        .await
        .expect_err("the old broker's stream ends");
    match Error::from_io(&error) {
        Some(Error::Fenced { .. }) => {}
        other => panic!("expected Fenced, got {other:?} ({error})"),
    }
    match old.input().write_line("still there?").await {
        Err(Error::Fenced { .. }) => {}
        other => panic!("a write of the taken-over broker must be Fenced, got {other:?}"),
    }
    match relay.attach_with(relay.config(5), relay.connector()).await {
        Err(Error::Fenced { .. }) => {}
        other => panic!("an older epoch must be fenced, got {:?}", other.map(|_| ())),
    }
    round_trip(&mut new, "unharmed").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overflow_while_detached_is_an_explicit_resume_gap() {
    let dir = tempfile::tempdir().expect("tempdir");
    let relay = RelayProcess::start(
        common::session("gap"),
        &sh("read x; head -c 8000000 /dev/zero | tr '\\000' x; echo; touch done; exec cat"),
        RelayOptions {
            workdir: Some(dir.path().to_path_buf()),
            extra: vec![
                "--overflow".into(),
                "discard".into(),
                "--replay-bytes".into(),
                "65536".into(),
            ],
            ..RelayOptions::default()
        },
    )
    .await;
    let (first, _) = relay
        .attach_with(relay.config(1).output_buffer(16 * 1024), relay.connector())
        .await
        .expect("attach");
    first.input().write_line("go").await.expect("write");
    drop(first);
    let done = dir.path().join("done");
    within("agent finished its output", async {
        while !done.exists() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    match relay.attach_with(relay.config(2), relay.connector()).await {
        Err(Error::Disconnected { .. }) => {}
        other => panic!(
            "dropped output must give resume-gap (Disconnected), got {:?}",
            other.map(|_| ())
        ),
    }
    // The refusal is explicit on the wire too.
    match first_reply(
        &relay,
        &Frame::Hello(hello(&relay, 3, 1)).to_bytes().expect("encode"),
    )
    .await
    {
        Frame::Error {
            code: ErrorCode::ResumeGap,
            ..
        } => {}
        other => panic!("expected resume-gap, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_buffer_blocks_the_agent_and_loses_nothing() {
    let relay = RelayProcess::start(
        common::session("block"),
        &sh("read x; head -c 4000000 /dev/zero | tr '\\000' x; echo; exec cat"),
        RelayOptions {
            extra: vec!["--replay-bytes".into(), "262144".into()],
            ..RelayOptions::default()
        },
    )
    .await;
    // A broker that sends the trigger and never acknowledges anything, then vanishes.
    {
        let mut raw = relay.open_channel().await;
        raw.write_all(&Frame::Hello(hello(&relay, 1, 1)).to_bytes().expect("encode"))
            .await
            .expect("hello");
        raw.flush().await.expect("flush");
        let go = Frame::Data {
            seq: 1,
            payload: bytes::Bytes::from_static(b"go\n"),
        };
        raw.write_all(&go.to_bytes().expect("encode")).await.expect("go");
        raw.flush().await.expect("flush");
        let mut welcome = [0u8; HEADER_LEN];
        raw.read_exact(&mut welcome).await.expect("welcome header");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (mut attachment, _) = relay
        .attach_with(relay.config(2), relay.connector())
        .await
        .expect("attach");
    let mut line = Vec::new();
    let mut reader = tokio::io::BufReader::new(attachment.output());
    within(
        "the whole output",
        tokio::io::AsyncBufReadExt::read_until(&mut reader, b'\n', &mut line),
    )
    .await
    .expect("read");
    assert_eq!(line.len(), 4_000_001, "every byte, exactly once");
    assert!(line[..4_000_000].iter().all(|b| *b == b'x'));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_input_is_dropped_and_a_gap_is_refused() {
    let relay = RelayProcess::start(common::session("dups"), &["cat".into()], RelayOptions::default()).await;
    let stream = relay.open_channel().await;
    let (read_half, mut write_half) = tokio::io::split(stream);
    let mut reader = FrameReader::new(read_half, Peer::Relay);
    let data = |seq: u64, text: &'static str| {
        Frame::Data {
            seq,
            payload: bytes::Bytes::from_static(text.as_bytes()),
        }
        .to_bytes()
        .expect("encode")
    };
    write_half
        .write_all(&Frame::Hello(hello(&relay, 1, 1)).to_bytes().expect("encode"))
        .await
        .expect("hello");
    write_half.flush().await.expect("flush");
    for frame in [data(1, "a\n"), data(1, "a\n"), data(2, "b\n"), data(1, "a\n")] {
        write_half.write_all(&frame).await.expect("send");
        write_half.flush().await.expect("flush");
    }
    let mut echoed = Vec::new();
    let mut acked = 0;
    while echoed != b"a\nb\n" || acked < 2 {
        match within("frame", reader.next()).await.expect("frame") {
            Some(Frame::Data { payload, .. }) => echoed.extend_from_slice(&payload),
            Some(Frame::Ack { seq }) => acked = seq,
            Some(_) => {}
            None => panic!("closed early"),
        }
        assert!(echoed.len() <= 4, "a duplicate reached the agent: {echoed:?}");
    }
    assert_eq!(acked, 2, "duplicates take no sequence numbers");
    write_half.write_all(&data(4, "gap\n")).await.expect("send");
    write_half.flush().await.expect("flush");
    loop {
        match within("frame", reader.next()).await.expect("frame") {
            Some(Frame::Error { code, .. }) => {
                assert_eq!(code, ErrorCode::OutOfOrder);
                break;
            }
            Some(Frame::Data { payload, .. }) => panic!("unexpected output {payload:?}"),
            Some(_) => {}
            None => panic!("closed without an error"),
        }
    }
}

/// A client whose input window is larger than the relay's input bound (here: an agent that
/// never reads, a 64 KiB bound, the default 1 MiB window) is refused with `input-overflow`, which
/// the attachment reports as a non-retryable backend error, never as silent loss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn input_beyond_the_relay_bound_is_refused_as_input_overflow() {
    let relay = RelayProcess::start(
        common::session("input-overflow"),
        &sh("exec sleep 30"),
        RelayOptions {
            extra: vec!["--input-bytes".into(), "65536".into()],
            ..RelayOptions::default()
        },
    )
    .await;
    let mut attachment = relay.attach().await;
    let input = attachment.input();
    let line = "y".repeat(32 * 1024);
    // The writes are taken by the client's window; the relay refuses once 64 KiB are unwritten.
    // The agent's stdin pipe (the relay asks for 1 MiB) takes the first megabyte whatever the
    // agent does, so write past it: how the input arrives (one read or one record at a time)
    // must not decide whether the bound is reached.
    for _ in 0..48 {
        if input.write_line(&line).await.is_err() {
            break;
        }
    }
    let mut buf = [0u8; 16];
    let error = within("the refusal", attachment.output().read(&mut buf))
        .await
        .expect_err("the stream ends with the refusal");
    match Error::from_io(&error) {
        Some(Error::Backend {
            retryable: false,
            message,
            ..
        }) => assert!(message.contains("input"), "{message}"),
        other => panic!("expected a non-retryable backend error, got {other:?} ({error})"),
    }
}

/// Connects through `inner`; the first transport turns into a black hole once `frozen` is set
/// (reads never complete, writes vanish, nothing closes), as a dead NAT entry or a stalled load
/// balancer looks to the broker.
#[derive(Debug)]
struct Freezing {
    inner: Arc<dyn Connector>,
    connects: AtomicUsize,
    frozen: Arc<std::sync::atomic::AtomicBool>,
}

#[async_trait]
impl Connector for Freezing {
    async fn connect(&self) -> io::Result<Transport> {
        let stream = self.inner.connect().await?;
        let first = self.connects.fetch_add(1, Ordering::SeqCst) == 0;
        Ok(Box::new(BlackHole {
            inner: stream,
            frozen: first.then(|| Arc::clone(&self.frozen)),
        }))
    }
}

struct BlackHole {
    inner: Transport,
    frozen: Option<Arc<std::sync::atomic::AtomicBool>>,
}

impl BlackHole {
    fn is_frozen(&self) -> bool {
        self.frozen.as_ref().is_some_and(|f| f.load(Ordering::SeqCst))
    }
}

impl AsyncRead for BlackHole {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.is_frozen() {
            return Poll::Pending;
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for BlackHole {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if self.is_frozen() {
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.is_frozen() {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A transport that goes silent without closing is noticed by the client's idle timeout (the
/// relay's heartbeats stop arriving), replaced, and the stream resumes: the line written into
/// the black hole is resent and echoed once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transport_that_goes_silent_is_replaced_and_the_stream_resumes() {
    let relay = RelayProcess::start(
        common::session("frozen"),
        &["cat".into()],
        RelayOptions {
            extra: vec!["--heartbeat".into(), "100ms".into()],
            ..RelayOptions::default()
        },
    )
    .await;
    let frozen = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let connector = Arc::new(Freezing {
        inner: relay.connector(),
        connects: AtomicUsize::new(0),
        frozen: Arc::clone(&frozen),
    });
    let config = relay.config(1).heartbeat(Duration::from_millis(100));
    let (mut attachment, _) = relay
        .attach_with(config, Arc::<Freezing>::clone(&connector) as Arc<dyn Connector>)
        .await
        .expect("attach");
    round_trip(&mut attachment, "before the freeze").await;
    frozen.store(true, Ordering::SeqCst);
    round_trip(&mut attachment, "written into the black hole").await;
    round_trip(&mut attachment, "after").await;
    assert!(
        connector.connects.load(Ordering::SeqCst) >= 2,
        "the silent transport was replaced"
    );
}
