//! The session's HTTP proxy: `CONNECT host:port` and absolute-form plain HTTP requests
//! (`GET http://host:port/path`) to a listed destination; everything else is refused.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use session_runtime::config::{AddressKind, EgressTarget};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};

use super::bounds::{HeadBytes, SessionBounds, HEAD_CHUNK, HEAD_TIMEOUT, MAX_HEAD};
use super::EgressPlan;

/// How long resolving a destination's name and connecting to it may take, together.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

/// A request the proxy understood.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct ProxyRequest {
    /// The destination host in its one spelling (a name in lower case, IPv6 without brackets).
    pub(super) host: String,
    /// The destination port.
    pub(super) port: u16,
    /// `None` for `CONNECT` (a tunnel); otherwise the request head to send to the destination,
    /// in origin form (`GET /path HTTP/1.1` and the headers, without `Proxy-*` headers).
    pub(super) forward_head: Option<Vec<u8>>,
}

/// Why a request head is not one the proxy serves: the status to answer, and why.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Refusal {
    pub(super) status: &'static str,
    pub(super) reason: String,
}

fn bad_request(reason: impl Into<String>) -> Refusal {
    Refusal {
        status: "400 Bad Request",
        reason: reason.into(),
    }
}

/// Splits `authority` (`host:port`, `[v6]:port`, or `host` with `default_port`) into host and
/// port, in the single spelling an `egress` entry has ([`EgressTarget::parse_authority`]): a
/// name with a trailing dot, or a port with a sign or leading zero, is refused here rather than
/// passed to the allowlist and the resolver as a second spelling of a destination.
fn split_authority(authority: &str, default_port: Option<u16>) -> Result<(String, u16), String> {
    EgressTarget::parse_authority(authority, default_port).map(|target| (target.host(), target.port()))
}

/// Parses a complete request head (up to and including the blank line).
pub(super) fn parse_head(head: &[u8]) -> Result<ProxyRequest, Refusal> {
    let text = std::str::from_utf8(head).map_err(|_| bad_request("the request head is not UTF-8"))?;
    let mut lines = text.split("\r\n");
    let request_line = lines.next().unwrap_or_default();
    let mut parts = request_line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad_request(format!("malformed request line {request_line:?}")));
    };
    if !version.starts_with("HTTP/1.") {
        return Err(bad_request(format!("unsupported version {version:?}")));
    }
    if method == "CONNECT" {
        let (host, port) = split_authority(target, None)
            .map_err(|why| bad_request(format!("CONNECT needs host:port, found {target:?}: {why}")))?;
        return Ok(ProxyRequest {
            host,
            port,
            forward_head: None,
        });
    }
    let Some(rest) = target.strip_prefix("http://") else {
        return Err(Refusal {
            status: "400 Bad Request",
            reason: format!(
                "{method:?} {target:?}: the proxy serves CONNECT and absolute http:// requests only"
            ),
        });
    };
    let (authority, path) = match rest.find('/') {
        Some(slash) => rest.split_at(slash),
        None => (rest, "/"),
    };
    let (host, port) = split_authority(authority, Some(80))
        .map_err(|why| bad_request(format!("bad authority in {target:?}: {why}")))?;
    let mut forward = format!("{method} {path} {version}\r\n");
    for line in lines {
        let proxy_only = line
            .split_once(':')
            .is_some_and(|(name, _)| name.trim().to_ascii_lowercase().starts_with("proxy-"));
        if !proxy_only {
            forward.push_str(line);
            forward.push_str("\r\n");
        }
    }
    // `lines` ended with the two empty strings after the final CRLF CRLF; keep one blank line.
    while forward.ends_with("\r\n\r\n\r\n") {
        forward.truncate(forward.len() - 2);
    }
    Ok(ProxyRequest {
        host,
        port,
        forward_head: Some(forward.into_bytes()),
    })
}

/// Reads the request head from `stream`: the bytes up to the blank line, and whatever the client
/// sent after it. The whole head must arrive within [`HEAD_TIMEOUT`], be at most [`MAX_HEAD`]
/// bytes, and fit the session's head budget while it is read.
async fn read_head(bounds: &SessionBounds, stream: &mut UnixStream) -> Result<(Vec<u8>, Vec<u8>), Refusal> {
    tokio::time::timeout(HEAD_TIMEOUT, read_head_bounded(bounds, stream))
        .await
        .map_err(|_| bad_request(format!("no complete request head within {HEAD_TIMEOUT:?}")))?
}

