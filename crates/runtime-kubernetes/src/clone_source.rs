//! Where a git clone seed may come from: the profile's `seed_hosts`, and the check every clone
//! URL passes before it is recorded.
//!
//! A seed Job runs `git clone` with a URL the broker's caller chose, inside the cluster. Left
//! open, that URL could name another session's repository on a shared volume (a local path or
//! `file://`), run a command through a transport helper (`ext::`), or probe any address the Job
//! reaches and return the answer in git's error. So a clone URL must be an absolute URL whose
//! scheme and host (and port) an entry of the administrator's profile names; anything else is
//! refused at create, before any object exists. The seed Job repeats the scheme to git itself
//! (`GIT_ALLOW_PROTOCOL`) and follows no redirect, so git cannot be talked into another
//! transport or host after the check.

use std::fmt;

use url::{Host, Url};

/// The transports a seed may use. Local ones (`file`, paths) and helpers (`ext`, `fd`) never.
const SCHEMES: [(&str, u16); 4] = [("https", 443), ("http", 80), ("ssh", 22), ("git", 9418)];

/// One allowed origin of clone URLs: a scheme, a host and a port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeedHost {
    scheme: &'static str,
    /// Lowercase; an IPv6 address in brackets, as [`Url`] writes it.
    host: String,
    port: u16,
}

impl SeedHost {
    /// Parses a `seed_hosts` entry: `HOST`, `HOST:PORT` (both `https`), or
    /// `SCHEME://HOST[:PORT]` with `SCHEME` one of `https`, `http`, `ssh`, `git`. A port left out
    /// is the scheme's own (443, 80, 22, 9418), and only that port is allowed.
    ///
    /// # Errors
    /// A reason, with an example, when the entry is not of that form (a path, credentials, a
    /// query, an unknown scheme).
    pub fn parse(entry: &str) -> Result<SeedHost, String> {
        let example = "e.g. \"github.com\", \"git.example.com:8443\" or \"ssh://git.example.com\"";
        let text = if entry.contains("://") {
            entry.to_owned()
        } else {
            format!("https://{entry}")
        };
        let url =
            Url::parse(&text).map_err(|error| format!("{entry:?} is not a host: {error}; {example}"))?;
        let bare = matches!(url.path(), "" | "/");
        if !bare || url.query().is_some() || url.fragment().is_some() {
            return Err(format!(
                "{entry:?} has a path; an entry names a host, not a repository, {example}"
            ));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(format!(
                "{entry:?} holds credentials; name only the host, {example}"
            ));
        }
        let (scheme, port) = scheme_and_port(&url)
            .ok_or_else(|| format!("{entry:?}: the scheme must be https, http, ssh or git, {example}"))?;
        let host = canonical_host(&url).ok_or_else(|| format!("{entry:?} names no host, {example}"))?;
        Ok(SeedHost { scheme, host, port })
    }

    /// Whether `url` is of this origin.
    fn allows(&self, url: &Url) -> bool {
        scheme_and_port(url) == Some((self.scheme, self.port))
            && canonical_host(url).as_deref() == Some(&self.host)
    }
}

impl<'de> serde::Deserialize<'de> for SeedHost {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<SeedHost, D::Error> {
        let entry = String::deserialize(deserializer)?;
        SeedHost::parse(&entry).map_err(serde::de::Error::custom)
    }
}

impl fmt::Display for SeedHost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://{}:{}", self.scheme, self.host, self.port)
    }
}

/// A clone URL that passed [`check_clone_url`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CloneUrl {
    /// The URL as the caller wrote it (git gets exactly what was checked).
    pub(crate) url: String,
    /// Its transport, for `GIT_ALLOW_PROTOCOL`.
    pub(crate) scheme: &'static str,
}

/// Checks a clone URL against the profile's allowed origins.
///
/// # Errors
/// A reason naming what is wrong and what to do: not an absolute URL (a local path, `scp`-like
/// `host:path`, `ext::`), a scheme other than `https`, `http`, `ssh` or `git`, credentials in
/// the URL, or a host and port no entry of `seed_hosts` names.
pub(crate) fn check_clone_url(url: &str, allowed: &[SeedHost]) -> Result<CloneUrl, String> {
    if url.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(format!("{url:?} contains whitespace or a control character"));
    }
    let parsed = Url::parse(url).map_err(|_| {
        format!(
            "{url:?} is not an absolute URL; a seed clones from a host the profile's seed_hosts names, \
             e.g. \"https://github.com/org/repo.git\" (local paths, file:// and scp-like host:path are refused)"
        )
    })?;
    let (scheme, _) = scheme_and_port(&parsed).ok_or_else(|| {
        format!(
            "{url:?}: the scheme {:?} is not allowed for a seed; use https, http, ssh or git",
            parsed.scheme()
        )
    })?;
    if parsed.password().is_some() || (scheme != "ssh" && !parsed.username().is_empty()) {
        return Err(format!(
            "{url:?} holds credentials; they would be stored in the session record: give the seed \
             credentials through the profile's home_template instead"
        ));
    }
    if !allowed.iter().any(|origin| origin.allows(&parsed)) {
        let host = canonical_host(&parsed).unwrap_or_default();
        let listed = if allowed.is_empty() {
            "the profile's seed_hosts is empty, so no clone seed is allowed".to_owned()
        } else {
            let names: Vec<String> = allowed.iter().map(SeedHost::to_string).collect();
            format!("the profile's seed_hosts allows {}", names.join(", "))
        };
        return Err(format!(
            "{url:?}: {scheme}://{host}:{} is not an allowed seed source ({listed}); an administrator adds it to seed_hosts",
            scheme_and_port(&parsed).map_or(0, |(_, port)| port)
        ));
    }
    Ok(CloneUrl {
        url: url.to_owned(),
        scheme,
    })
}

