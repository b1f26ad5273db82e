//! [`SessionOverlay`]: what the broker adds to one session's agent on top of the configured
//! `[agent]`: a working directory and environment variables.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The overlay field named by errors about the working directory.
pub const WORKING_DIR_FIELD: &str = "overlay.working_dir";
/// The overlay field named by errors about environment variables.
pub const ENV_FIELD: &str = "overlay.env";

/// The most environment variables one overlay may set.
pub const MAX_ENV_VARS: usize = 64;
/// The longest environment variable name, in bytes.
pub const MAX_ENV_NAME_LEN: usize = 128;
/// The longest environment variable value, in bytes.
pub const MAX_ENV_VALUE_LEN: usize = 8 * 1024;
/// The most bytes of names, values and working directory together: an overlay is kept with the
/// session's record, which stays small.
pub const MAX_OVERLAY_BYTES: usize = 16 * 1024;
/// The longest working directory, in bytes.
pub const MAX_WORKING_DIR_LEN: usize = 4096;

/// A per-session overlay: a working directory and environment variables the broker gives one
/// session's agent on top of the configured `[agent]` (upstream OpenAB's `[[ws:...]]` working
/// directory and its per-session `OPENAB_SESSION_TOKEN`).
///
/// Passed at create ([`CreateOptions::with_overlay`](crate::CreateOptions::with_overlay)), kept
/// with the session's record, and applied by every attach, including one after a broker restart.
///
/// - **Working directory.** With storage shared by every session (the local runtime's
///   `storage = "shared"`), an absolute host directory that the operator's configuration allows.
///   With storage of a session's own, a relative directory inside the session's workspace (made
///   if missing); never a host path: absolute paths, `..` and symbolic links leading out are
///   refused. The attachment's [`working_dir`](crate::Attachment::working_dir) reports it as the
///   agent sees it.
/// - **Environment.** Set after the agent's configured `env` and `inherit_env`, so they win over
///   both. A runtime's own variables (a sandbox's proxy settings, its worker marker) still win.
///   Values are never logged: `Debug` shows names only.
///
/// A backend that cannot apply a field refuses the create with
/// [`Error::Unsupported`] naming it.
///
/// ```
/// use session_runtime::SessionOverlay;
///
/// let overlay = SessionOverlay::new()
///     .working_dir("projects/api")
///     .env("OPENAB_SESSION_TOKEN", "s3cret");
/// overlay.validate()?;
/// assert!(!format!("{overlay:?}").contains("s3cret"));
/// # Ok::<(), session_runtime::Error>(())
/// ```
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct SessionOverlay {
    /// The agent's working directory (see the type's docs); `None`: the runtime's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_dir: Option<PathBuf>,
    /// Environment variables set after the agent's configured ones.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
}

impl fmt::Debug for SessionOverlay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        struct Redacted<'a>(&'a BTreeMap<String, String>);
        impl fmt::Debug for Redacted<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_map()
                    .entries(self.0.keys().map(|name| (name, "<redacted>")))
                    .finish()
            }
        }
        f.debug_struct("SessionOverlay")
            .field("working_dir", &self.working_dir)
            .field("env", &Redacted(&self.env))
            .finish()
    }
}

