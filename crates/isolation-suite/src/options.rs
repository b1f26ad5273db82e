//! [`SuiteOptions`]: what the suite needs to know about the runtime under test.

use std::time::Duration;

/// The longest a single command may run in a worker. The ACP test client gives up on a request
/// after 30 s ([`DEFAULT_REQUEST_TIMEOUT`](session_runtime::testing::DEFAULT_REQUEST_TIMEOUT)),
/// so commands are bounded below that.
pub(crate) const MAX_COMMAND_TIME: Duration = Duration::from_secs(25);

/// A read-only input shared by every session (e.g. centrally managed skills), for step 7.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SharedInput {
    /// Absolute in-worker path of an existing regular file in the shared input, e.g.
    /// `/skills/demo/SKILL.md`. Its directory is where step 7 tries to create a file.
    pub file: String,
    /// The lower-case hex SHA-256 both sessions must read, if known.
    pub expected_sha256: Option<String>,
}

impl SharedInput {
    /// A shared input file, at an absolute in-worker path.
    pub fn new(file: impl Into<String>) -> Self {
        Self {
            file: file.into(),
            expected_sha256: None,
        }
    }

    /// Requires both sessions to read content with this SHA-256 (lower-case hex).
    pub fn with_expected_sha256(mut self, sha256: impl Into<String>) -> Self {
        self.expected_sha256 = Some(sha256.into().to_ascii_lowercase());
        self
    }
}

/// How to run the suite against one runtime.
///
/// ```
/// use std::time::Duration;
/// use isolation_suite::{SharedInput, SuiteOptions};
///
/// let options = SuiteOptions::new("verify")
///     .with_shared_input(SharedInput::new("/skills/demo/SKILL.md"))
///     .with_extra_scan_path("/var/lib/openab")
///     .with_scan_timeout(Duration::from_secs(20));
/// assert_eq!(options.installation, "verify");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SuiteOptions {
    /// The installation the runtime serves; both sessions are created under it.
    pub installation: String,
    /// The `agent` part of both identities (default `isolation-suite`).
    pub agent: String,
    /// The `platform` part of both identities (default `verify`).
    pub platform: String,
    /// The shared read-only input for step 7; step 7 is reported as skipped without it.
    pub shared_input: Option<SharedInput>,
    /// Absolute paths, as a session's shell would name them, searched for the other session's
    /// token in addition to every writable mount, e.g. the runtime's storage root on the host
    /// (which a sandbox may expose read-only, where the mount scan does not look).
    pub extra_scan_paths: Vec<String>,
    /// How long one scan (`find` over one mount) may run (default 20 s, at most 25 s).
    pub scan_timeout: Duration,
    /// How long any other command may run in a worker (default 10 s, at most 25 s).
    pub command_timeout: Duration,
    /// How long one runtime call (create, attach, status, close) or ACP `initialize` may take
    /// (default 180 s).
    pub lifecycle_timeout: Duration,
    /// Why step 8 (abstract sockets and loopback ports between the sessions) is not run, if it
    /// is not; it is then reported as skipped with this reason, never as passed.
    pub skip_channels: Option<String>,
}

impl SuiteOptions {
    /// Options for a runtime serving `installation`, with defaults for the rest.
    pub fn new(installation: impl Into<String>) -> Self {
        Self {
            installation: installation.into(),
            agent: "isolation-suite".to_owned(),
            platform: "verify".to_owned(),
            shared_input: None,
            extra_scan_paths: Vec::new(),
            scan_timeout: Duration::from_secs(20),
            command_timeout: Duration::from_secs(10),
            lifecycle_timeout: Duration::from_secs(180),
            skip_channels: None,
        }
    }

    /// Skips step 8 (the abstract socket and loopback probes), saying `why` in the report: for a
    /// test stand-in whose sessions share a network by construction where the real backend's do
    /// not (e.g. an emulator's local workers).
    pub fn without_channel_probes(mut self, why: impl Into<String>) -> Self {
        self.skip_channels = Some(why.into());
        self
    }

    /// Sets the `agent` and `platform` parts of both identities (labels: `[a-z0-9-]`).
    pub fn with_identity_labels(mut self, agent: impl Into<String>, platform: impl Into<String>) -> Self {
        self.agent = agent.into();
        self.platform = platform.into();
        self
    }

    /// Enables step 7 with this shared read-only input.
    pub fn with_shared_input(mut self, shared: SharedInput) -> Self {
        self.shared_input = Some(shared);
        self
    }

    /// Adds an absolute path to search for the other session's token.
    pub fn with_extra_scan_path(mut self, path: impl Into<String>) -> Self {
        self.extra_scan_paths.push(path.into());
        self
    }

    /// Sets how long one scan may run (capped at 25 s).
    pub fn with_scan_timeout(mut self, timeout: Duration) -> Self {
        self.scan_timeout = timeout;
        self
    }

    /// Sets how long any other command may run (capped at 25 s).
    pub fn with_command_timeout(mut self, timeout: Duration) -> Self {
        self.command_timeout = timeout;
        self
    }

    /// Sets how long one runtime call may take.
    pub fn with_lifecycle_timeout(mut self, timeout: Duration) -> Self {
        self.lifecycle_timeout = timeout;
        self
    }
}
