//! One entry of `[session_runtime.local] egress`: a destination `host:port` that the sessions of
//! `network = "allowlist"` may reach.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use serde::{Deserialize, Serialize};

/// What an egress entry looks like, for error messages.
const EGRESS_EXPECTED: &str = "\"HOST:PORT\" with a DNS name or IP address and a port from 1 to 65535, \
     e.g. \"api.example.com:443\", \"127.0.0.1:8080\" or \"[::1]:8080\"";

/// A destination a session with `network = "allowlist"` may reach: one entry of `egress`,
/// written `"HOST:PORT"`.
///
/// `HOST` is a DNS name (compared without regard to case), an IPv4 address, or an IPv6 address in
/// brackets; `PORT` is 1 to 65535 in decimal digits. Each destination has one spelling: a name
/// with a trailing dot, a port with a sign or a leading zero, and a URL (`http://a.com:443`) are
/// refused rather than read as something else. There are no wildcards: each name is one
/// destination. A loopback destination (`localhost`, `127.0.0.0/8`, `::1`) is
/// [`is_loopback`](Self::is_loopback): the local runtime forwards it to the same port inside the
/// session, the others are reached through the session's HTTP proxy.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EgressTarget {
    host: EgressHost,
    port: u16,
}

/// The host part of an [`EgressTarget`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum EgressHost {
    /// A DNS name, lowercase, without a trailing dot.
    Name(String),
    /// An IP address.
    Ip(IpAddr),
}

impl EgressTarget {
    /// Parses `"HOST:PORT"` (see the type's documentation).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`](crate::Error::InvalidConfig) with key
    /// `session_runtime.local.egress`, saying what is wrong.
    pub fn parse(text: &str) -> crate::Result<Self> {
        Self::parse_reason(text).map_err(|reason| crate::Error::InvalidConfig {
            key: "session_runtime.local.egress".to_owned(),
            reason,
        })
    }

