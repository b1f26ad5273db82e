//! Which root certificates the runtime trusts for AWS's endpoints, for both of its HTTPS clients
//! (the SDK's, for `StopRuntimeSession` and the wipe invocation, and the `wss://` connector of
//! the session stream).
//!
//! The system's roots come first (`rustls-native-certs`: the distribution's CA bundle, or the
//! PEM bundle `SSL_CERT_FILE` / `SSL_CERT_DIR` name), so an operator's own CAs and the
//! distribution's updates apply. A system that offers none (an image without `ca-certificates`,
//! `SSL_CERT_FILE` pointing at an empty file) gets the Mozilla roots compiled into the broker
//! (`webpki-root-certs`) instead of failing every call. The two are never mixed: a system store
//! that has any usable root is taken as the operator's choice. The choice is made once per
//! process and logged.

use std::fmt;
use std::sync::OnceLock;

use aws_smithy_http_client::tls::TrustStore;
use rustls::pki_types::CertificateDer;
use rustls::RootCertStore;

/// Where the trusted roots came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TrustSource {
    /// The system's CA bundle (or the one `SSL_CERT_FILE` / `SSL_CERT_DIR` name).
    System,
    /// The Mozilla roots compiled into the broker (`webpki-root-certs`).
    CompiledIn,
}

impl fmt::Display for TrustSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::System => "the system's CA bundle",
            Self::CompiledIn => "the Mozilla roots compiled into the broker (webpki-root-certs)",
        })
    }
}

/// The trusted roots: each one a certificate rustls accepts as a trust anchor.
#[derive(Debug, Clone)]
pub(crate) struct TrustRoots {
    certs: Vec<CertificateDer<'static>>,
    source: TrustSource,
}

impl TrustRoots {
    /// The roots to trust given the system's (`native`): those of them rustls can use, or the
    /// compiled-in ones when none is usable.
    pub(crate) fn choose(native: Vec<CertificateDer<'static>>) -> Self {
        let usable = usable(native);
        if usable.is_empty() {
            Self {
                certs: usable_compiled_in(),
                source: TrustSource::CompiledIn,
            }
        } else {
            Self {
                certs: usable,
                source: TrustSource::System,
            }
        }
    }

    /// This process's roots: the system's, loaded once, or the compiled-in ones.
    pub(crate) fn get() -> &'static Self {
        static ROOTS: OnceLock<TrustRoots> = OnceLock::new();
        ROOTS.get_or_init(|| {
            let loaded = rustls_native_certs::load_native_certs();
            for error in &loaded.errors {
                tracing::debug!(%error, "loading the system's root certificates");
            }
            let roots = Self::choose(loaded.certs);
            tracing::info!(roots = roots.len(), source = %roots.source, "trusted roots for AWS endpoints");
            roots
        })
    }

    /// Where they came from.
    #[cfg(test)]
    pub(crate) fn source(&self) -> TrustSource {
        self.source
    }

    /// How many there are.
    pub(crate) fn len(&self) -> usize {
        self.certs.len()
    }

    /// A rustls store of them (for the `wss://` connector).
    pub(crate) fn root_store(&self) -> RootCertStore {
        let mut store = RootCertStore::empty();
        store.add_parsable_certificates(self.certs.iter().cloned());
        store
    }

    /// The SDK's trust store of exactly these roots, its own loading of the system's turned off
    /// (so both clients trust the same, and the SDK never meets a root it cannot parse).
    pub(crate) fn sdk_trust_store(&self) -> TrustStore {
        TrustStore::empty()
            .with_native_roots(false)
            .with_pem_certificate(to_pem(&self.certs).into_bytes())
    }
}

