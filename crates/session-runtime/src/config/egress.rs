//! One entry of `[session_runtime.local] egress`: a destination `host:port` that the sessions of
//! `network = "allowlist"` may reach.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use serde::{Deserialize, Serialize};

/// What an egress entry looks like, for error messages.
const EGRESS_EXPECTED: &str = "\"HOST:PORT\" with a DNS name or IP address and a port from 1 to 65535, \
     optionally followed by the kind of address a name may resolve to (loopback, private, \
     link-local or metadata), e.g. \"api.example.com:443\", \"127.0.0.1:8080\", \"[::1]:8080\" \
     or \"gateway.internal:8080 private\"";

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
///
/// **What a name may resolve to** ([`reach`](Self::reach)): a name's entry reaches only public
/// addresses unless it names another [`AddressKind`] after a space: `"gw.internal:8080
/// private"`, `"vm:18084 loopback"`, `"metadata.internal:80 metadata"`. A name that resolves to
/// an address of another kind (a rebinding, a changed record, a name the hosts file maps to
/// 127.0.0.1) is refused, so listing a name never opens the host's loopback, a private network or
/// a cloud metadata service by accident. `localhost` is a loopback entry by its name. An IP
/// address names its kind itself ([`AddressKind::of`]); a kind written after one must be that
/// kind. Addresses that are no destination (`0.0.0.0`, `::`, multicast, broadcast,
/// documentation and reserved ranges) and second spellings of an IPv4 address
/// (`[::ffff:127.0.0.1]`) are refused as entries.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EgressTarget {
    host: EgressHost,
    port: u16,
    reach: AddressKind,
}

/// What kind of address an IP address is, for what an [`EgressTarget`] may reach.
///
/// IPv4 addresses carried in IPv6 ones (IPv4-mapped `::ffff:a.b.c.d`, IPv4-compatible
/// `::a.b.c.d`, NAT64 `64:ff9b::/96`, 6to4 `2002::/16`) are of the kind of the IPv4 address they
/// carry: connecting to `::ffff:127.0.0.1` reaches the host's loopback.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AddressKind {
    /// Any other address: what a name's entry reaches unless it says otherwise.
    Public,
    /// The host itself: `127.0.0.0/8`, `::1`, and `0.0.0.0` / `::` (connecting to them reaches
    /// the host's own addresses).
    Loopback,
    /// A private network: `10/8`, `172.16/12`, `192.168/16`, `100.64/10` (shared address
    /// space), `192.0.0/24`, `fc00::/7`, `fec0::/10`.
    Private,
    /// `169.254/16` and `fe80::/10`, except the metadata addresses.
    LinkLocal,
    /// A cloud instance metadata service: `169.254.169.254`, `169.254.170.2`,
    /// `100.100.100.200`, `fd00:ec2::254`.
    Metadata,
    /// No destination: the rest of `0/8`, multicast, broadcast, documentation, benchmarking and
    /// reserved ranges. Never reachable.
    Unroutable,
}

impl AddressKind {
    /// The kind of `ip`.
    pub fn of(ip: IpAddr) -> AddressKind {
        match ip {
            IpAddr::V4(v4) => Self::of_v4(v4),
            IpAddr::V6(v6) => Self::of_v6(v6),
        }
    }

    fn of_v4(ip: Ipv4Addr) -> AddressKind {
        let [a, b, c, d] = ip.octets();
        match (a, b, c, d) {
            (0, 0, 0, 0) | (127, ..) => AddressKind::Loopback,
            (169, 254, 169, 254) | (169, 254, 170, 2) | (100, 100, 100, 200) => AddressKind::Metadata,
            (169, 254, ..) => AddressKind::LinkLocal,
            (10, ..) | (192, 168, ..) | (192, 0, 0, _) => AddressKind::Private,
            (172, b, ..) if (16..32).contains(&b) => AddressKind::Private,
            (100, b, ..) if (64..128).contains(&b) => AddressKind::Private,
            (0, ..) | (224..=255, ..) => AddressKind::Unroutable,
            (192, 0, 2, _) | (198, 51, 100, _) | (203, 0, 113, _) => AddressKind::Unroutable,
            (198, 18 | 19, ..) => AddressKind::Unroutable,
            _ => AddressKind::Public,
        }
    }

    fn of_v6(ip: Ipv6Addr) -> AddressKind {
        if ip.is_loopback() || ip.is_unspecified() {
            return AddressKind::Loopback;
        }
        let segments = ip.segments();
        let octets = ip.octets();
        let carried = |at: usize| Ipv4Addr::new(octets[at], octets[at + 1], octets[at + 2], octets[at + 3]);
        match segments {
            // IPv4-mapped, IPv4-compatible and NAT64: the last 32 bits are an IPv4 address.
            [0, 0, 0, 0, 0, 0xffff, _, _] | [0, 0, 0, 0, 0, 0, _, _] | [0x64, 0xff9b, 0, 0, 0, 0, _, _] => {
                Self::of_v4(carried(12))
            }
            // 6to4: bits 16 to 47 are the IPv4 address of the relay's side.
            [0x2002, ..] => Self::of_v4(carried(2)),
            [0xfd00, 0x0ec2, 0, 0, 0, 0, 0, 0x0254] => AddressKind::Metadata,
            [first, ..] if first & 0xfe00 == 0xfc00 || first & 0xffc0 == 0xfec0 => AddressKind::Private,
            [first, ..] if first & 0xffc0 == 0xfe80 => AddressKind::LinkLocal,
            [first, ..] if first & 0xff00 == 0xff00 => AddressKind::Unroutable,
            [0x2001, 0x0db8, ..] => AddressKind::Unroutable,
            _ => AddressKind::Public,
        }
    }

