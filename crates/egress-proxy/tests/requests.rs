//! What the proxy does with each kind of request, over an in-memory connection (as a session's
//! socket would carry it): tunnels and plain requests to a listed destination reach it (a
//! listener this test owns on loopback), the plain request in origin form without the headers
//! meant for the proxy; malformed, oversized, unlisted and second-spelling requests are each
//! answered with their status and counted as refusals.

use std::net::SocketAddr;
use std::sync::Arc;

use egress_proxy::{Allowlist, OneSession, SessionBounds};
use session_runtime::config::EgressTarget;
use session_runtime::SessionIdentity;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// A loopback destination that records the request head it receives and answers `word`.
async fn destination(word: &'static str) -> (SocketAddr, tokio::sync::mpsc::UnboundedReceiver<String>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    let (heads, received) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let heads = heads.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).await.unwrap_or(0) == 1 {
                    head.push(byte[0]);
                }
                let _ = heads.send(String::from_utf8_lossy(&head).into_owned());
                let body = format!("{word}\n");
                let response = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(response.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    (address, received)
}

struct Proxy {
    allowlist: Arc<Allowlist>,
    bounds: Arc<SessionBounds>,
    stop: CancellationToken,
}

impl Proxy {
    fn new(entries: &[String]) -> Self {
        let targets = entries
            .iter()
            .map(|entry| EgressTarget::parse(entry).expect("an entry"))
            .collect();
        let id = SessionIdentity::new("egress", "agent", "test", "requests")
            .expect("identity")
            .id();
        Proxy {
            allowlist: Arc::new(Allowlist::new(targets)),
            bounds: SessionBounds::new(id),
            stop: CancellationToken::new(),
        }
    }

    /// Sends `bytes` on a new connection and returns all the proxy answered until it closed.
    async fn exchange(&self, bytes: &[u8]) -> String {
        let (mut client, server) = tokio::io::duplex(64 * 1024);
        let admission = OneSession::new(
            Arc::clone(&self.allowlist),
            Arc::clone(&self.bounds),
            self.bounds.connection().expect("a connection slot"),
        );
        tokio::spawn(egress_proxy::serve_connection(
            server,
            Arc::new(admission),
            self.stop.clone(),
        ));
        client.write_all(bytes).await.expect("send");
        let mut answer = Vec::new();
        client.read_to_end(&mut answer).await.expect("answer");
        String::from_utf8_lossy(&answer).into_owned()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[tokio::test]
async fn a_plain_request_reaches_its_listed_destination_in_origin_form_without_proxy_headers() {
    let (address, mut heads) = destination("plain").await;
    let proxy = Proxy::new(&[format!("{address} loopback")]);
    let answer = proxy
        .exchange(
            format!(
                "GET http://{address}/v1/models?x=1 HTTP/1.1\r\nHost: {address}\r\n\
                 Proxy-Authorization: Basic eA==\r\nProxy-Connection: keep-alive\r\nAccept: */*\r\n\r\n"
            )
            .as_bytes(),
        )
        .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with("plain\n"), "{answer}");
    let head = heads.recv().await.expect("the destination's request");
    assert!(head.starts_with("GET /v1/models?x=1 HTTP/1.1\r\n"), "{head}");
    let lower = head.to_ascii_lowercase();
    assert!(!lower.contains("proxy-"), "{head}");
    assert!(lower.contains("accept: */*"), "{head}");
    assert_eq!(proxy.bounds.refused(), 0);
}

#[tokio::test]
async fn a_connect_tunnel_joins_the_listed_destination() {
    let (address, mut heads) = destination("tunnelled").await;
    let proxy = Proxy::new(&[format!("{address} loopback")]);
    let answer = proxy
        .exchange(format!("CONNECT {address} HTTP/1.1\r\n\r\nGET /through HTTP/1.1\r\n\r\n").as_bytes())
        .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with("tunnelled\n"), "{answer}");
    // The bytes after the CONNECT head went through the tunnel as they were.
    assert_eq!(
        heads.recv().await.expect("a request"),
        "GET /through HTTP/1.1\r\n\r\n"
    );
}

#[tokio::test]
async fn each_request_the_proxy_does_not_serve_is_answered_with_its_status_and_counted() {
    let (address, _heads) = destination("never").await;
    let proxy = Proxy::new(&[format!("{address} loopback"), "vm:18084".to_owned()]);
    let port = address.port();
    let cases = [
        ("CONNECT api.example.com HTTP/1.1\r\n\r\n".to_owned(), "400"),
        ("CONNECT :443 HTTP/1.1\r\n\r\n".to_owned(), "400"),
        ("CONNECT a:0 HTTP/1.1\r\n\r\n".to_owned(), "400"),
        ("CONNECT a:80 HTTP/2\r\n\r\n".to_owned(), "400"),
        ("CONNECT a:80\r\n\r\n".to_owned(), "400"),
        // One spelling per destination: no trailing dot, sign or leading zero.
        ("CONNECT vm.:18084 HTTP/1.1\r\n\r\n".to_owned(), "400"),
        ("CONNECT vm:018084 HTTP/1.1\r\n\r\n".to_owned(), "400"),
        ("CONNECT vm:+18084 HTTP/1.1\r\n\r\n".to_owned(), "400"),
        ("GET http://vm.:18084/ HTTP/1.1\r\n\r\n".to_owned(), "400"),
        // Origin form (a client not told it talks to a proxy) and https:// are not proxied.
        ("GET /index.html HTTP/1.1\r\n\r\n".to_owned(), "400"),
        ("GET https://example.com/ HTTP/1.1\r\n\r\n".to_owned(), "400"),
        // Not listed: another port of the same address, and an address not listed at all.
        (
            format!(
                "CONNECT 127.0.0.1:{} HTTP/1.1\r\n\r\n",
                port.wrapping_add(1).max(1)
            ),
            "403",
        ),
        ("CONNECT 10.1.2.3:443 HTTP/1.1\r\n\r\n".to_owned(), "403"),
        (format!("GET http://localhost:{port}/ HTTP/1.1\r\n\r\n"), "403"),
        // A head longer than the proxy reads.
        (
            format!(
                "CONNECT {address} HTTP/1.1\r\nX-Long: {}\r\n\r\n",
                "a".repeat(20 * 1024)
            ),
            "431",
        ),
    ];
    for (n, (request, status)) in cases.iter().enumerate() {
        let answer = proxy.exchange(request.as_bytes()).await;
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {status}")),
            "{request:?}: {answer:?}"
        );
        assert_eq!(
            proxy.bounds.refused(),
            n as u64 + 1,
            "{request:?} was not counted"
        );
    }
}