/// `certs` as one PEM bundle.
fn to_pem(certs: &[CertificateDer<'static>]) -> String {
    let mut pem = String::new();
    for cert in certs {
        pem.push_str("-----BEGIN CERTIFICATE-----\n");
        let encoded = data_encoding::BASE64.encode(cert.as_ref());
        // Base64 is ASCII, so every 64-byte cut falls on a character boundary.
        let mut rest = encoded.as_str();
        while !rest.is_empty() {
            let (line, tail) = rest.split_at(rest.len().min(64));
            pem.push_str(line);
            pem.push('\n');
            rest = tail;
        }
        pem.push_str("-----END CERTIFICATE-----\n");
    }
    pem
}

/// The certificates of `certs` that rustls accepts as trust anchors, in order.
fn usable(certs: Vec<CertificateDer<'static>>) -> Vec<CertificateDer<'static>> {
    certs
        .into_iter()
        .filter(|cert| RootCertStore::empty().add(cert.clone()).is_ok())
        .collect()
}

/// The compiled-in Mozilla roots that rustls accepts (all of them, in practice).
fn usable_compiled_in() -> Vec<CertificateDer<'static>> {
    usable(webpki_root_certs::TLS_SERVER_ROOT_CERTS.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::pki_types::pem::PemObject;

    #[test]
    fn a_system_without_roots_gets_the_compiled_in_ones() {
        let roots = TrustRoots::choose(Vec::new());
        assert_eq!(roots.source(), TrustSource::CompiledIn);
        assert!(roots.len() > 100, "{} roots", roots.len());
        assert_eq!(roots.root_store().len(), roots.len());
    }

    #[test]
    fn unusable_system_certificates_count_as_none() {
        let roots = TrustRoots::choose(vec![CertificateDer::from(b"not a certificate".to_vec())]);
        assert_eq!(roots.source(), TrustSource::CompiledIn);
    }

    #[test]
    fn a_system_store_with_roots_is_used_alone() {
        let one = webpki_root_certs::TLS_SERVER_ROOT_CERTS[0].clone();
        let roots = TrustRoots::choose(vec![one.clone(), CertificateDer::from(b"junk".to_vec())]);
        assert_eq!(roots.source(), TrustSource::System);
        assert_eq!(roots.len(), 1);
        assert_eq!(roots.root_store().len(), 1);
    }

    /// Run by [`an_empty_ssl_cert_file_still_leaves_roots`] in a process of its own, with
    /// `SSL_CERT_FILE` naming an empty file: this process's roots and both clients.
    #[test]
    #[ignore = "run by an_empty_ssl_cert_file_still_leaves_roots with SSL_CERT_FILE set"]
    fn child_roots_with_an_empty_ssl_cert_file() {
        let roots = TrustRoots::get();
        assert_eq!(roots.source(), TrustSource::CompiledIn);
        assert!(roots.len() > 100, "{} roots", roots.len());
        crate::connect::tls_connector().expect("the wss:// connector");
        let _sdk = crate::control::https_client();
    }

    #[test]
    fn an_empty_ssl_cert_file_still_leaves_roots() {
        let dir = tempfile::tempdir().expect("a directory");
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, b"").expect("an empty bundle");
        let exe = std::env::current_exe().expect("this test binary");
        let child = std::process::Command::new(exe)
            .args([
                "--ignored",
                "--exact",
                "trust::tests::child_roots_with_an_empty_ssl_cert_file",
            ])
            .env("SSL_CERT_FILE", &empty)
            .env_remove("SSL_CERT_DIR")
            .output()
            .expect("run the child test");
        let stdout = String::from_utf8_lossy(&child.stdout);
        assert!(
            child.status.success() && stdout.contains("1 passed"),
            "{stdout}{}",
            String::from_utf8_lossy(&child.stderr)
        );
    }

    #[test]
    fn the_sdk_store_holds_exactly_the_roots_as_pem() {
        let roots = TrustRoots::choose(Vec::new());
        let debug = format!("{:?}", roots.sdk_trust_store());
        assert!(debug.contains("enable_native_roots: false"), "{debug}");
        let pem = to_pem(&roots.certs);
        assert!(
            pem.lines().all(|line| line.len() <= 64),
            "PEM lines are at most 64 characters"
        );
        let decoded: Vec<_> = CertificateDer::pem_slice_iter(pem.as_bytes())
            .collect::<Result<_, _>>()
            .expect("valid PEM");
        assert_eq!(decoded, roots.certs);
    }
}