impl SessionOverlay {
    /// An empty overlay: the runtime's working directory and the configured environment.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the working directory.
    pub fn working_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.working_dir = Some(dir.into());
        self
    }

    /// Sets one environment variable.
    pub fn env(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.insert(name.into(), value.into());
        self
    }

    /// Whether the overlay changes nothing.
    pub fn is_empty(&self) -> bool {
        self.working_dir.is_none() && self.env.is_empty()
    }

    /// Checks what every backend requires: names of letters, digits and `_` not starting with a
    /// digit, at most [`MAX_ENV_VARS`] of them, values without NUL, lengths within bounds, and a
    /// non-empty working directory without NUL. Which working directories a backend accepts is
    /// its own check ([`relative_working_dir`](Self::relative_working_dir) for storage of a
    /// session's own).
    ///
    /// # Errors
    /// [`Error::InvalidOverlay`] naming the field; the message never contains a value.
    pub fn validate(&self) -> Result<()> {
        if self.env.len() > MAX_ENV_VARS {
            return Err(invalid(
                ENV_FIELD,
                format!(
                    "{} variables, more than the most allowed, {MAX_ENV_VARS}",
                    self.env.len()
                ),
            ));
        }
        for (name, value) in &self.env {
            check_env_name(name)?;
            if value.len() > MAX_ENV_VALUE_LEN {
                return Err(invalid(
                    ENV_FIELD,
                    format!("the value of {name} is longer than {MAX_ENV_VALUE_LEN} bytes"),
                ));
            }
            if value.contains('\0') {
                return Err(invalid(ENV_FIELD, format!("the value of {name} contains NUL")));
            }
        }
        let total = self
            .env
            .iter()
            .map(|(name, value)| name.len() + value.len())
            .sum::<usize>()
            + self.working_dir.as_ref().map_or(0, |dir| dir.as_os_str().len());
        if total > MAX_OVERLAY_BYTES {
            return Err(invalid(
                ENV_FIELD,
                format!("{total} bytes of names, values and working directory, more than the most allowed, {MAX_OVERLAY_BYTES}"),
            ));
        }
        if let Some(dir) = &self.working_dir {
            let text = dir.as_os_str().as_encoded_bytes();
            if text.is_empty() {
                return Err(invalid(WORKING_DIR_FIELD, "is empty".into()));
            }
            if text.len() > MAX_WORKING_DIR_LEN {
                return Err(invalid(
                    WORKING_DIR_FIELD,
                    format!("is longer than {MAX_WORKING_DIR_LEN} bytes"),
                ));
            }
            if text.contains(&0) {
                return Err(invalid(WORKING_DIR_FIELD, "contains NUL".into()));
            }
        }
        Ok(())
    }

    /// The working directory as a path inside a session's own workspace, for backends whose
    /// sessions have storage of their own: `None` when unset or naming the workspace itself,
    /// else the relative path with `.` components dropped.
    ///
    /// # Errors
    /// [`Error::InvalidOverlay`] naming [`WORKING_DIR_FIELD`] for an absolute path (a host path
    /// never crosses an isolation boundary) or one with a `..` component.
    pub fn relative_working_dir(&self) -> Result<Option<PathBuf>> {
        let Some(dir) = &self.working_dir else {
            return Ok(None);
        };
        let mut inside = PathBuf::new();
        for component in dir.components() {
            match component {
                Component::Normal(part) => inside.push(part),
                Component::CurDir => {}
                Component::ParentDir => {
                    return Err(invalid(
                        WORKING_DIR_FIELD,
                        format!("{} leaves the session's workspace (`..`)", dir.display()),
                    ))
                }
                Component::RootDir | Component::Prefix(_) => {
                    return Err(invalid(
                        WORKING_DIR_FIELD,
                        format!(
                            "{} is a host path; with storage of a session's own it must be a \
                             directory inside the session's workspace, relative to it",
                            dir.display()
                        ),
                    ))
                }
            }
        }
        Ok((!inside.as_os_str().is_empty()).then_some(inside))
    }
}

impl SessionOverlay {
    /// For a runtime that cannot apply overlays: `Ok` for an absent or empty overlay, else
    /// [`Error::Unsupported`] naming the first field set ([`WORKING_DIR_FIELD`], then
    /// [`ENV_FIELD`]).
    ///
    /// # Errors
    /// As described.
    pub fn refuse(overlay: Option<&Self>, runtime: &'static str) -> Result<()> {
        match overlay {
            Some(overlay) if overlay.working_dir.is_some() => Err(Error::Unsupported {
                operation: WORKING_DIR_FIELD,
                runtime,
            }),
            Some(overlay) if !overlay.env.is_empty() => Err(Error::Unsupported {
                operation: ENV_FIELD,
                runtime,
            }),
            _ => Ok(()),
        }
    }
}

