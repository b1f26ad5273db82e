//! Which destinations a session may reach, and at which addresses.

use std::net::{IpAddr, SocketAddr};

use session_runtime::config::{AddressKind, EgressTarget};

use crate::Refusal;

/// A session's egress entries: `host:port` destinations, each with the kind of address it may
/// be reached at ([`EgressTarget::reach`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Allowlist {
    targets: Vec<EgressTarget>,
}

impl Allowlist {
    /// The allowlist of `targets` (checked by the configuration: no duplicates, valid ports).
    pub fn new(targets: Vec<EgressTarget>) -> Self {
        Allowlist { targets }
    }

    /// The entries.
    pub fn targets(&self) -> &[EgressTarget] {
        &self.targets
    }

    /// The entry of `host:port`, as a client of the proxy names it, if it is listed.
    pub fn entry(&self, host: &str, port: u16) -> Option<&EgressTarget> {
        self.targets.iter().find(|target| target.matches(host, port))
    }
}

/// The addresses `host:port` may be reached at under `entry`: an address entry's own; for a
/// name, those it resolves to (once: these are the addresses connected to) that are of the kind
/// the entry allows, so a name cannot be pointed at a private, loopback, link-local or metadata
/// address unless its entry says so.
///
/// # Errors
///
/// The refusal to answer: `502` if the name does not resolve, `403` if it resolves only to
/// addresses of another kind (saying which, and how to allow them).
pub(crate) async fn addresses(
    entry: &EgressTarget,
    host: &str,
    port: u16,
) -> Result<Vec<SocketAddr>, Refusal> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        // The entry's own address (`matches` compared them); its kind is the entry's.
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let resolved: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
        .await
        .map_err(|e| Refusal::bad_gateway(format!("resolving {host}: {e}")))?
        .collect();
    let (allowed, other): (Vec<SocketAddr>, Vec<SocketAddr>) = resolved
        .into_iter()
        .partition(|address| entry.allows_address(address.ip()));
    if allowed.is_empty() {
        let kinds: Vec<String> = other
            .iter()
            .map(|address| format!("{} ({})", address.ip(), AddressKind::of(address.ip())))
            .collect();
        return Err(Refusal::forbidden(format!(
            "{host} resolves to {}, not to a {} address as its egress entry allows \
             (an entry \"{host}:{port} KIND\" allows another kind)",
            if kinds.is_empty() {
                "nothing".to_owned()
            } else {
                kinds.join(", ")
            },
            entry.reach()
        )));
    }
    Ok(allowed)
}
