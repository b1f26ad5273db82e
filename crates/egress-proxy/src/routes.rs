//! Model routes: paths of the egress gateway that forward to a model provider with a credential
//! the gateway adds, so the agent never holds it.
//!
//! A worker profile lists them (`[[model_routes]]`); its agent is configured with the gateway as
//! its base URL (`http://GATEWAY/openai/v1`) and, as its API key, the session's proxy credential
//! ([`ProxyCredential::route_key`](crate::gateway::ProxyCredential::route_key)). The gateway
//! checks that key, replaces it with the value of the route's Secret (a file of the gateway's own
//! Pod, never the worker's or the broker's) and forwards the request to the route's upstream.

use std::fmt;
use std::path::{Path, PathBuf};

use http::header::{self, HeaderName};
use http::Uri;
use serde::Deserialize;

/// One route of a worker profile, as the administrator writes it:
///
/// ```toml
/// [[model_routes]]
/// prefix = "/openai/"                        # the gateway path it serves
/// upstream = "https://api.openai.com"        # where requests go, the path after the prefix appended
/// header = "Authorization"                   # the credential header (Authorization is "Bearer KEY")
/// secret = { name = "model-keys", key = "openai" }  # the Secret the gateway's Pod mounts
/// base_url_env = "OPENAI_BASE_URL"           # optional: the worker gets http://GATEWAY/openai here
/// key_env = "OPENAI_API_KEY"                 # optional: the worker gets its session's route key here
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelRoute {
    /// The path prefix the route serves, starting and ending with `/`.
    pub prefix: String,
    /// The provider's base URL (`http` or `https`, no query): a request for `PREFIX rest` goes to
    /// `UPSTREAM/rest`.
    pub upstream: String,
    /// The header that carries the credential, both ways: the worker's route key comes in it,
    /// the Secret's value goes out in it.
    pub header: String,
    /// Where the credential's value is.
    pub secret: SecretKey,
    /// An environment variable the runtime sets in the worker to the route's URL at the gateway.
    #[serde(default)]
    pub base_url_env: Option<String>,
    /// An environment variable the runtime sets in the worker to the session's route key.
    #[serde(default)]
    pub key_env: Option<String>,
}

/// A key of a Secret in the sessions namespace.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretKey {
    /// The Secret.
    pub name: String,
    /// The key within it.
    pub key: String,
}

/// Why a profile's `model_routes` were refused: the field of which entry, and the problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteError {
    /// The entry, from 1.
    pub entry: usize,
    /// The entry's field (`prefix`, `upstream`, ...).
    pub field: &'static str,
    /// What is wrong.
    pub problem: String,
}

impl fmt::Display for RouteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "entry {}: {}: {}", self.entry, self.field, self.problem)
    }
}

