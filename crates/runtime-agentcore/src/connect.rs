//! The SigV4-signed WebSocket to a runtime session's `/ws`: AgentCore routes it to the session's
//! microVM, where the relay serves it. The SDK has no WebSocket operation, so the upgrade is
//! signed here, afresh for every connection (a reconnect needs a new date and signature).

use std::fmt;
use std::io;
use std::sync::{Arc, OnceLock};
use std::time::SystemTime;

use async_trait::async_trait;
use aws_sigv4::http_request::{sign, SignableBody, SignableRequest, SigningSettings};
use aws_sigv4::sign::v4;
use aws_smithy_runtime_api::client::identity::Identity;
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::{HeaderName, HeaderValue};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Error as WsError;
use worker_relay::agentcore::SESSION_HEADER;
use worker_relay::transport::websocket_stream;
use worker_relay::{Connector, Refusal, Transport};

use crate::control::Aws;
use crate::errors::Failure;
use crate::trust::TrustRoots;

/// The SigV4 signing name of AgentCore's data plane.
const SIGNING_NAME: &str = "bedrock-agentcore";

/// The longest WebSocket message the relay's protocol needs (two of its largest frames).
const MAX_MESSAGE: usize = 2 << 20;

/// Opens signed WebSockets to one runtime session.
pub(crate) struct SignedConnector {
    aws: Arc<Aws>,
    runtime_session_id: String,
}

impl fmt::Debug for SignedConnector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SignedConnector")
            .field("runtime_session_id", &self.runtime_session_id)
            .finish_non_exhaustive()
    }
}

impl SignedConnector {
    pub(crate) fn new(aws: Arc<Aws>, runtime_session_id: String) -> Self {
        Self {
            aws,
            runtime_session_id,
        }
    }
}

/// `https://host/runtimes/<percent-encoded ARN>/ws?qualifier=Q` for the runtime's endpoint.
pub(crate) fn ws_url(endpoint: &str, arn: &str, qualifier: &str) -> String {
    format!(
        "{endpoint}/runtimes/{}/ws?qualifier={}",
        percent_encode(arn),
        percent_encode(qualifier)
    )
}

/// Encodes everything but RFC 3986's unreserved characters, as AWS's path labels need.
fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 3);
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

fn refused(message: String) -> io::Error {
    Refusal::new(false, message).into_io()
}

