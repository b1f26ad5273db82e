//! One connection of a session to its proxy, served by hyper's HTTP/1 server.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode, Uri};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use session_runtime::config::EgressTarget;
use session_runtime::telemetry;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use crate::allowlist::addresses;
use crate::bounds::{ConnectionSlot, SessionBounds, HEAD_TIMEOUT, MAX_HEAD};
use crate::gateway::ServedRoute;
use crate::{upstream, Admission, Admitted, LogSafe, Refusal};

/// How long resolving a destination's name and connecting to it may take, together.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

/// What the proxy answers with: a refusal's text, or a destination's response as it streams.
type ProxyBody = BoxBody<Bytes, hyper::Error>;

/// Serves one connection to the proxy until it ends or `stop`: its request is served for, and
/// within the bounds of, the session `admission` says it comes from.
pub async fn serve_connection<I>(io: I, admission: Arc<dyn Admission>, stop: CancellationToken)
where
    I: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let service = {
        let admission = Arc::clone(&admission);
        let stop = stop.clone();
        service_fn(move |request| {
            let admission = Arc::clone(&admission);
            let stop = stop.clone();
            async move {
                let kind = kind_of(&request);
                let response = match admission.admit(&request) {
                    Ok(admitted) => handle(request, admitted, stop)
                        .await
                        .unwrap_or_else(|refusal| answer(&refusal)),
                    Err(refusal) => {
                        admission.refused(&refusal.reason);
                        answer(&refusal)
                    }
                };
                telemetry::egress_request(kind, response.status().as_u16());
                Ok::<_, Infallible>(response)
            }
        })
    };
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT)
        .max_buf_size(MAX_HEAD)
        // One request per connection: the deadline covers the one head, never an idle wait.
        .keep_alive(false);
    let connection = builder
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades();
    let result = tokio::select! {
        () = stop.cancelled() => return,
        result = connection => result,
    };
    if let Err(error) = result {
        // hyper has answered a malformed or oversized head itself (400, 431); a head not
        // complete in time is closed without an answer.
        if error.is_parse_too_large() {
            admission.refused(&format!("request head longer than {MAX_HEAD} bytes"));
        } else if error.is_parse() {
            admission.refused(&format!("malformed request: {error}"));
        } else if error.is_timeout() {
            admission.refused(&format!("no complete request head within {HEAD_TIMEOUT:?}"));
        } else {
            tracing::debug!("egress connection ended: {error}");
        }
    }
}

/// What `request` asks of the proxy, as [`telemetry::EGRESS_REQUESTS`] labels it.
fn kind_of(request: &Request<Incoming>) -> &'static str {
    if request.method() == Method::CONNECT {
        "connect"
    } else if request.uri().scheme_str() == Some("http") {
        "http"
    } else if crate::gateway::is_route_request(request) {
        "route"
    } else {
        "other"
    }
}

/// Serves `request` of an `admitted` session, or says why not (every refusal is counted and
/// logged here).
async fn handle(
    request: Request<Incoming>,
    admitted: Admitted,
    stop: CancellationToken,
) -> Result<Response<ProxyBody>, Refusal> {
    let Admitted {
        allowlist,
        route,
        bounds,
        slot,
    } = admitted;
    if let Some(route) = route {
        return serve_route(request, &route, &bounds, stop).await;
    }
    let target = destination_of(&request).inspect_err(|refusal| bounds.refuse(None, &refusal.reason))?;
    let destination = target.authority();
    let Some(entry) = allowlist.entry(&target.host(), target.port()) else {
        bounds.refuse(Some(&destination), "not in the session's allowlist");
        return Err(Refusal::forbidden(format!(
            "{destination} is not in this session's egress allowlist"
        )));
    };
    let upstream = connect(entry, &target, &destination)
        .await
        .inspect_err(|refusal| {
            if refusal.status == StatusCode::FORBIDDEN {
                bounds.refuse(Some(&destination), &refusal.reason);
            } else {
                bounds.note(&destination, &refusal.reason);
            }
        })?;
    tracing::debug!(session = %bounds.session(), destination = %destination, "egress connected");
    if request.method() == Method::CONNECT {
        tokio::spawn(tunnel(request, upstream, slot, stop));
        return Ok(Response::new(empty()));
    }
    forward(request, upstream, stop).await.map_err(|error| {
        let reason = format!("forwarding to {destination}: {error}");
        bounds.note(&destination, &reason);
        Refusal::bad_gateway(reason)
    })
}

