//! Faults in front of the real API server: a tower layer on a test's client that answers chosen
//! requests with an error status instead of passing them on, and records every request it sees
//! (for counting). Everything else is the real API server's answer; only what it cannot be made
//! to do on demand (a 5xx, throttling, a broken watch) is made up here.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http_body_util::BodyExt;
use kube::client::{Body, ClientBuilder, DynBody};
use parking_lot::Mutex;
use tower::{BoxError, Layer, Service};

pub use http::Method;

/// Answers `times` requests of `method` whose path and query contain `target` with `status`,
/// after letting the first `skip` of them through.
#[derive(Debug, Clone)]
pub struct Rule {
    /// The request method.
    pub method: http::Method,
    /// A part of the path and query.
    pub target: String,
    /// How many matching requests pass first.
    pub skip: usize,
    /// How many are then answered.
    pub times: usize,
    /// With this HTTP status (and a `Status` body like the API server's).
    pub status: u16,
}

/// The rules of one client, what they answered, and every request the client sent.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    rules: Arc<Mutex<Vec<Rule>>>,
    answered: Arc<Mutex<Vec<String>>>,
    requests: Arc<Mutex<Vec<(http::Method, String)>>>,
}

impl Faults {
    /// No rules yet: every request passes (and is recorded).
    pub fn new() -> Faults {
        Faults::default()
    }

    /// Adds a rule; the first rule with answers left that matches a request decides.
    pub fn add(&self, rule: Rule) {
        self.rules.lock().push(rule);
    }

    /// Every request so far, as method and path (no query), in order.
    pub fn requests(&self) -> Vec<(http::Method, String)> {
        self.requests.lock().clone()
    }

    /// Forgets the requests recorded so far.
    pub fn clear_requests(&self) {
        self.requests.lock().clear();
    }

    /// The requests a rule answered: `METHOD path?query -> status`.
    pub fn answered(&self) -> Vec<String> {
        self.answered.lock().clone()
    }

    /// A client for `config` with these faults in front of the API server.
    pub fn client(&self, config: kube::Config) -> kube::Client {
        ClientBuilder::try_from(config)
            .expect("a client stack")
            .with_layer(&FaultLayer(self.clone()))
            .build()
    }

    fn take(&self, request: &http::Request<Body>) -> Option<u16> {
        self.requests
            .lock()
            .push((request.method().clone(), request.uri().path().to_owned()));
        let target = request
            .uri()
            .path_and_query()
            .map_or_else(String::new, |p| p.as_str().to_owned());
        let mut rules = self.rules.lock();
        let rule = rules.iter_mut().find(|rule| {
            rule.times > 0 && rule.method == request.method() && target.contains(&rule.target)
        })?;
        if rule.skip > 0 {
            rule.skip -= 1;
            return None;
        }
        rule.times -= 1;
        let status = rule.status;
        self.answered
            .lock()
            .push(format!("{} {target} -> {status}", request.method()));
        Some(status)
    }
}

struct FaultLayer(Faults);

impl<S> Layer<S> for FaultLayer {
    type Service = FaultService<S>;
    fn layer(&self, inner: S) -> FaultService<S> {
        FaultService {
            faults: self.0.clone(),
            inner,
        }
    }
}

/// The service [`Faults::client`] puts in front of the client's stack.
pub struct FaultService<S> {
    faults: Faults,
    inner: S,
}

impl<S> std::fmt::Debug for FaultService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultService")
            .field("faults", &self.faults)
            .finish_non_exhaustive()
    }
}

type Answer = http::Response<Box<DynBody>>;

impl<S> Service<http::Request<Body>> for FaultService<S>
where
    S: Service<http::Request<Body>, Response = Answer, Error = BoxError>,
    S::Future: Send + 'static,
{
    type Response = Answer;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Answer, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let Some(status) = self.faults.take(&request) else {
            return Box::pin(self.inner.call(request));
        };
        // The API server's own shape for an error: a Status object.
        let body = serde_json::json!({
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "message": format!("injected by the test: {status}"),
            "reason": if status == 429 { "TooManyRequests" } else { "InternalError" },
            "code": status,
        })
        .to_string();
        let body: Box<DynBody> = Box::new(Body::from(body.into_bytes()).map_err(BoxError::from));
        let mut answer = http::Response::new(body);
        *answer.status_mut() =
            http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
        answer.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        Box::pin(std::future::ready(Ok(answer)))
    }
}
