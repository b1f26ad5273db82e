//! One session's egress requests while another session floods its own proxy, against the same
//! requests without the flood, measured in the same run.
//!
//! Two proxies of two sessions run in this process, as in a broker. Each measured request is
//! session B's: a `CONNECT` tunnel through B's proxy to a loopback HTTP service, and a `GET`
//! through it, until the answer ends. The groups:
//!
//! - `quiet`: B's requests alone (the baseline);
//! - `flood`: B's requests while session A's proxy is flooded from processes of their own
//!   (`oab-egress-flood`, as an agent's would be): 1500 idle connections, 1500 unfinished
//!   request heads (a slow-loris), and a churn of connections opened and closed 200 at a time
//!   without pause.
//!
//! Run: `cargo bench -p runtime-local --bench egress_flood`. At the end it prints the median,
//! mean and 99th percentile of B's request latency in each group (over every request measured,
//! warm-up included) and their ratios (flood / quiet), and how many of A's connections its
//! proxy refused. The figures are reported, never asserted.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use criterion::Criterion;
use runtime_local::testing::EgressProxyUnderTest;
use session_runtime::config::EgressTarget;
use session_runtime::{SessionId, SessionIdentity};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

/// Connections of each holding flood process.
const FLOOD: usize = 1500;
/// Connections the churning flood opens before closing them.
const CHURN_BATCH: usize = 200;

fn session(thread: &str) -> SessionId {
    SessionIdentity::new("bench", "agent", "discord", thread)
        .expect("identity")
        .id()
}

/// A loopback HTTP service that answers every request with a short body.
async fn service() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut request = [0u8; 4096];
                let _ = stream.read(&mut request).await;
                let _ = stream
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n")
                    .await;
                let _ = stream.shutdown().await;
            });
        }
    });
    address
}

/// One request of B's: a tunnel through its proxy, a GET through the tunnel, the whole answer.
async fn request(socket: &Path, authority: &str) {
    let stream = UnixStream::connect(socket).await.expect("connect to B's proxy");
    let mut stream = BufReader::new(stream);
    stream
        .get_mut()
        .write_all(format!("CONNECT {authority} HTTP/1.1\r\n\r\n").as_bytes())
        .await
        .expect("CONNECT");
    let mut line = String::new();
    stream.read_line(&mut line).await.expect("status");
    assert!(line.starts_with("HTTP/1.1 200"), "B's proxy answered {line:?}");
    loop {
        line.clear();
        if stream.read_line(&mut line).await.expect("head") == 0 || line == "\r\n" {
            break;
        }
    }
    stream
        .get_mut()
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("GET");
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.expect("answer");
    assert!(answer.ends_with(b"ok\n"), "B's answer: {answer:?}");
}

/// The flood's processes: killed and reaped when dropped.
struct Flood(Vec<Child>);

impl Flood {
    fn start(socket: &Path) -> Self {
        let mut children = Vec::new();
        for (count, mode) in [(FLOOD, "idle"), (FLOOD, "slow"), (CHURN_BATCH, "churn")] {
            let mut child = Command::new(env!("CARGO_BIN_EXE_oab-egress-flood"))
                .arg(socket)
                .arg(count.to_string())
                .arg(mode)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .expect("oab-egress-flood");
            let stdout = child.stdout.take().expect("stdout");
            let mut report = String::new();
            std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut report).expect("report");
            eprintln!("flood {mode}: {}", report.trim_end());
            children.push(child);
        }
        Flood(children)
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The median, mean and 99th percentile of `samples`.
fn summary(samples: &mut [Duration]) -> [Duration; 3] {
    samples.sort();
    let at = |fraction: f64| {
        let index = ((samples.len() as f64 - 1.0) * fraction).round() as usize;
        samples.get(index).copied().unwrap_or_default()
    };
    let mean = samples.iter().sum::<Duration>() / u32::try_from(samples.len().max(1)).unwrap_or(u32::MAX);
    [at(0.5), mean, at(0.99)]
}

fn bench(c: &mut Criterion) {
    let runtime = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio"),
    );
    let dir = tempfile::Builder::new()
        .prefix("oab-bench-egress-")
        .tempdir_in("/tmp")
        .expect("dir");
    let (authority, proxy_a, proxy_b) = runtime.block_on(async {
        let upstream = service().await;
        let entry = [EgressTarget::parse(&upstream.to_string()).expect("entry")];
        let a = EgressProxyUnderTest::start(session("flooder"), &entry, &dir.path().join("a")).expect("A");
        let b = EgressProxyUnderTest::start(session("other"), &entry, &dir.path().join("b")).expect("B");
        (upstream.to_string(), a, b)
    });
    let quiet = Arc::new(Mutex::new(Vec::new()));
    let flooded = Arc::new(Mutex::new(Vec::new()));
    let mut group = c.benchmark_group("egress_other_session");
    group.sample_size(30).measurement_time(Duration::from_secs(5));
    let mut measure = |name: &str, into: &Arc<Mutex<Vec<Duration>>>| {
        let into = Arc::clone(into);
        let runtime = Arc::clone(&runtime);
        let socket = proxy_b.socket().to_path_buf();
        let authority = authority.clone();
        group.bench_function(name, move |b| {
            b.iter_custom(|iterations| {
                runtime.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iterations {
                        let started = Instant::now();
                        request(&socket, &authority).await;
                        let took = started.elapsed();
                        into.lock().expect("samples").push(took);
                        total += took;
                    }
                    total
                })
            });
        });
    };
    measure("quiet", &quiet);
    let flood = Flood::start(proxy_a.socket());
    measure("flood", &flooded);
    drop(flood);
    group.finish();
    let quiet = summary(&mut quiet.lock().expect("samples"));
    let flooded = summary(&mut flooded.lock().expect("samples"));
    for (index, name) in ["median", "mean", "p99"].into_iter().enumerate() {
        println!(
            "egress_flood: B's {name} request {:?} quiet, {:?} during A's flood: ratio {:.2}",
            quiet[index],
            flooded[index],
            flooded[index].as_secs_f64() / quiet[index].as_secs_f64().max(f64::EPSILON)
        );
    }
    println!(
        "egress_flood: A's proxy refused {} connections",
        proxy_a.refused()
    );
    drop((proxy_a, proxy_b));
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    bench(&mut criterion);
    criterion.final_summary();
}