/// The destination `request` names: `CONNECT host:port`, or an absolute `http://` target (port
/// 80 by default), in the one spelling an egress entry has
/// ([`EgressTarget::parse_authority`]: a name with a trailing dot, or a port with a sign or a
/// leading zero, is refused rather than passed on as a second spelling of a destination).
fn destination_of(request: &Request<Incoming>) -> Result<EgressTarget, Refusal> {
    let uri = request.uri();
    if request.method() == Method::CONNECT {
        let authority = uri
            .authority()
            .filter(|_| uri.scheme().is_none())
            .ok_or_else(|| Refusal::bad_request(format!("CONNECT needs host:port, found {uri}")))?;
        return EgressTarget::parse_authority(authority.as_str(), None).map_err(|why| {
            Refusal::bad_request(format!("CONNECT needs host:port, found {authority}: {why}"))
        });
    }
    let (Some("http"), Some(authority)) = (uri.scheme_str(), uri.authority()) else {
        return Err(Refusal::bad_request(format!(
            "{} {uri}: the proxy serves CONNECT and absolute http:// requests only",
            request.method()
        )));
    };
    EgressTarget::parse_authority(authority.as_str(), Some(80))
        .map_err(|why| Refusal::bad_request(format!("bad authority in {uri}: {why}")))
}

/// Connects to the first address of `target` that answers, among those its `entry` allows.
async fn connect(
    entry: &EgressTarget,
    target: &EgressTarget,
    destination: &str,
) -> Result<TcpStream, Refusal> {
    let connected = tokio::time::timeout(CONNECT_TIMEOUT, async {
        let addresses: Vec<SocketAddr> = addresses(entry, &target.host(), target.port()).await?;
        let mut last = None;
        for address in &addresses {
            match TcpStream::connect(address).await {
                Ok(stream) => return Ok(stream),
                Err(error) => last = Some(error),
            }
        }
        Err(Refusal::bad_gateway(format!(
            "connecting to {destination}: {}",
            last.map_or_else(|| "no address".to_owned(), |error| error.to_string())
        )))
    })
    .await;
    connected.unwrap_or_else(|_| {
        Err(Refusal::new(
            StatusCode::GATEWAY_TIMEOUT,
            format!("connecting to {destination} timed out"),
        ))
    })
}

/// Joins the connection that `request` (a `CONNECT`) upgrades, once answered, to `upstream`,
/// holding the connection's `slot` until the tunnel ends or `stop`.
async fn tunnel(
    request: Request<Incoming>,
    mut upstream: TcpStream,
    slot: Arc<ConnectionSlot>,
    stop: CancellationToken,
) {
    let _slot = slot;
    let Ok(upgraded) = hyper::upgrade::on(request).await else {
        return;
    };
    let mut inside = TokioIo::new(upgraded);
    tokio::select! {
        () = stop.cancelled() => {}
        _ = tokio::io::copy_bidirectional(&mut inside, &mut upstream) => {}
    }
}

/// Sends `request` to `upstream` in origin form (`GET /path`), without the headers meant for
/// the proxy (`Proxy-*`), and returns the destination's response as it streams.
async fn forward(
    request: Request<Incoming>,
    upstream: TcpStream,
    stop: CancellationToken,
) -> Result<Response<ProxyBody>, hyper::Error> {
    let (mut parts, body) = request.into_parts();
    parts.uri = parts
        .uri
        .path_and_query()
        .map_or_else(|| Uri::from_static("/"), |path| Uri::from(path.clone()));
    remove_proxy_headers(&mut parts.headers);
    send(Request::from_parts(parts, body), upstream, stop).await
}