#[async_trait]
impl Connector for SignedConnector {
    async fn connect(&self) -> io::Result<Transport> {
        let aws = &self.aws;
        let https_url = ws_url(&aws.endpoint, &aws.arn, &aws.qualifier);
        let (secure, ws_url) = match https_url.split_once("://") {
            Some(("https", rest)) => (true, format!("wss://{rest}")),
            Some(("http", rest)) => (false, format!("ws://{rest}")),
            _ => return Err(refused(format!("the endpoint {https_url} is not http(s)"))),
        };
        let mut request = ws_url
            .as_str()
            .into_client_request()
            .map_err(|error| refused(format!("the WebSocket URL {ws_url}: {error}")))?;
        let host = request
            .uri()
            .authority()
            .map(|a| a.as_str().to_owned())
            .ok_or_else(|| refused(format!("the WebSocket URL {ws_url} has no host")))?;
        let session_value = HeaderValue::from_str(&self.runtime_session_id)
            .map_err(|error| refused(format!("the runtime session id: {error}")))?;
        request.headers_mut().insert(
            HeaderName::from_static("x-amzn-bedrock-agentcore-runtime-session-id"),
            session_value,
        );

        // Sign only what no proxy rewrites: the host and the session id (AgentCore routes by it).
        let credentials = aws.credentials().await.map_err(Failure::into_io)?;
        let identity = Identity::from(credentials);
        let settings = SigningSettings::default();
        let params = v4::SigningParams::builder()
            .identity(&identity)
            .region(&aws.region)
            .name(SIGNING_NAME)
            .time(SystemTime::now())
            .settings(settings)
            .build()
            .map_err(|error| refused(format!("signing the WebSocket upgrade: {error}")))?
            .into();
        let signed_headers = [
            ("host", host.as_str()),
            (SESSION_HEADER, self.runtime_session_id.as_str()),
        ];
        let signable = SignableRequest::new(
            "GET",
            https_url.as_str(),
            signed_headers.into_iter(),
            SignableBody::Bytes(&[]),
        )
        .map_err(|error| refused(format!("signing the WebSocket upgrade: {error}")))?;
        let (instructions, _signature) = sign(signable, &params)
            .map_err(|error| refused(format!("signing the WebSocket upgrade: {error}")))?
            .into_parts();
        for (name, value) in instructions.headers() {
            let (Ok(name), Ok(value)) = (HeaderName::try_from(name), HeaderValue::from_str(value)) else {
                return Err(refused(format!(
                    "the signature header {name} is not a valid header"
                )));
            };
            request.headers_mut().insert(name, value);
        }

        let uri = request.uri().clone();
        let hostname = uri.host().unwrap_or_default().trim_matches(['[', ']']).to_owned();
        let port = uri.port_u16().unwrap_or(if secure { 443 } else { 80 });
        let tcp = TcpStream::connect((hostname.as_str(), port)).await?;
        tcp.set_nodelay(true)?;
        let config = WebSocketConfig::default()
            .max_message_size(Some(MAX_MESSAGE))
            .max_frame_size(Some(MAX_MESSAGE));
        if secure {
            let tls = tls_connector().map_err(refused)?;
            let name = rustls::pki_types::ServerName::try_from(hostname.clone())
                .map_err(|error| refused(format!("the endpoint host {hostname}: {error}")))?;
            let stream = tls.connect(name, tcp).await?;
            let (socket, _) = tokio_tungstenite::client_async_with_config(request, stream, Some(config))
                .await
                .map_err(upgrade_failure)?;
            Ok(Box::new(websocket_stream(socket)))
        } else {
            let (socket, _) = tokio_tungstenite::client_async_with_config(request, tcp, Some(config))
                .await
                .map_err(upgrade_failure)?;
            Ok(Box::new(websocket_stream(socket)))
        }
    }
}

/// An upgrade AgentCore answered with an error: its `x-amzn-errortype` and message decide
/// whether the relay client tries again.
fn upgrade_failure(error: WsError) -> io::Error {
    match error {
        WsError::Http(response) => {
            let status = response.status().as_u16();
            let code = response
                .headers()
                .get("x-amzn-errortype")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let body = response
                .body()
                .as_deref()
                .map(String::from_utf8_lossy)
                .unwrap_or_default();
            let message = serde_json::from_str::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| {
                    v.get("message")
                        .or_else(|| v.get("Message"))
                        .and_then(|m| m.as_str())
                        .map(str::to_owned)
                })
                .unwrap_or_else(|| body.trim().to_owned());
            Failure {
                operation: "opening the session's WebSocket",
                code,
                status: Some(status),
                message,
            }
            .into_io()
        }
        WsError::Io(error) => error,
        other => io::Error::other(other),
    }
}

/// TLS for `wss://`: aws-lc-rs (the provider the AWS SDK uses) and the roots of
/// [`TrustRoots`] (the system's, else the compiled-in ones).
pub(crate) fn tls_connector() -> Result<tokio_rustls::TlsConnector, String> {
    static CONNECTOR: OnceLock<Result<tokio_rustls::TlsConnector, String>> = OnceLock::new();
    CONNECTOR
        .get_or_init(|| {
            let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
            let config = rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|error| format!("TLS: {error}"))?
                .with_root_certificates(TrustRoots::get().root_store())
                .with_no_client_auth();
            Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
        })
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_url_encodes_the_arn_as_a_path_label() {
        let url = ws_url(
            "https://bedrock-agentcore.us-east-1.amazonaws.com",
            "arn:aws:bedrock-agentcore:us-east-1:123456789012:runtime/my_agent-AbC",
            "DEFAULT",
        );
        assert_eq!(
            url,
            "https://bedrock-agentcore.us-east-1.amazonaws.com/runtimes/arn%3Aaws%3Abedrock-agentcore%3Aus-east-1%3A123456789012%3Aruntime%2Fmy_agent-AbC/ws?qualifier=DEFAULT"
        );
    }
}
