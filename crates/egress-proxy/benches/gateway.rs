//! What the egress gateway adds to a request, against the same request made directly, measured in
//! the same run; and the gateway's memory with many tunnels open.
//!
//! The destination is a loopback HTTP service in this process; each request is a new connection,
//! a `GET`, and its whole answer. The groups of `gateway_request`:
//!
//! - `direct`: to the destination itself (the baseline);
//! - `plain`: through the gateway as an absolute-form `GET` with the session's credential;
//! - `connect`: through a `CONNECT` tunnel of the gateway, then the `GET` inside it;
//! - `route`: to a model route of the gateway (`GET /model/` with the session's route key), which
//!   reads the route's Secret from its file and forwards the request with it.
//!
//! Then 100 tunnels, ten of each of ten sessions (a session may hold 64), are opened and held, and the process's resident memory is
//! read before and with them (`/proc/self/statm`): the gateway runs in this process, so the
//! difference is what those connections cost it (and the destination's side of them, which a
//! real gateway does not hold).
//!
//! Run: `cargo bench -p egress-proxy --bench gateway`. At the end it prints each group's median
//! over every request measured (warm-up included) and its ratio to `direct`, and the memory
//! figures. The figures are reported, never asserted.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use criterion::Criterion;
use egress_proxy::gateway::{Gateway, GatewayKey, ProfileEgress};
use egress_proxy::routes::{ModelRoute, SecretKey};
use egress_proxy::Allowlist;
use session_runtime::config::EgressTarget;
use session_runtime::SessionIdentity;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// The ways a request is made.
const MODES: [&str; 4] = ["direct", "plain", "connect", "route"];
/// How many tunnels are held open for the memory figure.
const HELD: usize = 100;

/// A loopback HTTP service that answers every request with a short body, and holds a connection
/// open while its client does.
async fn service() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut request = [0u8; 4096];
                if matches!(stream.read(&mut request).await, Ok(read) if read > 0) {
                    let _ = stream
                        .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n")
                        .await;
                    let _ = stream.shutdown().await;
                }
            });
        }
    });
    address
}

/// The session's credential, both ways it is presented.
struct Credential {
    /// `Proxy-Authorization`'s value.
    proxy: String,
    /// The model route's key.
    route_key: String,
}

/// One request to `destination`: directly, or through `gateway` as `plain`, `connect` or
/// `route`.
async fn request(mode: &str, destination: SocketAddr, gateway: SocketAddr, credential: &Credential) {
    let proxy = &credential.proxy;
    let head = match mode {
        "direct" => format!("GET / HTTP/1.1\r\nHost: {destination}\r\n\r\n"),
        "plain" => format!(
            "GET http://{destination}/ HTTP/1.1\r\nHost: {destination}\r\nProxy-Authorization: {proxy}\r\n\r\n"
        ),
        "route" => format!(
            "GET /model/ HTTP/1.1\r\nHost: {gateway}\r\nAuthorization: Bearer {}\r\n\r\n",
            credential.route_key
        ),
        _ => format!("CONNECT {destination} HTTP/1.1\r\nProxy-Authorization: {proxy}\r\n\r\n"),
    };
    let to = if mode == "direct" { destination } else { gateway };
    let stream = TcpStream::connect(to).await.expect("connect");
    let mut stream = BufReader::new(stream);
    stream.get_mut().write_all(head.as_bytes()).await.expect("send");
    if mode == "connect" {
        let mut line = String::new();
        loop {
            line.clear();
            stream.read_line(&mut line).await.expect("the tunnel's answer");
            if line == "\r\n" {
                break;
            }
        }
        stream
            .get_mut()
            .write_all(format!("GET / HTTP/1.1\r\nHost: {destination}\r\n\r\n").as_bytes())
            .await
            .expect("send");
    }
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.expect("answer");
    assert!(answer.ends_with(b"ok\n"), "{}", String::from_utf8_lossy(&answer));
}

/// This process's resident memory, in KiB.
fn resident_kib() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|field| field.parse().ok())
        .unwrap_or(0);
    pages * 4
}

fn median(samples: &mut [Duration]) -> Duration {
    samples.sort_unstable();
    samples.get(samples.len() / 2).copied().unwrap_or_default()
}

