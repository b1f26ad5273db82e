//! Connections to a model route's upstream: TCP, and TLS for `https` upstreams, verified against
//! the system's roots (`rustls-native-certs`: the image's CA bundle, or the PEM bundle
//! `SSL_CERT_FILE` names), loaded once, on the first `https` request.

use std::sync::{Arc, OnceLock};

use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;
use tokio_util::either::Either;

use crate::routes::Upstream;

/// An open connection to an upstream: plain, or TLS.
pub(crate) type UpstreamStream = Either<TcpStream, Box<TlsStream<TcpStream>>>;

/// Connects to `upstream` (resolving its name; any address: the administrator chose it).
///
/// # Errors
///
/// What failed, in words: resolving, connecting, the trust roots or the TLS handshake.
pub(crate) async fn connect(upstream: &Upstream) -> Result<UpstreamStream, String> {
    let tcp = TcpStream::connect((upstream.host.as_str(), upstream.port))
        .await
        .map_err(|e| format!("connecting to {}: {e}", upstream.authority()))?;
    if !upstream.tls {
        return Ok(Either::Left(tcp));
    }
    let config = client_config()?;
    let name = ServerName::try_from(upstream.host.clone())
        .map_err(|e| format!("{} is not a TLS server name: {e}", upstream.host))?;
    let tls = TlsConnector::from(config)
        .connect(name, tcp)
        .await
        .map_err(|e| format!("TLS with {}: {e}", upstream.authority()))?;
    Ok(Either::Right(Box::new(tls)))
}

/// The TLS client configuration, with the system's roots.
fn client_config() -> Result<Arc<rustls::ClientConfig>, String> {
    static CONFIG: OnceLock<Result<Arc<rustls::ClientConfig>, String>> = OnceLock::new();
    CONFIG
        .get_or_init(|| {
            let loaded = rustls_native_certs::load_native_certs();
            let mut roots = rustls::RootCertStore::empty();
            let (added, _ignored) = roots.add_parsable_certificates(loaded.certs);
            if added == 0 {
                let errors: Vec<String> = loaded.errors.iter().map(ToString::to_string).collect();
                return Err(format!(
                    "no trusted root certificates for https upstreams (install ca-certificates or set \
                     SSL_CERT_FILE){}",
                    if errors.is_empty() {
                        String::new()
                    } else {
                        format!(": {}", errors.join("; "))
                    }
                ));
            }
            tracing::info!(roots = added, "trusted roots for https model routes");
            let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
            let mut config = rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| format!("TLS configuration: {e}"))?
                .with_root_certificates(roots)
                .with_no_client_auth();
            // hyper's client here speaks HTTP/1.1 only.
            config.alpn_protocols = vec![b"http/1.1".to_vec()];
            Ok(Arc::new(config))
        })
        .clone()
}
