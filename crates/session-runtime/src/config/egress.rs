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
/// `HOST` is a DNS name (compared without regard to case or a trailing dot), an IPv4 address, or
/// an IPv6 address in brackets; `PORT` is 1 to 65535. There are no wildcards: each name is one
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

    /// Whether `host:port`, as a client names a destination (a name in any case, with or without
    /// a trailing dot, or an address, IPv6 with or without brackets), is this destination.
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
            (EgressHost::Name(name), Err(_)) => {
                let asked = bare.strip_suffix('.').unwrap_or(bare);
                name.eq_ignore_ascii_case(asked)
            }
            _ => false,
        }
    }

    /// Parses `"HOST:PORT"`, returning the reason it is wrong on failure.
    fn parse_reason(text: &str) -> Result<Self, String> {
        let wrong = |why: &str| format!("{text:?}: {why}; expected {EGRESS_EXPECTED}");
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
        let port = match port.parse::<u16>() {
            Ok(port) if port != 0 => port,
            _ => return Err(wrong("the port must be a number from 1 to 65535")),
        };
        Ok(EgressTarget { host, port })
    }
}

/// `name` lowercased and without a trailing dot, if it is a DNS name: labels of 1 to 63 letters,
/// digits and `-` (not first or last), at most 253 characters, not all digits.
fn check_dns_name(name: &str) -> Result<String, String> {
    let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
    if name.is_empty() {
        return Err("the host is empty".to_owned());
    }
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
