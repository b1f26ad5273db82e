//! Relay benchmarks, each against baselines measured in the same run:
//!
//! - `round_trip_1kib`: one 1 KiB line through client, relay and an echo agent (`cat`);
//! - `output_64kib`: agent output (`cat /dev/zero`) read in 64 KiB chunks through relay and
//!   client;
//! - `echo_64kib`: 64 KiB lines written to and read back from `cat` through the relay;
//! - the relay's memory (VmRSS, VmHWM) with a full replay buffer, printed once.
//!
//! The baseline each target is judged against, `forward`, has the relay's process topology and
//! does everything the relay does except what is measured (framing, sequencing, acknowledgements,
//! replay buffering, fencing): the same agent with the same lines, started by a forwarding
//! process (this binary again) that copies its stdout to one loopback TCP connection and the
//! connection to its stdin, with `TCP_NODELAY`, the relay's buffer and pipe sizes (256 KiB reads,
//! 1 MiB pipes) and a current-thread runtime like the relay's;
//! the benchmark reads and writes that connection as the client would. The old baselines are kept
//! as references: `raw_pipe` (the agent as a direct child, one hop less) and `raw_tcp` (a TCP
//! peer in this process, no agent at all).
//!
//! At the end it prints the ratio of the medians against each baseline, and the instructions of
//! one round trip (callgrind, where valgrind is installed: this binary and the relay or
//! forwarder it starts, not `cat`), taken as the difference between two runs of
//! [`COUNT_SMALL`] and [`COUNT_LARGE`] round trips so that start-up cancels out.
//!
//! Run: `cargo bench -p worker-relay --bench relay`.

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

/// The relay this benchmark builds; `OAB_BENCH_RELAY` names another build to measure instead
/// (e.g. an older one, against baselines of the same run).
const RELAY: &str = env!("CARGO_BIN_EXE_oab-relay");

fn relay_program() -> std::ffi::OsString {
    std::env::var_os("OAB_BENCH_RELAY").unwrap_or_else(|| RELAY.into())
}
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
    let mut child = Command::new(relay_program())
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

/// Set to `relay:<count>` or `forward:<count>`, the benchmark only runs that many 1 KiB round
/// trips through a relay or the forwarding baseline and exits: what instructions are counted of.
const ROUND_TRIPS_ENV: &str = "OAB_BENCH_ROUND_TRIPS";

/// Set (to anything), this binary is the forwarding baseline: it starts the agent given as its
/// arguments, prints `listening <addr>` and copies between the agent and one TCP connection.
const FORWARD_ENV: &str = "OAB_BENCH_FORWARD";

/// The round trips of the two counted runs; their difference is what one round trip costs.
const COUNT_SMALL: u64 = 200;
const COUNT_LARGE: u64 = 1200;

/// The forwarding baseline's process: the agent's stdio copied to and from one TCP connection.
fn forward_main() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        println!("listening {}", listener.local_addr().expect("addr"));
        let argv: Vec<String> = std::env::args().skip(1).collect();
        let mut agent = Command::new(&argv[0])
            .args(&argv[1..])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start the agent");
        let (socket, _) = listener.accept().await.expect("accept");
        socket.set_nodelay(true).expect("nodelay");
        let (mut from_client, mut to_client) = socket.into_split();
        let mut stdin = agent.stdin.take().expect("stdin");
        let stdout = agent.stdout.take().expect("stdout");
        // The relay's buffer and pipe sizes (256 KiB reads, 1 MiB pipes), so that the baseline
        // is not slower for want of them.
        let _ = rustix::pipe::fcntl_setpipe_size(&stdin, 1 << 20);
        let _ = rustix::pipe::fcntl_setpipe_size(&stdout, 1 << 20);
        let mut stdout = BufReader::with_capacity(256 * 1024, stdout);
        let mut from_client = BufReader::with_capacity(256 * 1024, &mut from_client);
        let input = async {
            let _ = tokio::io::copy_buf(&mut from_client, &mut stdin).await;
            drop(stdin);
        };
        let output = async {
            let _ = tokio::io::copy_buf(&mut stdout, &mut to_client).await;
            let _ = to_client.shutdown().await;
        };
        tokio::join!(input, output);
        let _ = agent.wait().await;
    });
}