    /// The word an entry names the kind with (`public`, `loopback`, `private`, `link-local`,
    /// `metadata`; `unroutable` is no entry's).
    pub fn as_str(self) -> &'static str {
        match self {
            AddressKind::Public => "public",
            AddressKind::Loopback => "loopback",
            AddressKind::Private => "private",
            AddressKind::LinkLocal => "link-local",
            AddressKind::Metadata => "metadata",
            AddressKind::Unroutable => "unroutable",
        }
    }

    /// The kind an entry's word names.
    fn from_word(word: &str) -> Option<AddressKind> {
        [
            AddressKind::Public,
            AddressKind::Loopback,
            AddressKind::Private,
            AddressKind::LinkLocal,
            AddressKind::Metadata,
        ]
        .into_iter()
        .find(|kind| kind.as_str() == word)
    }
}

impl fmt::Display for AddressKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
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

    /// `host:port`, an IPv6 host in brackets: the destination as a client names it, without
    /// the kind of address an entry allows.
    pub fn authority(&self) -> String {
        match &self.host {
            EgressHost::Ip(IpAddr::V6(ip)) => format!("[{ip}]:{}", self.port),
            _ => format!("{}:{}", self.host(), self.port),
        }
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

    /// The kind of address the destination may be reached at: an IP address's own kind; for a
    /// name, the kind its entry names ([`AddressKind::Public`] unless it says otherwise;
    /// [`AddressKind::Loopback`] for `localhost`).
    pub fn reach(&self) -> AddressKind {
        self.reach
    }

    /// Whether `ip`, an address the destination's name resolved to, is one this entry may reach
    /// (it is of the entry's [`reach`](Self::reach)). For an IP address entry, only that address.
    pub fn allows_address(&self, ip: IpAddr) -> bool {
        match self.host {
            EgressHost::Ip(own) => own == ip,
            EgressHost::Name(_) => AddressKind::of(ip) == self.reach,
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
        if authority.contains(char::is_whitespace) {
            return Err(format!("{authority:?}: a destination has no spaces"));
        }
        match (has_port, default_port) {
            (true, _) => Self::parse_destination(authority),
            (false, Some(port)) => Self::parse_destination(&format!("{authority}:{port}")),
            (false, None) => Err(format!("{authority:?}: no `:PORT`")),
        }
    }

    /// Parses `"HOST:PORT"` with an optional kind after a space, returning the reason it is
    /// wrong on failure.
    fn parse_reason(text: &str) -> Result<Self, String> {
        let wrong = |why: String| format!("{text:?}: {why}; expected {EGRESS_EXPECTED}");
        // The kind is a last word without a `:`; a space elsewhere is the destination's
        // (and refused with it).
        let (destination, word) = match text.rsplit_once(' ') {
            Some((destination, word)) if !word.contains(':') => (destination, Some(word)),
            _ => (text, None),
        };
        let mut target = Self::parse_destination(destination)?;
        let Some(word) = word else {
            return Ok(target);
        };
        let kind = AddressKind::from_word(word).ok_or_else(|| {
            wrong(format!(
                "{word:?} is not a kind of address (loopback, private, link-local, metadata or public)"
            ))
        })?;
        match target.host {
            EgressHost::Ip(_) if kind != target.reach => Err(wrong(format!(
                "{destination} is a {} address, not {kind}",
                target.reach
            ))),
            EgressHost::Name(ref name) if name == "localhost" && kind != AddressKind::Loopback => {
                Err(wrong("localhost is a loopback destination".to_owned()))
            }
            _ => {
                target.reach = kind;
                Ok(target)
            }
        }
    }

    /// Parses `"HOST:PORT"`, returning the reason it is wrong on failure.
    fn parse_destination(text: &str) -> Result<Self, String> {
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
        let reach = match &host {
            EgressHost::Name(name) if name == "localhost" => AddressKind::Loopback,
            EgressHost::Name(_) => AddressKind::Public,
            EgressHost::Ip(ip) => {
                if ip.is_unspecified() {
                    return Err(wrong(
                        "an unspecified address (0.0.0.0, ::) is no destination (connecting to it \
                         reaches the host itself): write 127.0.0.1 or ::1",
                    ));
                }
                if let IpAddr::V6(v6) = ip {
                    if let Some(v4) = v6.to_ipv4_mapped() {
                        return Err(wrong(&format!(
                            "an IPv4-mapped address is a second spelling of {v4}: write {v4}"
                        )));
                    }
                }
                let kind = AddressKind::of(*ip);
                if kind == AddressKind::Unroutable {
                    return Err(wrong(
                        "a multicast, broadcast, documentation or reserved address is no destination",
                    ));
                }
                kind
            }
        };
        Ok(EgressTarget { host, port, reach })
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
    /// Formats as `HOST:PORT`, the configuration syntax (IPv6 in brackets), followed by the kind
    /// of address when a name's entry names one other than its default.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            EgressHost::Name(name) => {
                write!(f, "{name}:{}", self.port)?;
                let default = if name == "localhost" {
                    AddressKind::Loopback
                } else {
                    AddressKind::Public
                };
                if self.reach != default {
                    write!(f, " {}", self.reach)?;
                }
                Ok(())
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(text: &str) -> AddressKind {
        AddressKind::of(text.parse().expect("an address"))
    }

    #[test]
    fn addresses_are_classified_by_what_connecting_to_them_reaches() {
        for (address, expected) in [
            ("127.0.0.1", AddressKind::Loopback),
            ("127.1.2.3", AddressKind::Loopback),
            ("0.0.0.0", AddressKind::Loopback),
            ("::1", AddressKind::Loopback),
            ("::", AddressKind::Loopback),
            ("::ffff:127.0.0.1", AddressKind::Loopback),
            ("::127.0.0.1", AddressKind::Loopback),
            ("64:ff9b::7f00:1", AddressKind::Loopback),
            ("2002:7f00:1::", AddressKind::Loopback),
            ("169.254.169.254", AddressKind::Metadata),
            ("::ffff:169.254.169.254", AddressKind::Metadata),
            ("fd00:ec2::254", AddressKind::Metadata),
            ("169.254.1.1", AddressKind::LinkLocal),
            ("fe80::1", AddressKind::LinkLocal),
            ("10.1.2.3", AddressKind::Private),
            ("172.16.0.1", AddressKind::Private),
            ("172.31.255.255", AddressKind::Private),
            ("192.168.1.1", AddressKind::Private),
            ("100.64.0.1", AddressKind::Private),
            ("fd12::1", AddressKind::Private),
            ("::ffff:10.0.0.1", AddressKind::Private),
            ("172.32.0.1", AddressKind::Public),
            ("8.8.8.8", AddressKind::Public),
            ("2606:4700::1111", AddressKind::Public),
            ("255.255.255.255", AddressKind::Unroutable),
            ("224.0.0.1", AddressKind::Unroutable),
            ("0.1.2.3", AddressKind::Unroutable),
            ("192.0.2.1", AddressKind::Unroutable),
            ("ff02::1", AddressKind::Unroutable),
        ] {
            assert_eq!(kind(address), expected, "{address}");
        }
    }

    #[test]
    fn a_names_entry_reaches_public_addresses_unless_it_names_another_kind() {
        let public = EgressTarget::parse("api.example.com:443").expect("parses");
        assert_eq!(public.reach(), AddressKind::Public);
        assert!(public.allows_address("8.8.8.8".parse().expect("ip")));
        for other in [
            "127.0.0.1",
            "::ffff:127.0.0.1",
            "0.0.0.0",
            "169.254.169.254",
            "10.0.0.1",
            "fe80::1",
        ] {
            assert!(!public.allows_address(other.parse().expect("ip")), "{other}");
        }
        let loopback = EgressTarget::parse("vm:18084 loopback").expect("parses");
        assert_eq!(loopback.reach(), AddressKind::Loopback);
        assert_eq!(loopback.to_string(), "vm:18084 loopback");
        assert!(loopback.matches("VM", 18084));
        assert!(loopback.allows_address("127.0.0.1".parse().expect("ip")));
        assert!(!loopback.allows_address("8.8.8.8".parse().expect("ip")));
        let metadata = EgressTarget::parse("metadata.internal:80 metadata").expect("parses");
        assert!(metadata.allows_address("169.254.169.254".parse().expect("ip")));
        assert!(!metadata.allows_address("169.254.1.1".parse().expect("ip")));
        let localhost = EgressTarget::parse("localhost:80").expect("parses");
        assert_eq!(localhost.reach(), AddressKind::Loopback);
        assert_eq!(localhost.to_string(), "localhost:80");
        // An address names its own kind; a word after it must agree.
        assert_eq!(
            EgressTarget::parse("169.254.169.254:80").expect("parses").reach(),
            AddressKind::Metadata
        );
        assert!(EgressTarget::parse("127.0.0.1:80 loopback").is_ok());
        for bad in [
            "127.0.0.1:80 private",
            "localhost:80 public",
            "a.com:80 everywhere",
            "a.com:80 unroutable",
            "a.com:80  private",
            "0.0.0.0:80",
            "[::]:80",
            "[::ffff:127.0.0.1]:80",
            "255.255.255.255:80",
            "224.0.0.1:80",
        ] {
            assert!(EgressTarget::parse(bad).is_err(), "{bad}");
        }
        // A client names a destination without a kind.
        assert!(EgressTarget::parse_authority("vm:80 loopback", None).is_err());
    }
}