    /// The host: a lowercase DNS name, or an IP address as text (IPv6 without brackets).
    pub fn host(&self) -> String {
        match &self.host {
            EgressHost::Name(name) => name.clone(),
            EgressHost::Ip(ip) => ip.to_string(),
        }
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The IP address, when the host is one rather than a name.
    pub fn ip(&self) -> Option<IpAddr> {
        match self.host {
            EgressHost::Name(_) => None,
            EgressHost::Ip(ip) => Some(ip),
        }
    }

    /// Whether the destination is on the host's loopback interface: `localhost`, an address of
    /// `127.0.0.0/8`, or `::1`.
    pub fn is_loopback(&self) -> bool {
        match &self.host {
            EgressHost::Name(name) => name == "localhost",
            EgressHost::Ip(ip) => ip.is_loopback(),
        }
    }

    /// The loopback address the destination is reached at, for a loopback destination
    /// (`localhost` is `127.0.0.1`).
    pub fn loopback_ip(&self) -> Option<IpAddr> {
        match &self.host {
            EgressHost::Name(name) if name == "localhost" => Some(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            EgressHost::Ip(ip) if ip.is_loopback() => Some(*ip),
            _ => None,
        }
    }

    /// Whether `host:port`, as a client names a destination (a name in any case, or an address,
    /// IPv6 with or without brackets), is this destination. A host this type would refuse to
    /// parse, such as a name with a trailing dot, matches nothing.
    pub fn matches(&self, host: &str, port: u16) -> bool {
        if port != self.port {
            return false;
        }
        let bare = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        match (&self.host, bare.parse::<IpAddr>()) {
            (EgressHost::Ip(ip), Ok(asked)) => *ip == asked,
            (EgressHost::Name(name), Err(_)) => check_dns_name(bare).is_ok_and(|asked| *name == asked),
            _ => false,
        }
    }

    /// Parses a destination as an HTTP proxy's client names it: `authority` is `HOST:PORT` (or
    /// `HOST` alone when `default_port` is given, as in `http://host/`), in the same single
    /// spelling as an `egress` entry.
    ///
    /// # Errors
    ///
    /// Why `authority` is not one destination, in a few words.
    pub fn parse_authority(authority: &str, default_port: Option<u16>) -> Result<Self, String> {
        let has_port = match authority.strip_prefix('[') {
            Some(rest) => !rest.ends_with(']'),
            None => authority.contains(':'),
        };
        match (has_port, default_port) {
            (true, _) => Self::parse_reason(authority),
            (false, Some(port)) => Self::parse_reason(&format!("{authority}:{port}")),
            (false, None) => Err(format!("{authority:?}: no `:PORT`")),
        }
    }

    /// Parses `"HOST:PORT"`, returning the reason it is wrong on failure.
    fn parse_reason(text: &str) -> Result<Self, String> {
        let wrong = |why: &str| format!("{text:?}: {why}; expected {EGRESS_EXPECTED}");
        if text.contains("://") {
            return Err(wrong(
                "a URL is not a destination: write only the host and port, without a scheme or path \
                 (e.g. \"a.com:443\" for https://a.com)",
            ));
        }
        if text.contains('/') {
            return Err(wrong("a destination has no path: write only the host and port"));
        }
        let (host, port) = if let Some(rest) = text.strip_prefix('[') {
            let (ip, port) = rest
                .split_once("]:")
                .ok_or_else(|| wrong("an IPv6 address in brackets must be followed by `:PORT`"))?;
            let ip: Ipv6Addr = ip.parse().map_err(|_| wrong("not an IPv6 address"))?;
            (EgressHost::Ip(IpAddr::V6(ip)), port)
        } else {
            let (host, port) = text.rsplit_once(':').ok_or_else(|| wrong("no `:PORT`"))?;
            if host.contains(':') {
                return Err(wrong("an IPv6 address must be written in brackets"));
            }
            let host = match host.parse::<Ipv4Addr>() {
                Ok(ip) => EgressHost::Ip(IpAddr::V4(ip)),
                Err(_) => EgressHost::Name(check_dns_name(host).map_err(|why| wrong(&why))?),
            };
            (host, port)
        };
        // One spelling per port: `u16::from_str` would also take `+443` and `0443`.
        let canonical =
            !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) && !port.starts_with('0');
        let port = match port.parse::<u16>() {
            Ok(port) if canonical => port,
            _ => return Err(wrong(
                "the port must be a number from 1 to 65535 in decimal digits, without a sign or leading zero",
            )),
        };
        Ok(EgressTarget { host, port })
    }
}

/// `name` lowercased, if it is a DNS name: labels of 1 to 63 letters, digits and `-` (not first or
/// last), at most 253 characters, not all digits, and no trailing dot (the fully qualified
/// spelling of the same name would be a second spelling of one destination).
fn check_dns_name(name: &str) -> Result<String, String> {
    if name.is_empty() {
        return Err("the host is empty".to_owned());
    }
    if name.ends_with('.') {
        return Err("a name is written without a trailing dot".to_owned());
    }
    let name = name.to_ascii_lowercase();
    if name.contains('*') {
        return Err("wildcards are not supported: list each host".to_owned());
    }
    if name.len() > 253 {
        return Err("a DNS name has at most 253 characters".to_owned());
    }
    for label in name.split('.') {
        let good = !label.is_empty()
            && label.len() <= 63
            && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !label.starts_with('-')
            && !label.ends_with('-');
        if !good {
            return Err(format!(
                "{label:?} is not a DNS label (1 to 63 letters, digits and `-`)"
            ));
        }
    }
    // An address the IPv4 parser refused, such as 300.1.1.1 or 10.1, is not a name either.
    if name.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return Err("not an IPv4 address".to_owned());
    }
    Ok(name)
}

impl fmt::Display for EgressTarget {
    /// Formats as `HOST:PORT`, the configuration syntax (IPv6 in brackets).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            EgressHost::Name(name) => write!(f, "{name}:{}", self.port),
            EgressHost::Ip(IpAddr::V6(ip)) => write!(f, "[{ip}]:{}", self.port),
            EgressHost::Ip(IpAddr::V4(ip)) => write!(f, "{ip}:{}", self.port),
        }
    }
}

impl std::str::FromStr for EgressTarget {
    type Err = crate::Error;

    fn from_str(text: &str) -> crate::Result<Self> {
        EgressTarget::parse(text)
    }
}

impl Serialize for EgressTarget {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for EgressTarget {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        /// Accepts a `"HOST:PORT"` string.
        struct TargetVisitor;

        impl serde::de::Visitor<'_> for TargetVisitor {
            type Value = EgressTarget;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(EGRESS_EXPECTED)
            }

            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<EgressTarget, E> {
                EgressTarget::parse_reason(text).map_err(E::custom)
            }
        }

        deserializer.deserialize_str(TargetVisitor)
    }
}