impl ModelRoute {
    /// Checks one route (entry `entry` of its profile's list).
    fn check(&self, entry: usize) -> Result<(), RouteError> {
        let error = |field, problem: String| RouteError {
            entry,
            field,
            problem,
        };
        let prefix_ok = self.prefix.len() > 2
            && self.prefix.starts_with('/')
            && self.prefix.ends_with('/')
            && self
                .prefix
                .split('/')
                .all(|segment| segment != "." && segment != "..")
            && self
                .prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"/-_.".contains(&b));
        if !prefix_ok {
            return Err(error(
                "prefix",
                format!(
                    "{:?} must be a path that starts and ends with / (letters, digits, - _ . and /), e.g. \"/openai/\"",
                    self.prefix
                ),
            ));
        }
        Upstream::parse(&self.upstream).map_err(|problem| error("upstream", problem))?;
        let name = HeaderName::try_from(self.header.as_str())
            .map_err(|_| error("header", format!("{:?} is not a header name", self.header)))?;
        if name == header::HOST
            || name == header::CONNECTION
            || name == header::TRANSFER_ENCODING
            || name == header::CONTENT_LENGTH
            || name.as_str().starts_with("proxy-")
        {
            return Err(error(
                "header",
                format!(
                    "{} is not a credential header (e.g. Authorization, x-api-key)",
                    self.header
                ),
            ));
        }
        if !is_dns_subdomain(&self.secret.name) {
            return Err(error(
                "secret.name",
                format!("{:?} is not a Secret name", self.secret.name),
            ));
        }
        let key_ok = !self.secret.key.is_empty()
            && self.secret.key.len() <= 253
            && self
                .secret
                .key
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
            && self.secret.key != "."
            && self.secret.key != "..";
        if !key_ok {
            return Err(error(
                "secret.key",
                format!("{:?} is not a Secret key", self.secret.key),
            ));
        }
        for (field, variable) in [("base_url_env", &self.base_url_env), ("key_env", &self.key_env)] {
            if let Some(variable) = variable {
                if !is_env_name(variable) {
                    return Err(error(
                        field,
                        format!("{variable:?} is not an environment variable name"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The header's name (checked by [`check_routes`]).
    pub(crate) fn header_name(&self) -> HeaderName {
        HeaderName::try_from(self.header.as_str()).unwrap_or(header::AUTHORIZATION)
    }

    /// The request path's rest after this route's prefix, if the route serves it.
    pub(crate) fn rest<'p>(&self, path: &'p str) -> Option<&'p str> {
        path.strip_prefix(self.prefix.as_str())
    }

    /// The route's URL at the gateway whose workers reach it at `authority`: what an agent is
    /// given as its base URL (without the prefix's last `/`).
    pub fn base_url(&self, authority: &str) -> String {
        format!("http://{authority}{}", self.prefix.trim_end_matches('/'))
    }

    /// The file holding the credential in a gateway that mounts Secrets under `secrets`
    /// (`SECRETS/NAME/KEY`, as a Secret volume at `SECRETS/NAME` lays it out).
    pub fn secret_file(&self, secrets: &Path) -> PathBuf {
        secrets.join(&self.secret.name).join(&self.secret.key)
    }
}

/// Checks a profile's routes: each valid, and no prefix listed twice or inside another (a path
/// must name one route).
///
/// # Errors
///
/// The first [`RouteError`].
pub fn check_routes(routes: &[ModelRoute]) -> Result<(), RouteError> {
    for (index, route) in routes.iter().enumerate() {
        route.check(index + 1)?;
        if let Some(earlier) = routes[..index].iter().position(|other| {
            other.prefix.starts_with(&route.prefix) || route.prefix.starts_with(&other.prefix)
        }) {
            return Err(RouteError {
                entry: index + 1,
                field: "prefix",
                problem: format!(
                    "{} overlaps entry {}'s {}: each path must name one route",
                    route.prefix,
                    earlier + 1,
                    routes[earlier].prefix
                ),
            });
        }
    }
    Ok(())
}

/// A route's upstream, parsed: scheme, host, port and base path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Upstream {
    pub(crate) tls: bool,
    pub(crate) host: String,
    pub(crate) port: u16,
    /// The base path, without a trailing `/` (empty for the root).
    pub(crate) path: String,
}

impl Upstream {
    pub(crate) fn parse(text: &str) -> Result<Upstream, String> {
        let uri: Uri = text.parse().map_err(|e| format!("{text:?} is not a URL: {e}"))?;
        let tls = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => return Err(format!("{text:?} must be an http:// or https:// URL")),
        };
        let authority = uri.authority().ok_or_else(|| format!("{text:?} names no host"))?;
        if authority.as_str().contains('@') {
            return Err(format!("{text:?} must not hold a user or password"));
        }
        if uri.query().is_some() {
            return Err(format!("{text:?} must not hold a query"));
        }
        let host = authority.host().trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(format!("{text:?} names no host"));
        }
        Ok(Upstream {
            tls,
            host: host.to_owned(),
            port: authority.port_u16().unwrap_or(if tls { 443 } else { 80 }),
            path: uri.path().trim_end_matches('/').to_owned(),
        })
    }

    /// `host:port` as a `Host` header and a log line say it.
    pub(crate) fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

fn is_dns_subdomain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

fn is_env_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    bytes.next().is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(prefix: &str, upstream: &str, header: &str) -> ModelRoute {
        ModelRoute {
            prefix: prefix.to_owned(),
            upstream: upstream.to_owned(),
            header: header.to_owned(),
            secret: SecretKey {
                name: "model-keys".to_owned(),
                key: "openai".to_owned(),
            },
            base_url_env: None,
            key_env: Some("OPENAI_API_KEY".to_owned()),
        }
    }

    #[test]
    fn a_route_is_checked_field_by_field() {
        let good = route("/openai/", "https://api.openai.com/v1/", "Authorization");
        assert_eq!(check_routes(std::slice::from_ref(&good)), Ok(()));
        let upstream = Upstream::parse(&good.upstream).expect("an upstream");
        assert_eq!(
            upstream,
            Upstream {
                tls: true,
                host: "api.openai.com".to_owned(),
                port: 443,
                path: "/v1".to_owned()
            }
        );
        let refused = [
            (route("openai/", "https://a.example", "Authorization"), "prefix"),
            (route("/openai", "https://a.example", "Authorization"), "prefix"),
            (route("/../", "https://a.example", "Authorization"), "prefix"),
            (route("/a b/", "https://a.example", "Authorization"), "prefix"),
            (route("/openai/", "ftp://a.example", "Authorization"), "upstream"),
            (
                route("/openai/", "https://u:p@a.example", "Authorization"),
                "upstream",
            ),
            (
                route("/openai/", "https://a.example/?k=v", "Authorization"),
                "upstream",
            ),
            (
                route("/openai/", "https://a.example", "Proxy-Authorization"),
                "header",
            ),
            (route("/openai/", "https://a.example", "Host"), "header"),
            (route("/openai/", "https://a.example", "bad header"), "header"),
        ];
        for (bad, field) in refused {
            let error = check_routes(std::slice::from_ref(&bad)).expect_err(&format!("{bad:?} refused"));
            assert_eq!((error.entry, error.field), (1, field), "{error}");
        }
        let mut bad_secret = good.clone();
        bad_secret.secret.name = "Model_Keys".to_owned();
        assert_eq!(
            check_routes(&[bad_secret]).expect_err("refused").field,
            "secret.name"
        );
        let mut bad_key = good.clone();
        bad_key.secret.key = "../key".to_owned();
        assert_eq!(check_routes(&[bad_key]).expect_err("refused").field, "secret.key");
        let mut bad_env = good.clone();
        bad_env.key_env = Some("1KEY".to_owned());
        assert_eq!(check_routes(&[bad_env]).expect_err("refused").field, "key_env");
    }

    #[test]
    fn two_routes_may_not_share_a_path() {
        let openai = route("/openai/", "https://api.openai.com", "Authorization");
        let nested = route("/openai/v2/", "https://other.example", "Authorization");
        let error = check_routes(&[openai.clone(), nested]).expect_err("overlap refused");
        assert_eq!((error.entry, error.field), (2, "prefix"));
        assert!(error.problem.contains("entry 1"), "{error}");
        let anthropic = route("/anthropic/", "https://api.anthropic.com", "x-api-key");
        assert_eq!(check_routes(&[openai, anthropic]), Ok(()));
    }

    #[test]
    fn a_route_serves_the_paths_under_its_prefix_and_names_its_files() {
        let openai = route("/openai/", "https://api.openai.com", "Authorization");
        assert_eq!(openai.rest("/openai/v1/responses"), Some("v1/responses"));
        assert_eq!(openai.rest("/openaiv1"), None);
        assert_eq!(openai.base_url("gw:3128"), "http://gw:3128/openai");
        assert_eq!(
            openai.secret_file(Path::new("/etc/oab-gateway/secrets")),
            Path::new("/etc/oab-gateway/secrets/model-keys/openai")
        );
    }
}
