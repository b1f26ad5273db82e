//! Relay benchmarks, each against a baseline measured in the same run:
//!
//! - `round_trip_1kib`: one 1 KiB line through client, relay and an echo agent (`cat`), against
//!   the same `cat` over a raw pipe.
//! - `output_64kib`: agent output read in 64 KiB chunks through relay and client, against the
//!   same chunks over raw loopback TCP.
//! - `echo_64kib`: 64 KiB chunks written to and read back from an echo agent through the relay,
//!   against a TCP echo server over loopback.
//! - the relay's memory (VmRSS, VmHWM) with a full replay buffer, printed once.
//!
//! Run: `cargo bench -p worker-relay --bench relay`. The ratios of the medians (relay /
//! baseline) are printed at the end.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use session_runtime::{Fence, SessionIdentity};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, Command};
use tokio::runtime::Runtime;
use worker_relay::{BrokerKey, ClientConfig, RelayClient, TcpConnector};

const RELAY: &str = env!("CARGO_BIN_EXE_oab-relay");
const CHUNK: usize = 64 * 1024;
const CHUNKS: usize = 64;

fn key() -> BrokerKey {
    BrokerKey::new(b"worker-relay-bench-broker-key-32".to_vec())
}

/// A relay process and an attachment to it.
struct Relay {
    child: Child,
    attachment: session_runtime::Attachment,
    http: Option<SocketAddr>,
}

async fn start(agent: &[&str], extra: &[&str]) -> Relay {
    let id = SessionIdentity::new(
        "bench",
        "agent",
        "bench",
        format!("{}-{agent:?}", std::process::id()),
    )
    .expect("identity")
    .id();
    let mut child = Command::new(RELAY)
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(extra)
        .arg("--")
        .args(agent)
        .env("OAB_RELAY_SESSION", id.as_str())
        .env("OAB_RELAY_GENERATION", "1")
        .env(
            "OAB_RELAY_TOKEN_SHA256",
            key().token(id.as_str(), 1).hash().to_hex(),
        )
        .env("OAB_RELAY_LOG", "warn")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start the relay");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut tcp = None;
    let mut http = None;
    let listeners = if extra.contains(&"--http") { 2 } else { 1 };
    for _ in 0..listeners {
        let line = lines.next_line().await.expect("read").expect("listening line");
        let addr: SocketAddr = line
            .rsplit(' ')
            .next()
            .and_then(|a| a.parse().ok())
            .expect("address");
        if line.contains(" tcp ") {
            tcp = Some(addr);
        } else {
            http = Some(addr);
        }
    }
    let config = ClientConfig::with_key(id, 1, 1, &key());
    let (fence, trigger) = Fence::new(id, 1);
    // Never fenced during a benchmark.
    std::mem::forget(trigger);
    let attachment = RelayClient::new(
        config,
        Arc::new(TcpConnector::new(tcp.expect("tcp listener").to_string())),
    )
    .attach(fence)
    .await
    .expect("attach");
    Relay {
        child,
        attachment,
        http,
    }
}

fn round_trip(c: &mut Criterion, runtime: &Runtime) {
    let mut group = c.benchmark_group("round_trip_1kib");
    group.sample_size(100).measurement_time(Duration::from_secs(5));
    let text = "x".repeat(1023);

    let relay = runtime.block_on(start(&["cat"], &[]));
    let (output, input, _control) = relay.attachment.into_split();
    let mut reader = BufReader::new(output);
    let mut line = String::new();
    group.bench_function("relay", |b| {
        b.iter_custom(|iters| {
            runtime.block_on(async {
                let started = Instant::now();
                for _ in 0..iters {
                    input.write_line(&text).await.expect("write");
                    line.clear();
                    reader.read_line(&mut line).await.expect("read");
                    assert_eq!(line.len(), 1024);
                }
                started.elapsed()
            })
        })
    });
    drop(relay.child);

    let mut cat = runtime.block_on(async {
        Command::new("cat")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("cat")
    });
    let mut stdin = cat.stdin.take().expect("stdin");
    let mut stdout = BufReader::new(cat.stdout.take().expect("stdout"));
    let mut bytes = text.clone().into_bytes();
    bytes.push(b'\n');
    group.bench_function("raw_pipe", |b| {
        b.iter_custom(|iters| {
            runtime.block_on(async {
                let started = Instant::now();
                for _ in 0..iters {
                    stdin.write_all(&bytes).await.expect("write");
                    stdin.flush().await.expect("flush");
                    line.clear();
                    stdout.read_line(&mut line).await.expect("read");
                    assert_eq!(line.len(), 1024);
                }
                started.elapsed()
            })
        })
    });
    group.finish();
}