fn bench(c: &mut Criterion) {
    let runtime = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime"),
    );
    let key = GatewayKey::new([3u8; 32]);
    let stop = CancellationToken::new();
    let secrets = tempfile::tempdir().expect("a Secrets directory");
    std::fs::create_dir(secrets.path().join("model-keys")).expect("a Secret");
    std::fs::write(secrets.path().join("model-keys/model"), "sk-bench\n").expect("a key");
    let (destination, gateway) = runtime.block_on(async {
        let destination = service().await;
        // A loopback destination, which a profile document may not list (the gateway's loopback
        // is its own), so the profile is made here.
        let target = EgressTarget::parse(&format!("{destination} loopback")).expect("an entry");
        let route = ModelRoute {
            prefix: "/model/".to_owned(),
            upstream: format!("http://{destination}"),
            header: "Authorization".to_owned(),
            secret: SecretKey {
                name: "model-keys".to_owned(),
                key: "model".to_owned(),
            },
            base_url_env: None,
            key_env: None,
        };
        let work = ProfileEgress {
            allowlist: Allowlist::new(vec![target]),
            model_routes: vec![route],
        };
        let profiles: HashMap<_, _> = [("work".to_owned(), work)].into();
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let gateway = listener.local_addr().expect("address");
        tokio::spawn(
            Arc::new(Gateway::new(key.clone(), profiles, secrets.path())).serve(listener, stop.clone()),
        );
        (destination, gateway)
    });
    let id = SessionIdentity::new("bench", "agent", "gateway", "one")
        .expect("identity")
        .id();
    let credential = Arc::new(Credential {
        proxy: key.credential(id, "work").header_value(),
        route_key: key.credential(id, "work").route_key(),
    });
    let samples: HashMap<&str, Arc<Mutex<Vec<Duration>>>> =
        MODES.into_iter().map(|mode| (mode, Arc::default())).collect();
    let mut group = c.benchmark_group("gateway_request");
    group.sample_size(100).measurement_time(Duration::from_secs(5));
    for mode in MODES {
        let into = Arc::clone(&samples[mode]);
        let runtime = Arc::clone(&runtime);
        let credential = Arc::clone(&credential);
        group.bench_function(mode, move |b| {
            b.iter_custom(|iterations| {
                runtime.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iterations {
                        let started = Instant::now();
                        request(mode, destination, gateway, &credential).await;
                        let took = started.elapsed();
                        into.lock().expect("samples").push(took);
                        total += took;
                    }
                    total
                })
            });
        });
    }
    group.finish();
    let direct = median(&mut samples["direct"].lock().expect("samples"));
    for mode in MODES {
        let mut taken = samples[mode].lock().expect("samples");
        let count = taken.len();
        let took = median(&mut taken);
        println!(
            "gateway: {mode:>7} median {took:?} over {count} requests, {:.2}x direct",
            took.as_secs_f64() / direct.as_secs_f64().max(f64::EPSILON)
        );
    }

    let before = resident_kib();
    let held = runtime.block_on(async {
        let mut held = Vec::new();
        for n in 0..HELD {
            let session = SessionIdentity::new("bench", "agent", "gateway", format!("held-{}", n % 10))
                .expect("identity")
                .id();
            let credential = key.credential(session, "work").header_value();
            let mut stream = TcpStream::connect(gateway).await.expect("connect");
            stream
                .write_all(
                    format!("CONNECT {destination} HTTP/1.1\r\nProxy-Authorization: {credential}\r\n\r\n")
                        .as_bytes(),
                )
                .await
                .expect("send");
            let mut status = [0u8; 12];
            stream.read_exact(&mut status).await.expect("an answer");
            assert_eq!(&status, b"HTTP/1.1 200");
            held.push(stream);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        held
    });
    let with = resident_kib();
    println!(
        "gateway: resident memory {before} KiB, {with} KiB with {HELD} tunnels open: {} KiB more, {:.1} KiB a tunnel",
        with.saturating_sub(before),
        with.saturating_sub(before) as f64 / HELD as f64
    );
    drop(held);
    stop.cancel();
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    bench(&mut criterion);
    criterion.final_summary();
}