async fn read_head_bounded(
    bounds: &SessionBounds,
    stream: &mut UnixStream,
) -> Result<(Vec<u8>, Vec<u8>), Refusal> {
    let mut held = HeadBytes::default();
    let mut reserved = 0usize;
    let mut buffer = Vec::new();
    let mut chunk = [0u8; HEAD_CHUNK];
    loop {
        if let Some(end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = buffer.split_off(end + 4);
            return Ok((buffer, rest));
        }
        if buffer.len() > MAX_HEAD {
            return Err(Refusal {
                status: "431 Request Header Fields Too Large",
                reason: format!("request head longer than {MAX_HEAD} bytes"),
            });
        }
        // The budget holds what the buffer may grow to with this read.
        if buffer.len() + HEAD_CHUNK > reserved {
            if bounds.grow_head(&mut held) {
                reserved += HEAD_CHUNK;
            } else {
                return Err(Refusal {
                    status: "503 Service Unavailable",
                    reason: "the session's unfinished request heads hold all the memory its \
                             proxy gives them"
                        .to_owned(),
                });
            }
        }
        let read = stream
            .read(&mut chunk)
            .await
            .map_err(|e| bad_request(format!("reading the request: {e}")))?;
        if read == 0 {
            return Err(bad_request("the connection ended before the request head did"));
        }
        buffer.extend_from_slice(&chunk[..read]);
    }
}

/// Answers `status` with `reason` as the body, and closes.
async fn answer(stream: &mut UnixStream, status: &str, reason: &str) {
    let body = format!("{reason}\n");
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// The addresses `host:port` may be reached at under `entry`: an address entry's own; for a
/// name, those it resolves to (once: these are the addresses connected to) that are of the kind
/// the entry allows.
///
/// # Errors
///
/// The refusal to answer: `502` if the name does not resolve, `403` if it resolves only to
/// addresses of another kind (saying which, and how to allow them).
async fn addresses(entry: &EgressTarget, host: &str, port: u16) -> Result<Vec<SocketAddr>, Refusal> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        // The entry's own address (`matches` compared them); its kind is the entry's.
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let resolved: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
        .await
        .map_err(|e| Refusal {
            status: "502 Bad Gateway",
            reason: format!("resolving {host}: {e}"),
        })?
        .collect();
    let (allowed, other): (Vec<SocketAddr>, Vec<SocketAddr>) = resolved
        .into_iter()
        .partition(|address| entry.allows_address(address.ip()));
    if allowed.is_empty() {
        let kinds: Vec<String> = other
            .iter()
            .map(|address| format!("{} ({})", address.ip(), AddressKind::of(address.ip())))
            .collect();
        return Err(Refusal {
            status: "403 Forbidden",
            reason: format!(
                "{host} resolves to {}, not to a {} address as its egress entry allows \
                 (an entry \"{host}:{port} KIND\" allows another kind)",
                if kinds.is_empty() {
                    "nothing".to_owned()
                } else {
                    kinds.join(", ")
                },
                entry.reach()
            ),
        });
    }
    Ok(allowed)
}

/// Connects to the first of `addresses` that answers.
async fn connect(addresses: &[SocketAddr]) -> std::io::Result<TcpStream> {
    let mut last = None;
    for address in addresses {
        match TcpStream::connect(address).await {
            Ok(stream) => return Ok(stream),
            Err(error) => last = Some(error),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "no address")))
}