fn output_throughput(c: &mut Criterion, runtime: &Runtime) {
    let mut group = c.benchmark_group("output_64kib");
    group
        .sample_size(30)
        .measurement_time(Duration::from_secs(8))
        .throughput(Throughput::Bytes((CHUNK * CHUNKS) as u64));
    let mut buf = vec![0u8; CHUNK];

    let relay = runtime.block_on(start(&["cat", "/dev/zero"], &[]));
    let (mut output, _input, _control) = relay.attachment.into_split();
    group.bench_function("relay", |b| {
        b.iter_custom(|iters| {
            runtime.block_on(async {
                let started = Instant::now();
                for _ in 0..iters * CHUNKS as u64 {
                    output.read_exact(&mut buf).await.expect("read");
                }
                started.elapsed()
            })
        })
    });
    drop(relay.child);

    let mut stream = runtime.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.expect("accept");
            let _ = socket.set_nodelay(true);
            let zeros = vec![0u8; CHUNK];
            while socket.write_all(&zeros).await.is_ok() {}
        });
        let stream = TcpStream::connect(addr).await.expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        stream
    });
    group.bench_function("raw_tcp", |b| {
        b.iter_custom(|iters| {
            runtime.block_on(async {
                let started = Instant::now();
                for _ in 0..iters * CHUNKS as u64 {
                    stream.read_exact(&mut buf).await.expect("read");
                }
                started.elapsed()
            })
        })
    });
    group.finish();
}

fn echo_throughput(c: &mut Criterion, runtime: &Runtime) {
    let mut group = c.benchmark_group("echo_64kib");
    group
        .sample_size(30)
        .measurement_time(Duration::from_secs(8))
        .throughput(Throughput::Bytes((CHUNK * CHUNKS) as u64));
    let text = "x".repeat(CHUNK - 1);
    let mut buf = vec![0u8; CHUNK];

    let relay = runtime.block_on(start(&["cat"], &[]));
    let (mut output, input, _control) = relay.attachment.into_split();
    group.bench_function("relay", |b| {
        b.iter_custom(|iters| {
            runtime.block_on(async {
                let started = Instant::now();
                let total = iters as usize * CHUNKS;
                let writer = {
                    let input = input.clone();
                    let text = text.clone();
                    tokio::spawn(async move {
                        for _ in 0..total {
                            input.write_line(&text).await.expect("write");
                        }
                    })
                };
                for _ in 0..total {
                    output.read_exact(&mut buf).await.expect("read");
                }
                writer.await.expect("writer");
                started.elapsed()
            })
        })
    });
    drop(relay.child);

    let stream = runtime.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            let (socket, _) = listener.accept().await.expect("accept");
            let _ = socket.set_nodelay(true);
            let (mut read, mut write) = socket.into_split();
            let _ = tokio::io::copy(&mut read, &mut write).await;
        });
        let stream = TcpStream::connect(addr).await.expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        stream
    });
    let (mut read, write) = stream.into_split();
    let write = Arc::new(tokio::sync::Mutex::new(write));
    let mut chunk = text.into_bytes();
    chunk.push(b'\n');
    let chunk = Arc::new(chunk);
    group.bench_function("raw_tcp", |b| {
        b.iter_custom(|iters| {
            runtime.block_on(async {
                let started = Instant::now();
                let total = iters as usize * CHUNKS;
                let writer = {
                    let write = Arc::clone(&write);
                    let chunk = Arc::clone(&chunk);
                    tokio::spawn(async move {
                        let mut write = write.lock().await;
                        for _ in 0..total {
                            write.write_all(&chunk).await.expect("write");
                        }
                    })
                };
                for _ in 0..total {
                    read.read_exact(&mut buf).await.expect("read");
                }
                writer.await.expect("writer");
                started.elapsed()
            })
        })
    });
    group.finish();
}