/// The URL's scheme, if a seed may use it, and its port (the scheme's own when unwritten).
fn scheme_and_port(url: &Url) -> Option<(&'static str, u16)> {
    let (scheme, default) = SCHEMES.iter().find(|(scheme, _)| *scheme == url.scheme())?;
    Some((scheme, url.port().unwrap_or(*default)))
}

/// The host in one canonical form: lowercase names without a trailing dot, addresses as
/// [`Url`] normalises them (so `0x7f.1` and `127.0.0.1` are one host). `None` without a host.
fn canonical_host(url: &Url) -> Option<String> {
    match url.host()? {
        Host::Domain(name) => {
            let name = name.to_ascii_lowercase();
            let name = name.strip_suffix('.').unwrap_or(&name);
            (!name.is_empty()).then(|| name.to_owned())
        }
        Host::Ipv4(address) => Some(address.to_string()),
        Host::Ipv6(address) => Some(format!("[{address}]")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(entries: &[&str]) -> Vec<SeedHost> {
        entries
            .iter()
            .map(|entry| SeedHost::parse(entry).expect("a valid entry"))
            .collect()
    }

    #[test]
    fn a_url_of_a_listed_origin_passes_and_keeps_its_text() {
        let allowed = hosts(&["github.com", "git://10.244.0.9", "ssh://git.example.com:2222"]);
        for (url, scheme) in [
            ("https://github.com/org/repo.git", "https"),
            ("https://GitHub.com./org/repo", "https"),
            ("https://github.com:443/org/repo", "https"),
            ("git://10.244.0.9/repo", "git"),
            ("ssh://git@git.example.com:2222/org/repo.git", "ssh"),
        ] {
            let checked = check_clone_url(url, &allowed).unwrap_or_else(|reason| panic!("{url}: {reason}"));
            assert_eq!(checked.url, url);
            assert_eq!(checked.scheme, scheme, "{url}");
        }
    }

    #[test]
    fn local_paths_helpers_and_unlisted_origins_are_refused() {
        let allowed = hosts(&["github.com", "git://10.244.0.9"]);
        for url in [
            "/session/abcdefghijklmnopqrst/workspace",
            "../other/workspace",
            "file:///session/abcdefghijklmnopqrst/workspace",
            "ext::sh -c touch% /tmp/pwned",
            "ext::sh",
            "fd::3",
            "git@github.com:org/repo.git",
            "github.com:org/repo.git",
            "http://github.com/org/repo",
            "https://github.com:8443/org/repo",
            "https://evil.example/org/repo",
            "https://github.com.evil.example/org/repo",
            "git://10.244.0.10/repo",
            "git://10.244.0.9:9419/repo",
            "https://169.254.169.254/latest/meta-data",
            "https://user:token@github.com/org/repo",
            "https://token@github.com/org/repo",
            "https://github.com/org/repo\n",
            "",
        ] {
            assert!(check_clone_url(url, &allowed).is_err(), "{url:?} must be refused");
        }
    }

    #[test]
    fn nothing_is_allowed_without_seed_hosts_and_the_reason_says_so() {
        let reason = check_clone_url("https://github.com/org/repo", &[]).expect_err("refused");
        assert!(reason.contains("seed_hosts is empty"), "{reason}");
    }

    #[test]
    fn an_address_matches_in_any_spelling_url_accepts() {
        let allowed = hosts(&["https://127.0.0.1"]);
        assert!(check_clone_url("https://0x7f.1/repo", &allowed).is_ok());
        // Hosts of other schemes stay opaque text to the URL parser: only the listed spelling.
        let allowed = hosts(&["git://127.0.0.1"]);
        assert!(check_clone_url("git://127.0.0.1/repo", &allowed).is_ok());
        assert!(check_clone_url("git://0x7f.1/repo", &allowed).is_err());
        let allowed = hosts(&["https://[fd00::1]"]);
        assert!(check_clone_url("https://[fd00:0::1]/repo", &allowed).is_ok());
    }

    #[test]
    fn entries_name_hosts_only() {
        for entry in [
            "github.com/org",
            "https://github.com/org/repo",
            "file:///srv/git",
            "ext::sh",
            "https://user@github.com",
            "https://github.com?x=1",
            "ftp://github.com",
            "",
        ] {
            assert!(SeedHost::parse(entry).is_err(), "{entry:?} must be refused");
        }
        assert_eq!(
            SeedHost::parse("GitHub.com").expect("valid").to_string(),
            "https://github.com:443"
        );
        assert_eq!(
            SeedHost::parse("https://github.com/").expect("valid").to_string(),
            "https://github.com:443"
        );
    }
}