/// Serves one connection of a session (whose `bounds` apply) to its proxy.
pub(super) async fn serve_connection(
    bounds: Arc<SessionBounds>,
    plan: Arc<EgressPlan>,
    mut inside: UnixStream,
) {
    let (head, early) = match read_head(&bounds, &mut inside).await {
        Ok(read) => read,
        Err(refusal) => {
            bounds.refuse(None, &refusal.reason);
            answer(&mut inside, refusal.status, &refusal.reason).await;
            return;
        }
    };
    let request = match parse_head(&head) {
        Ok(request) => request,
        Err(refusal) => {
            bounds.refuse(None, &refusal.reason);
            answer(&mut inside, refusal.status, &refusal.reason).await;
            return;
        }
    };
    drop(head);
    let destination = if request.host.contains(':') {
        format!("[{}]:{}", request.host, request.port)
    } else {
        format!("{}:{}", request.host, request.port)
    };
    let Some(entry) = plan.entry(&request.host, request.port) else {
        bounds.refuse(Some(&destination), "not in the session's allowlist");
        let reason = format!("{destination} is not in this session's egress allowlist");
        answer(&mut inside, "403 Forbidden", &reason).await;
        return;
    };
    let connected = tokio::time::timeout(CONNECT_TIMEOUT, async {
        let addresses = addresses(entry, &request.host, request.port).await?;
        connect(&addresses).await.map_err(|error| Refusal {
            status: "502 Bad Gateway",
            reason: format!("connecting to {destination}: {error}"),
        })
    })
    .await;
    let mut outside = match connected {
        Ok(Ok(stream)) => stream,
        Ok(Err(refusal)) => {
            if refusal.status.starts_with("403") {
                bounds.refuse(Some(&destination), &refusal.reason);
            } else {
                bounds.note(&destination, &refusal.reason);
            }
            answer(&mut inside, refusal.status, &refusal.reason).await;
            return;
        }
        Err(_) => {
            bounds.note(&destination, "connect timed out");
            answer(
                &mut inside,
                "504 Gateway Timeout",
                &format!("connecting to {destination} timed out"),
            )
            .await;
            return;
        }
    };
    tracing::debug!(session = %bounds.id(), destination = %destination, "egress connected");
    let sent = match &request.forward_head {
        None => inside
            .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
            .await
            .is_ok(),
        Some(head) => outside.write_all(head).await.is_ok(),
    };
    if !sent || outside.write_all(&early).await.is_err() {
        return;
    }
    let _ = tokio::io::copy_bidirectional(&mut inside, &mut outside).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_requests_name_host_and_port() {
        let request =
            parse_head(b"CONNECT api.example.com:443 HTTP/1.1\r\nHost: api.example.com:443\r\n\r\n")
                .expect("parses");
        assert_eq!(request.host, "api.example.com");
        assert_eq!(request.port, 443);
        assert_eq!(request.forward_head, None);
        let request = parse_head(b"CONNECT [::1]:8080 HTTP/1.1\r\n\r\n").expect("parses");
        assert_eq!((request.host.as_str(), request.port), ("::1", 8080));
        for bad in [
            "CONNECT api.example.com HTTP/1.1\r\n\r\n",
            "CONNECT :443 HTTP/1.1\r\n\r\n",
            "CONNECT a:0 HTTP/1.1\r\n\r\n",
            "CONNECT ::1:80 HTTP/1.1\r\n\r\n",
            "CONNECT a:80 HTTP/2\r\n\r\n",
            "CONNECT a:80\r\n\r\n",
            // One spelling per destination: no trailing dot, sign or leading zero.
            "CONNECT vm.:18084 HTTP/1.1\r\n\r\n",
            "CONNECT vm:018084 HTTP/1.1\r\n\r\n",
            "CONNECT vm:+18084 HTTP/1.1\r\n\r\n",
            "GET http://vm.:18084/ HTTP/1.1\r\n\r\n",
            "GET http://vm:+80/ HTTP/1.1\r\n\r\n",
        ] {
            assert!(parse_head(bad.as_bytes()).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn plain_requests_are_rewritten_to_origin_form_without_proxy_headers() {
        let head = b"GET http://example.com/v1/models?x=1 HTTP/1.1\r\nHost: example.com\r\n\
            Proxy-Authorization: Basic eA==\r\nProxy-Connection: keep-alive\r\nAccept: */*\r\n\r\n";
        let request = parse_head(head).expect("parses");
        assert_eq!((request.host.as_str(), request.port), ("example.com", 80));
        let forward = String::from_utf8(request.forward_head.expect("a head")).expect("utf-8");
        assert_eq!(
            forward,
            "GET /v1/models?x=1 HTTP/1.1\r\nHost: example.com\r\nAccept: */*\r\n\r\n"
        );
        let request = parse_head(b"POST http://127.0.0.1:8080 HTTP/1.1\r\n\r\n").expect("parses");
        assert_eq!(request.port, 8080);
        assert!(request
            .forward_head
            .expect("a head")
            .starts_with(b"POST / HTTP/1.1\r\n"));
        // Origin-form requests (a client that was not told it talks to a proxy) are refused.
        assert!(parse_head(b"GET /index.html HTTP/1.1\r\n\r\n").is_err());
        assert!(parse_head(b"GET https://example.com/ HTTP/1.1\r\n\r\n").is_err());
    }
}