/// Checks one environment variable name of an overlay.
fn check_env_name(name: &str) -> Result<()> {
    let mut chars = name.chars();
    let well_formed = chars
        .next()
        .is_some_and(|first| first.is_ascii_alphabetic() || first == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if name.len() > MAX_ENV_NAME_LEN {
        return Err(invalid(
            ENV_FIELD,
            format!("a name is longer than {MAX_ENV_NAME_LEN} bytes"),
        ));
    }
    if !well_formed {
        return Err(invalid(
            ENV_FIELD,
            format!(
                "the name {:?} is not letters, digits and `_` starting with a letter or `_`",
                name
            ),
        ));
    }
    Ok(())
}

/// Joins a relative working directory from [`SessionOverlay::relative_working_dir`] onto the
/// directory a worker sees as its workspace.
pub fn within(workspace: &str, relative: Option<&Path>) -> String {
    match relative {
        Some(relative) => Path::new(workspace).join(relative).to_string_lossy().into_owned(),
        None => workspace.to_owned(),
    }
}

fn invalid(field: &'static str, problem: String) -> Error {
    Error::InvalidOverlay { field, problem }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(result: Result<impl fmt::Debug>) -> &'static str {
        match result {
            Err(Error::InvalidOverlay { field, .. }) => field,
            other => panic!("expected InvalidOverlay, got {other:?}"),
        }
    }

    #[test]
    fn debug_and_errors_never_show_values() {
        let overlay = SessionOverlay::new()
            .env("TOKEN", "hunter2")
            .env("BAD", "a\0hunter2");
        assert!(!format!("{overlay:?}").contains("hunter2"));
        let error = overlay
            .validate()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(error.contains("BAD") && !error.contains("hunter2"), "{error}");
    }

    #[test]
    fn names_are_checked() {
        for bad in ["", "1A", "A-B", "A=B", "Ä", "A B"] {
            assert_eq!(
                field_of(SessionOverlay::new().env(bad, "v").validate()),
                ENV_FIELD,
                "{bad:?}"
            );
        }
        for good in ["A", "_a1", "OPENAB_SESSION_TOKEN"] {
            assert!(SessionOverlay::new().env(good, "v").validate().is_ok(), "{good}");
        }
        let long = "A".repeat(MAX_ENV_NAME_LEN + 1);
        assert_eq!(
            field_of(SessionOverlay::new().env(long, "v").validate()),
            ENV_FIELD
        );
    }

    #[test]
    fn bounds_are_checked() {
        let big = SessionOverlay::new().env("A", "x".repeat(MAX_ENV_VALUE_LEN + 1));
        assert_eq!(field_of(big.validate()), ENV_FIELD);
        let many = (0..=MAX_ENV_VARS).fold(SessionOverlay::new(), |o, i| o.env(format!("V{i}"), "v"));
        assert_eq!(field_of(many.validate()), ENV_FIELD);
        let value = "x".repeat(MAX_ENV_VALUE_LEN);
        let heavy = (0..MAX_OVERLAY_BYTES / MAX_ENV_VALUE_LEN).fold(SessionOverlay::new(), |o, i| {
            o.env(format!("V{i}"), value.as_str())
        });
        assert_eq!(field_of(heavy.validate()), ENV_FIELD, "the total is bounded too");
        assert_eq!(
            field_of(SessionOverlay::new().working_dir("").validate()),
            WORKING_DIR_FIELD
        );
    }

    #[test]
    fn a_relative_working_dir_stays_inside() {
        for bad in ["/etc", "../other", "a/../../b", "a/.."] {
            let overlay = SessionOverlay::new().working_dir(bad);
            assert_eq!(
                field_of(overlay.relative_working_dir()),
                WORKING_DIR_FIELD,
                "{bad}"
            );
        }
        let overlay = SessionOverlay::new().working_dir("./a/./b");
        assert_eq!(
            overlay.relative_working_dir().ok().flatten(),
            Some(PathBuf::from("a/b"))
        );
        let overlay = SessionOverlay::new().working_dir(".");
        assert_eq!(overlay.relative_working_dir().ok().flatten(), None);
        assert_eq!(within("/workspace", Some(Path::new("a/b"))), "/workspace/a/b");
    }
}
