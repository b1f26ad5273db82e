//! The endpoints over loopback TCP, as a kubelet's probes and a Prometheus scraper reach them.

use std::time::Duration;

use session_runtime::telemetry::{self, StartKind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

async fn get(address: std::net::SocketAddr, request: &str) -> (String, String) {
    let mut stream = TcpStream::connect(address).await.expect("connect");
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.expect("answer");
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    (
        head.lines().next().unwrap_or_default().to_owned(),
        body.to_owned(),
    )
}

fn request(method: &str, path: &str) -> String {
    format!("{method} {path} HTTP/1.1\r\nHost: ops\r\nConnection: close\r\n\r\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_health_and_readiness_are_served_and_nothing_else() {
    let handle = ops_http::install().expect("the recorder");
    assert!(ops_http::install().is_err(), "a second recorder is refused");
    telemetry::attached("kubernetes", StartKind::New, Duration::from_millis(300));
    telemetry::sessions("kubernetes", "running", 3);

    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    let readiness = ops_http::Readiness::new();
    let stop = CancellationToken::new();
    let server = tokio::spawn(ops_http::serve(listener, handle, readiness.clone(), stop.clone()));

    let (status, body) = get(address, &request("GET", "/metrics")).await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(
        body.contains("# TYPE openab_attach_first_byte_seconds histogram"),
        "{body}"
    );
    assert!(
        body.contains(
            "openab_attach_first_byte_seconds_bucket{backend=\"kubernetes\",start=\"new\",le=\"0.5\"} 1"
        ),
        "{body}"
    );
    assert!(
        body.contains(
            "openab_attach_first_byte_seconds_bucket{backend=\"kubernetes\",start=\"new\",le=\"0.25\"} 0"
        ),
        "{body}"
    );
    assert!(
        body.contains("openab_sessions{backend=\"kubernetes\",phase=\"running\"} 3"),
        "{body}"
    );
    assert_eq!(
        get(address, &request("GET", "/healthz")).await.0,
        "HTTP/1.1 200 OK"
    );
    assert_eq!(
        get(address, &request("GET", "/readyz")).await.0,
        "HTTP/1.1 503 Service Unavailable"
    );
    readiness.set(true);
    assert_eq!(
        get(address, &request("GET", "/readyz")).await.0,
        "HTTP/1.1 200 OK"
    );
    assert_eq!(
        get(address, &request("GET", "/other")).await.0,
        "HTTP/1.1 404 Not Found"
    );
    assert_eq!(
        get(address, &request("POST", "/metrics")).await.0,
        "HTTP/1.1 405 Method Not Allowed"
    );

    stop.cancel();
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("the server stops")
        .expect("the server ends cleanly");
    assert!(
        TcpStream::connect(address).await.is_err(),
        "still listening after stop"
    );
}