/// Forwards a request for model route `route` to its upstream, its route key (which the
/// admission checked) replaced by the route's credential, and returns the upstream's response
/// as it streams. Every use is logged with the session, the route and the status, never a
/// credential.
async fn serve_route(
    request: Request<Incoming>,
    route: &ServedRoute,
    bounds: &SessionBounds,
    stop: CancellationToken,
) -> Result<Response<ProxyBody>, Refusal> {
    let prefix = route.route.prefix.as_str();
    let unusable = |reason: String| {
        bounds.note(prefix, &reason);
        Refusal::bad_gateway(reason)
    };
    let upstream = route
        .upstream
        .as_ref()
        .map_err(|problem| unusable(format!("model route {prefix} has no usable upstream: {problem}")))?;
    let rest = route
        .route
        .rest(request.uri().path())
        .unwrap_or_default()
        .to_owned();
    // The upstream's other paths are not the route's, whatever the upstream makes of dots.
    if rest.split('/').any(|segment| segment == "." || segment == "..")
        || rest.to_ascii_lowercase().contains("%2e")
    {
        let reason = format!("a dot segment in {}", LogSafe(request.uri().path()));
        bounds.refuse(Some(prefix), &reason);
        return Err(Refusal::bad_request(reason));
    }
    let credential = credential_value(route).map_err(unusable)?;

    let (mut parts, body) = request.into_parts();
    let target = match parts.uri.query() {
        Some(query) => format!("{}/{rest}?{query}", upstream.path),
        None => format!("{}/{rest}", upstream.path),
    };
    parts.uri = target
        .parse()
        .map_err(|e| Refusal::bad_request(format!("a path the upstream cannot be sent: {e}")))?;
    remove_proxy_headers(&mut parts.headers);
    for hop in [header::CONNECTION, header::TE, header::TRAILER, header::UPGRADE] {
        parts.headers.remove(hop);
    }
    parts.headers.remove("keep-alive");
    // The route key (`SESSION.PROFILE:TOKEN`) may also sit in another header (another route's
    // credential header, say): it never leaves the gateway.
    let marker = format!("{}.", bounds.session());
    let carrying: Vec<header::HeaderName> = parts
        .headers
        .iter()
        .filter(|(_, value)| {
            value
                .as_bytes()
                .windows(marker.len())
                .any(|window| window == marker.as_bytes())
        })
        .map(|(name, _)| name.clone())
        .collect();
    for name in carrying {
        parts.headers.remove(name);
    }
    parts.headers.insert(route.header.clone(), credential);
    let host = if upstream.port == if upstream.tls { 443 } else { 80 } {
        upstream.host.clone()
    } else {
        upstream.authority()
    };
    let host = header::HeaderValue::from_str(&host)
        .map_err(|_| unusable(format!("model route {prefix}: {host} is not a Host header")))?;
    parts.headers.insert(header::HOST, host);

    let connection = tokio::time::timeout(CONNECT_TIMEOUT, upstream::connect(upstream))
        .await
        .unwrap_or_else(|_| Err(format!("connecting to {} timed out", upstream.authority())))
        .map_err(|reason| unusable(format!("model route {prefix}: {reason}")))?;
    let response = send(Request::from_parts(parts, body), connection, stop)
        .await
        .map_err(|e| unusable(format!("model route {prefix}: {}: {e}", upstream.authority())))?;
    tracing::info!(
        session = %bounds.session(),
        route = prefix,
        status = response.status().as_u16(),
        "model route"
    );
    Ok(response)
}

/// The value `route`'s credential header is sent with: its Secret's (read at each request, so a
/// rotated Secret applies as soon as the kubelet updates the file), as `Bearer VALUE` in
/// `Authorization`.
fn credential_value(route: &ServedRoute) -> Result<header::HeaderValue, String> {
    let unreadable = |problem: String| {
        format!(
            "model route {}: the credential (Secret {} key {}, {}): {problem}",
            route.route.prefix,
            route.route.secret.name,
            route.route.secret.key,
            route.secret_file.display()
        )
    };
    // A file of a few bytes on the kubelet's tmpfs: read in place, which costs less than the
    // hop to a blocking thread (measured: benches/gateway.rs, `route`).
    let value = std::fs::read_to_string(&route.secret_file).map_err(|e| unreadable(e.to_string()))?;
    let value = value.trim_end_matches(['\r', '\n']);
    if value.is_empty() {
        return Err(unreadable("it is empty".to_owned()));
    }
    let value = if route.header == header::AUTHORIZATION {
        format!("Bearer {value}")
    } else {
        value.to_owned()
    };
    let mut value = header::HeaderValue::from_str(&value)
        .map_err(|_| unreadable("it is not a valid header value".to_owned()))?;
    value.set_sensitive(true);
    Ok(value)
}

/// Removes the headers meant for the proxy (`Proxy-*`).
fn remove_proxy_headers(headers: &mut header::HeaderMap) {
    let proxy_only: Vec<header::HeaderName> = headers
        .keys()
        .filter(|name| name.as_str().starts_with("proxy-"))
        .cloned()
        .collect();
    for name in proxy_only {
        headers.remove(name);
    }
}

/// Sends `request` over `io` with hyper's HTTP/1 client and returns the response as it streams;
/// the connection lives until the response has been read, or `stop`.
async fn send<I>(
    request: Request<Incoming>,
    io: I,
    stop: CancellationToken,
) -> Result<Response<ProxyBody>, hyper::Error>
where
    I: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(async move {
        tokio::select! {
            () = stop.cancelled() => {}
            _ = connection => {}
        }
    });
    let response = sender.send_request(request).await?;
    Ok(response.map(BodyExt::boxed))
}

/// The answer to `refusal`: its status, with the reason as a plain-text body.
fn answer(refusal: &Refusal) -> Response<ProxyBody> {
    let mut response = Response::new(
        Full::new(Bytes::from(format!("{}\n", refusal.reason)))
            .map_err(|never| match never {})
            .boxed(),
    );
    *response.status_mut() = refusal.status;
    if refusal.status == StatusCode::PROXY_AUTHENTICATION_REQUIRED {
        response.headers_mut().insert(
            header::PROXY_AUTHENTICATE,
            header::HeaderValue::from_static("Basic realm=\"openab egress\""),
        );
    }
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain"),
    );
    response
}

fn empty() -> ProxyBody {
    Full::new(Bytes::new()).map_err(|never| match never {}).boxed()
}