/// Fills the default 16 MiB replay buffer (a broker that never reads) and reports the relay's
/// memory.
fn memory(runtime: &Runtime) {
    runtime.block_on(async {
        let relay = start(
            &["sh", "-c", "read x; exec cat /dev/zero"],
            &["--http", "127.0.0.1:0"],
        )
        .await;
        let pid = relay.child.id().expect("pid");
        let before = vm_kib(pid, "VmRSS:");
        relay.attachment.input().write_line("go").await.expect("write");
        let http = relay.http.expect("http");
        let deadline = Instant::now() + Duration::from_secs(30);
        let buffered = loop {
            let buffered = buffered_bytes(http).await;
            if buffered >= worker_relay::server::DEFAULT_REPLAY_BYTES || Instant::now() > deadline {
                break buffered;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        tokio::time::sleep(Duration::from_millis(500)).await;
        println!(
            "relay memory: replay bound {} KiB, buffered {} KiB; VmRSS {} KiB, VmHWM {} KiB (VmRSS {} KiB before the agent's output)",
            worker_relay::server::DEFAULT_REPLAY_BYTES / 1024,
            buffered / 1024,
            vm_kib(pid, "VmRSS:"),
            vm_kib(pid, "VmHWM:"),
            before
        );
    });
}

fn vm_kib(pid: u32, field: &str) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix(field))
                .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

async fn buffered_bytes(addr: SocketAddr) -> usize {
    let Ok(mut stream) = TcpStream::connect(addr).await else {
        return 0;
    };
    let _ = stream
        .write_all(b"POST /invocations HTTP/1.1\r\nHost: relay\r\nContent-Length: 0\r\n\r\n")
        .await;
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response).await;
    response
        .split("\"buffered_bytes\":")
        .nth(1)
        .and_then(|rest| rest.split([',', '}']).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// The median of one benchmark from criterion's estimates, in nanoseconds.
fn median(group: &str, function: &str) -> Option<f64> {
    let exe = std::env::current_exe().ok()?;
    // <target>/<profile>/deps/<bench binary>
    let target: PathBuf = exe.parent()?.parent()?.parent()?.to_path_buf();
    let path = target
        .join("criterion")
        .join(group)
        .join(function)
        .join("new")
        .join("estimates.json");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
    json["median"]["point_estimate"].as_f64()
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut criterion = Criterion::default().configure_from_args();
    round_trip(&mut criterion, &runtime);
    output_throughput(&mut criterion, &runtime);
    echo_throughput(&mut criterion, &runtime);
    criterion.final_summary();
    memory(&runtime);
    for (group, baseline, kind) in [
        ("round_trip_1kib", "raw_pipe", "time ratio (target <= 2x)"),
        ("output_64kib", "raw_tcp", "throughput ratio (target >= 0.5x)"),
        ("echo_64kib", "raw_tcp", "throughput ratio"),
    ] {
        match (median(group, "relay"), median(group, baseline)) {
            (Some(relay), Some(base)) => {
                let ratio = if group == "round_trip_1kib" {
                    relay / base
                } else {
                    base / relay
                };
                println!(
                    "{group}: relay median {:.1} us, {baseline} median {:.1} us, {kind}: {ratio:.2}x",
                    relay / 1000.0,
                    base / 1000.0
                );
            }
            _ => println!("{group}: no estimates found (was the group filtered out?)"),
        }
    }
}
