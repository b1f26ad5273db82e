//! The operational endpoints of `oab-runtime controller` and `oab-egress-gateway`, on a port of
//! their own (never the gateway's proxy port, which workers reach):
//!
//! - `GET /metrics`: everything recorded through the [`metrics`] facade, in Prometheus text
//!   format (the process's recorder is [`install`]ed once, at start);
//! - `GET /healthz`: `200 ok` while the process serves at all (a liveness probe);
//! - `GET /readyz`: `200 ready` once the process said it is ready ([`Readiness::set`]), `503`
//!   before and after (a readiness probe);
//! - anything else: `404`.
//!
//! Libraries never install a recorder: an embedding broker chooses its own exporter. Only these
//! two binaries do, through [`install`].

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;
pub use tokio_util::sync::CancellationToken;

/// The histogram buckets of every `*_seconds` metric: from a fast API call to a slow image pull.
const SECONDS_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
/// How long a scraper may take to send its request.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);

/// Installs this process's Prometheus recorder as the global one, describes the runtimes'
/// metrics ([`session_runtime::telemetry::describe`]), and returns the handle that renders
/// them.
///
/// # Errors
///
/// A message when a recorder is installed already, or the buckets are refused.
pub fn install() -> Result<PrometheusHandle, String> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".to_owned()), SECONDS_BUCKETS)
        .map_err(|e| format!("the metrics buckets: {e}"))?
        .install_recorder()
        .map_err(|e| format!("installing the metrics recorder: {e}"))?;
    session_runtime::telemetry::describe();
    Ok(handle)
}

/// Whether the process is ready to serve, as `/readyz` reports it. Clones share one flag.
#[derive(Debug, Clone, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    /// Not ready yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Says whether the process is ready.
    pub fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::SeqCst);
    }

    /// Whether it is.
    pub fn is_ready(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// What a binary does to offer the endpoints: [`install`]s the recorder, listens on `address`
/// and [`serve`]s there, in the background, until `stop`.
///
/// # Errors
///
/// A message when the recorder cannot be installed or `address` cannot be listened on.
pub async fn start(address: SocketAddr, readiness: Readiness, stop: CancellationToken) -> Result<(), String> {
    let metrics = install()?;
    let listener = TcpListener::bind(address)
        .await
        .map_err(|error| format!("listening on {address}: {error}"))?;
    tokio::spawn(serve(listener, metrics, readiness, stop));
    Ok(())
}

/// Serves the endpoints on `listener` until `stop`, one request per connection.
pub async fn serve(
    listener: TcpListener,
    metrics: PrometheusHandle,
    readiness: Readiness,
    stop: CancellationToken,
) {
    loop {
        let stream = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    tracing::debug!("accepting a metrics connection: {error}");
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_millis(100)) => continue,
                    }
                }
            },
        };
        let metrics = metrics.clone();
        let readiness = readiness.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                let response = answer(&request, &metrics, &readiness);
                async move { Ok::<_, Infallible>(response) }
            });
            let mut builder = http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(HEAD_TIMEOUT)
                .keep_alive(false);
            tokio::select! {
                () = stop.cancelled() => {}
                _ = builder.serve_connection(TokioIo::new(stream), service) => {}
            }
        });
    }
}

/// The answer to `request`.
fn answer(
    request: &Request<Incoming>,
    metrics: &PrometheusHandle,
    readiness: &Readiness,
) -> Response<Full<Bytes>> {
    let text = |status: StatusCode, content_type: &'static str, body: String| {
        let mut response = Response::new(Full::new(Bytes::from(body)));
        *response.status_mut() = status;
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static(content_type),
        );
        response
    };
    if request.method() != Method::GET {
        return text(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "GET only\n".to_owned(),
        );
    }
    match request.uri().path() {
        "/metrics" => {
            metrics.run_upkeep();
            text(StatusCode::OK, "text/plain; version=0.0.4", metrics.render())
        }
        "/healthz" => text(StatusCode::OK, "text/plain", "ok\n".to_owned()),
        "/readyz" if readiness.is_ready() => text(StatusCode::OK, "text/plain", "ready\n".to_owned()),
        "/readyz" => text(
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            "not ready\n".to_owned(),
        ),
        _ => text(StatusCode::NOT_FOUND, "text/plain", "not found\n".to_owned()),
    }
}
