//! A Kubernetes client that counts its requests by verb ([`telemetry::API_REQUESTS`]): a tower
//! layer under kube's own stack, so every request the runtime makes is counted once, whichever
//! API handle made it.

use std::task::{Context, Poll};

use http::{Method, Request};
use kube::client::ClientBuilder;
use kube::{Client, Config};
use session_runtime::telemetry;
use tower::{Layer, Service};

use crate::RUNTIME;

/// A client for `config` whose requests are counted.
///
/// # Errors
///
/// kube's, when the configuration cannot make a client (a bad certificate, say).
pub fn metered_client(config: Config) -> Result<Client, kube::Error> {
    Ok(ClientBuilder::try_from(config)?.with_layer(&Metered).build())
}

/// The counting layer.
#[derive(Debug, Clone, Copy)]
struct Metered;

impl<S> Layer<S> for Metered {
    type Service = MeteredService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        MeteredService(inner)
    }
}

#[derive(Debug, Clone)]
struct MeteredService<S>(S);

impl<S, B> Service<Request<B>> for MeteredService<S>
where
    S: Service<Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        telemetry::api_request(RUNTIME, verb(request.method(), request.uri()));
        self.0.call(request)
    }
}

/// The Kubernetes verb of a request: its method, and whether its path names a collection or one
/// object (`/api/v1/namespaces/NS/pods` or `.../pods/NAME`, a subresource counting as the object).
fn verb(method: &Method, uri: &http::Uri) -> &'static str {
    let path = uri.path().trim_matches('/');
    let rest = if let Some(rest) = path.strip_prefix("api/") {
        // api/VERSION/...
        rest.split_once('/').map_or("", |(_, rest)| rest)
    } else if let Some(rest) = path.strip_prefix("apis/") {
        // apis/GROUP/VERSION/...
        rest.splitn(3, '/').nth(2).unwrap_or("")
    } else {
        return "other";
    };
    let segments: Vec<&str> = rest.split('/').filter(|s| !s.is_empty()).collect();
    // namespaces/NS/RESOURCE...: the namespace's own objects follow; namespaces/NS alone is one.
    let resource_path = match segments.as_slice() {
        ["namespaces", _, rest @ ..] if !rest.is_empty() => rest,
        all => all,
    };
    let collection = resource_path.len() <= 1;
    let watch = uri.query().is_some_and(|query| {
        query
            .split('&')
            .any(|pair| pair == "watch=true" || pair == "watch=1")
    });
    match (method, collection) {
        (&Method::GET, true) if watch => "watch",
        (&Method::GET, true) => "list",
        (&Method::GET, false) => "get",
        (&Method::POST, _) => "create",
        (&Method::PUT, _) => "update",
        (&Method::PATCH, _) => "patch",
        (&Method::DELETE, true) => "deletecollection",
        (&Method::DELETE, false) => "delete",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_named_by_their_kubernetes_verb() {
        let cases = [
            (Method::GET, "/api/v1/namespaces/s/pods?labelSelector=a", "list"),
            (
                Method::GET,
                "/api/v1/namespaces/s/pods?watch=true&resourceVersion=1",
                "watch",
            ),
            (Method::GET, "/api/v1/namespaces/s/pods/w-1", "get"),
            (Method::GET, "/api/v1/namespaces/s/pods/w-1/log", "get"),
            (Method::GET, "/api/v1/namespaces/s", "get"),
            (Method::GET, "/api/v1/nodes", "list"),
            (
                Method::GET,
                "/apis/coordination.k8s.io/v1/namespaces/s/leases/a",
                "get",
            ),
            (Method::POST, "/api/v1/namespaces/s/pods", "create"),
            (
                Method::PUT,
                "/apis/coordination.k8s.io/v1/namespaces/s/leases/a",
                "update",
            ),
            (
                Method::PATCH,
                "/apis/networking.k8s.io/v1/namespaces/s/networkpolicies/p",
                "patch",
            ),
            (Method::DELETE, "/api/v1/namespaces/s/pods/w-1", "delete"),
            (Method::DELETE, "/api/v1/namespaces/s/pods", "deletecollection"),
            (Method::GET, "/version", "other"),
        ];
        for (method, uri, expected) in cases {
            let uri: http::Uri = uri.parse().expect("a URI");
            assert_eq!(verb(&method, &uri), expected, "{method} {uri}");
        }
    }
}