/// A forwarding process for `agent` and the connection to it.
async fn start_forward(agent: &[&str]) -> (Child, TcpStream) {
    let mut child = Command::new(std::env::current_exe().expect("this binary"))
        .args(agent)
        .env(FORWARD_ENV, "1")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start the forwarder");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let line = lines.next_line().await.expect("read").expect("listening line");
    let addr = line.strip_prefix("listening ").expect("address line").to_owned();
    let stream = TcpStream::connect(addr).await.expect("connect");
    stream.set_nodelay(true).expect("nodelay");
    (child, stream)
}

async fn round_trips_only(path: &str, count: u64) {
    let text = "x".repeat(1023);
    let mut line = String::new();
    if path == "forward" {
        let (mut child, stream) = start_forward(&["cat"]).await;
        let (read, mut write) = stream.into_split();
        let mut reader = BufReader::new(read);
        let mut bytes = text.into_bytes();
        bytes.push(b'\n');
        for _ in 0..count {
            write.write_all(&bytes).await.expect("write");
            line.clear();
            reader.read_line(&mut line).await.expect("read");
            assert_eq!(line.len(), 1024);
        }
        write.shutdown().await.expect("shutdown");
        drop(reader);
        child.wait().await.expect("the forwarder's exit");
        return;
    }
    let mut relay = start(&["cat"], &[]).await;
    let (output, input, control) = relay.attachment.into_split();
    let mut reader = BufReader::new(output);
    let text = "x".repeat(1023);
    let mut line = String::new();
    for _ in 0..count {
        input.write_line(&text).await.expect("write");
        line.clear();
        reader.read_line(&mut line).await.expect("read");
        assert_eq!(line.len(), 1024);
    }
    // The relay ends on its own once its agent's exit is acknowledged, so that a profiler
    // running it sees it finish (a killed process leaves no profile).
    input.close().await.expect("close the agent's stdin");
    control.wait().await.expect("the agent's exit");
    drop(reader);
    relay.child.wait().await.expect("the relay's exit");
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

    let (forwarder, stream) = runtime.block_on(start_forward(&["cat"]));
    let (read, mut write) = stream.into_split();
    let mut forwarded = BufReader::new(read);
    let mut bytes = text.clone().into_bytes();
    bytes.push(b'\n');
    group.bench_function("forward", |b| {
        b.iter_custom(|iters| {
            runtime.block_on(async {
                let started = Instant::now();
                for _ in 0..iters {
                    write.write_all(&bytes).await.expect("write");
                    line.clear();
                    forwarded.read_line(&mut line).await.expect("read");
                    assert_eq!(line.len(), 1024);
                }
                started.elapsed()
            })
        })
    });
    drop(forwarder);

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

    let (forwarder, mut forwarded) = runtime.block_on(start_forward(&["cat", "/dev/zero"]));
    group.bench_function("forward", |b| {
        b.iter_custom(|iters| {
            runtime.block_on(async {
                let started = Instant::now();
                for _ in 0..iters * CHUNKS as u64 {
                    forwarded.read_exact(&mut buf).await.expect("read");
                }
                started.elapsed()
            })
        })
    });
    drop(forwarder);

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

    let (forwarder, stream) = runtime.block_on(start_forward(&["cat"]));
    let (mut read, write) = stream.into_split();
    let write = Arc::new(tokio::sync::Mutex::new(write));
    let mut line_bytes = text.clone().into_bytes();
    line_bytes.push(b'\n');
    let line_bytes = Arc::new(line_bytes);
    group.bench_function("forward", |b| {
        b.iter_custom(|iters| {
            runtime.block_on(async {
                let started = Instant::now();
                let total = iters as usize * CHUNKS;
                let writer = {
                    let write = Arc::clone(&write);
                    let chunk = Arc::clone(&line_bytes);
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
    drop(forwarder);

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

/// Instructions of one round trip through `path` (`relay` or `forward`), if valgrind runs here:
/// the difference of two callgrind runs over every process but `cat`, per extra round trip.
fn instructions_per_round_trip(path: &str) -> Option<f64> {
    if std::env::var_os("OAB_BENCH_NO_INSTRUCTIONS").is_some() {
        // Repeated timing runs: the counts do not change from run to run.
        return None;
    }
    let count = |round_trips: u64| -> Option<u64> {
        let output = std::process::Command::new("valgrind")
            .args([
                "--tool=callgrind",
                "--trace-children=yes",
                "--trace-children-skip=*cat",
                "--callgrind-out-file=/dev/null",
            ])
            .arg(std::env::current_exe().ok()?)
            .env(ROUND_TRIPS_ENV, format!("{path}:{round_trips}"))
            .stdout(Stdio::null())
            .output()
            .ok()?;
        if !output.status.success() {
            return None;
        }
        // One `Collected : <n>` line per traced process.
        let stderr = String::from_utf8_lossy(&output.stderr);
        let total = stderr
            .lines()
            .filter_map(|line| line.split("Collected : ").nth(1))
            .filter_map(|n| n.trim().parse::<u64>().ok())
            .sum();
        Some(total)
    };
    let (small, large) = (count(COUNT_SMALL)?, count(COUNT_LARGE)?);
    Some(large.saturating_sub(small) as f64 / (COUNT_LARGE - COUNT_SMALL) as f64)
}

fn main() {
    if std::env::var_os(FORWARD_ENV).is_some() {
        return forward_main();
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    if let Some(request) = std::env::var_os(ROUND_TRIPS_ENV) {
        let request = request.to_string_lossy().into_owned();
        let (path, count) = request.split_once(':').expect("<relay|forward>:<count>");
        let count: u64 = count.parse().expect("a round-trip count");
        runtime.block_on(round_trips_only(path, count));
        return;
    }
    let mut criterion = Criterion::default().configure_from_args();
    round_trip(&mut criterion, &runtime);
    output_throughput(&mut criterion, &runtime);
    echo_throughput(&mut criterion, &runtime);
    criterion.final_summary();
    memory(&runtime);
    for (group, kind) in [
        ("round_trip_1kib", "time ratio (target <= 2x against forward)"),
        (
            "output_64kib",
            "throughput ratio (target >= 0.5x against forward)",
        ),
        ("echo_64kib", "throughput ratio"),
    ] {
        let reference = if group == "round_trip_1kib" {
            "raw_pipe"
        } else {
            "raw_tcp"
        };
        let Some(relay) = median(group, "relay") else {
            println!("{group}: no estimates found (was the group filtered out?)");
            continue;
        };
        let mut line = format!("{group}: relay median {:.1} us", relay / 1000.0);
        for baseline in ["forward", reference] {
            if let Some(base) = median(group, baseline) {
                // Round trips compare times; throughputs compare rates (baseline time / relay time).
                let ratio = if group == "round_trip_1kib" {
                    relay / base
                } else {
                    base / relay
                };
                line += &format!(", {baseline} {:.1} us: {ratio:.2}x", base / 1000.0);
            }
        }
        println!("{line}; {kind}");
    }
    match (
        instructions_per_round_trip("relay"),
        instructions_per_round_trip("forward"),
    ) {
        (Some(relay), Some(forward)) => println!(
            "instructions per 1 KiB round trip (callgrind): relay {relay:.0}, forward {forward:.0}: {:.2}x",
            relay / forward
        ),
        _ => println!("instructions per round trip: not measured (valgrind --tool=callgrind did not run, or OAB_BENCH_NO_INSTRUCTIONS is set)"),
    }
}
