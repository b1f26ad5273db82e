//! Reliability, measured: exactly-once delivery across random transport drops, cancel under a
//! slow reader, and the relay's memory with a full replay buffer.

mod common;

use std::time::{Duration, Instant};

use common::proxy::FaultProxy;
use common::{sh, within, RelayOptions, RelayProcess};
use session_runtime::WorkerExit;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

/// An ACP-shaped line (a `session/update` notification) of varying length.
fn acp_line(i: usize) -> String {
    let filler = "x".repeat((i * 7919) % 700);
    format!(
        r#"{{"jsonrpc":"2.0","method":"session/update","params":{{"sessionId":"s","update":{{"sessionUpdate":"agent_message_chunk","content":{{"type":"text","text":"line {i} {filler}"}}}}}}}}"#
    )
}

async fn lines_across_drops(lines: usize, cuts: usize, mean_bytes: usize, seed: u64) {
    common::init_tracing();
    let relay = RelayProcess::start(
        common::session("drops"),
        &["cat".into()],
        RelayOptions {
            http: true,
            ..RelayOptions::default()
        },
    )
    .await;
    let http = relay.http.expect("http");
    let proxy = FaultProxy::start(relay.tcp.expect("tcp"), seed, cuts, mean_bytes).await;
    let config = relay
        .config(1)
        .backoff(Duration::from_millis(1), Duration::from_millis(20));
    let (attachment, _) = relay
        .attach_with(config, proxy.connector())
        .await
        .expect("attach through the proxy");
    let started = Instant::now();
    let (output, input, control) = attachment.into_split();
    let writer = tokio::spawn(async move {
        for i in 0..lines {
            input.write_line(acp_line(i)).await.expect("write");
            // A steady conversation rather than one burst, so drops land all along the stream.
            if i % 25 == 24 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        input.close().await.expect("close");
    });
    let mut reader = BufReader::new(output).lines();
    let mut lines_at_last_cut = None;
    for i in 0..lines {
        if lines_at_last_cut.is_none() && proxy.cuts() >= cuts {
            lines_at_last_cut = Some(i);
        }
        let line = match tokio::time::timeout(Duration::from_secs(10), reader.next_line()).await {
            Ok(line) => line
                .expect("read")
                .unwrap_or_else(|| panic!("output ended after {i} lines")),
            Err(_) => panic!("stuck at line {i}: relay {}", invocations(http).await),
        };
        assert_eq!(line, acp_line(i), "line {i} must arrive exactly once, in order");
    }
    assert_eq!(
        within("eof", reader.next_line()).await.expect("read"),
        None,
        "nothing after the last line"
    );
    writer.await.expect("writer");
    assert_eq!(
        within("exit", control.wait()).await.expect("wait"),
        WorkerExit::Code(0)
    );
    let stats = &proxy.stats;
    let load = |n: &std::sync::atomic::AtomicUsize| n.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!(
        "{lines} lines each way in {:?}: {} connections, {} drops ({} towards the relay, {} towards the broker, {} mid-frame), the last after {} lines",
        started.elapsed(),
        load(&stats.connections),
        load(&stats.cuts),
        load(&stats.cuts_to_relay),
        load(&stats.cuts_to_broker),
        load(&stats.cuts_mid_frame),
        lines_at_last_cut.unwrap_or(lines),
    );
    assert!(load(&stats.cuts) >= cuts, "the proxy must have cut {cuts} times");
    assert!(load(&stats.cuts_to_relay) > 0 && load(&stats.cuts_to_broker) > 0);
    assert!(load(&stats.cuts_mid_frame) > 0, "some cuts fall inside a frame");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_lines_each_way_across_200_drops_arrive_exactly_once_in_order() {
    lines_across_drops(10_000, 200, 20 * 1024, 0x5eed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "heavy: 100,000 lines across 2,000 drops; run with `cargo test -p worker-relay --release --test reliability -- --ignored`"]
async fn heavy_hundred_thousand_lines_across_2000_drops() {
    lines_across_drops(100_000, 2_000, 16 * 1024, 0xfeed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_reaches_the_agent_while_50_mb_stream_to_a_slow_reader() {
    let agent = common::acp_test_agent();
    let relay = RelayProcess::start(
        common::session("cancel"),
        &[agent.into()],
        RelayOptions::default(),
    )
    .await;
    let mut attachment = relay.attach().await;
    let cwd = attachment.working_dir().to_owned();
    let input = attachment.input();
    let mut lines = BufReader::new(attachment.output()).lines();
    input
        .write_line(r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":1}}"#)
        .await
        .expect("write");
    within("initialize", lines.next_line()).await.expect("read");
    input
        .write_line(format!(
            r#"{{"jsonrpc":"2.0","id":2,"method":"session/new","params":{{"cwd":{cwd:?},"mcpServers":[]}}}}"#
        ))
        .await
        .expect("write");
    let answer = within("session/new", lines.next_line())
        .await
        .expect("read")
        .expect("answer");
    let session = answer
        .split("\"sessionId\":\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .expect("session id")
        .to_owned();
    // 800 chunks of 64 KiB: 50 MiB.
    input
        .write_line(format!(
            r#"{{"jsonrpc":"2.0","id":3,"method":"session/prompt","params":{{"sessionId":"{session}","prompt":[{{"type":"text","text":"/chunks=800 /size=65536 /delay_ms=2 flood"}}]}}}}"#
        ))
        .await
        .expect("write prompt");
    // Read slowly: a few chunks with pauses, then nothing for a while, so that megabytes of
    // output pile up in the relay's buffer, the pipes and the sockets.
    let mut chunks = 0;
    while chunks < 5 {
        let line = within("chunk", lines.next_line())
            .await
            .expect("read")
            .expect("line");
        if line.contains("agent_message_chunk") {
            chunks += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let cancel =
        format!(r#"{{"jsonrpc":"2.0","method":"session/cancel","params":{{"sessionId":"{session}"}}}}"#);
    let sent = Instant::now();
    within(
        "cancel written while the output is undrained",
        input.write_line(cancel),
    )
    .await
    .expect("write cancel");
    let write_took = sent.elapsed();
    let stop = loop {
        let line = within("drain", lines.next_line())
            .await
            .expect("read")
            .expect("line");
        if line.contains("agent_message_chunk") {
            chunks += 1;
        } else if line.contains(r#""id":3"#) {
            break line;
        }
    };
    eprintln!(
        "cancel written in {write_took:?}; the turn ended after {chunks} of 800 chunks ({} MiB of 50)",
        chunks * 64 / 1024
    );
    assert!(stop.contains("cancelled"), "the turn must end cancelled: {stop}");
    assert!(chunks < 800, "the cancel must stop the stream early");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_memory_with_a_full_replay_buffer_stays_within_its_bound() {
    const REPLAY: usize = 8 << 20;
    let dir = tempfile::tempdir().expect("tempdir");
    let relay = RelayProcess::start(
        common::session("memory"),
        &sh("read x; head -c 100000000 /dev/zero"),
        RelayOptions {
            http: true,
            workdir: Some(dir.path().to_path_buf()),
            extra: vec!["--replay-bytes".into(), REPLAY.to_string()],
            ..RelayOptions::default()
        },
    )
    .await;
    let relay_pid = relay.child.id().expect("pid");
    let baseline = vm_kib(relay_pid, "VmRSS:");
    // A broker that triggers the output and then never reads.
    let attachment = relay.attach().await;
    attachment.input().write_line("go").await.expect("write");
    let http = relay.http.expect("http");
    let buffered = within("the replay buffer fills", async {
        loop {
            let body = invocations(http).await;
            let buffered: usize = body
                .split("\"buffered_bytes\":")
                .nth(1)
                .and_then(|rest| rest.split([',', '}']).next())
                .and_then(|n| n.parse().ok())
                .expect("buffered_bytes");
            if buffered >= REPLAY {
                break buffered;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let rss = vm_kib(relay_pid, "VmRSS:");
    let peak = vm_kib(relay_pid, "VmHWM:");
    eprintln!(
        "replay bound {} KiB, buffered {} KiB; relay RSS {rss} KiB (peak {peak} KiB, {baseline} KiB before any agent)",
        REPLAY / 1024,
        buffered / 1024,
    );
    assert!(
        buffered <= REPLAY + 256 * 1024 + 64,
        "the buffer exceeds its bound: {buffered}"
    );
    // The buffer, one read, and the relay itself (a debug build, plus socket and allocator slack).
    let bound_kib = (REPLAY / 1024) + baseline + 16 * 1024;
    assert!(peak <= bound_kib, "peak RSS {peak} KiB above {bound_kib} KiB");
    drop(attachment);
}

fn vm_kib(pid: u32, field: &str) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("field in /proc status")
}

async fn invocations(addr: std::net::SocketAddr) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(b"POST /invocations HTTP/1.1\r\nHost: relay\r\nContent-Length: 0\r\n\r\n")
        .await
        .expect("request");
    let mut response = String::new();
    stream.read_to_string(&mut response).await.expect("response");
    response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default()
}

/// An echo agent whose output the broker reads only later: the relay's replay buffer fills, the
/// agent blocks on its stdout and stops reading its stdin, and the broker's acknowledgements (and
/// anything else) queue behind input the agent does not read. The relay must still take them, or
/// nothing ever moves again (over a pipe the same pattern completes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn input_the_agent_does_not_read_never_holds_up_the_acknowledgements_behind_it() {
    const LINES: usize = 96;
    const LINE: usize = 64 * 1024;
    let relay = RelayProcess::start(
        common::session("head-of-line"),
        &["cat".into()],
        RelayOptions {
            extra: vec!["--replay-bytes".into(), "65536".into()],
            ..RelayOptions::default()
        },
    )
    .await;
    let attachment = relay.attach().await;
    let (mut output, input, _control) = attachment.into_split();
    let writer = tokio::spawn(async move {
        let line = "x".repeat(LINE - 1);
        for _ in 0..LINES {
            input.write_line(&line).await.expect("write");
        }
    });
    // Let the input pile up against the blocked agent before reading anything.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut received = 0usize;
    let mut buffer = vec![0u8; 256 * 1024];
    within("reading the whole echo", async {
        while received < LINES * LINE {
            let n = output.read(&mut buffer).await.expect("read");
            assert!(n > 0, "the output ended after {received} bytes");
            received += n;
        }
    })
    .await;
    within("the writer", writer).await.expect("writer");
    assert_eq!(received, LINES * LINE);
}
