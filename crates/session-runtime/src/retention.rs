//! What happens to a session's storage when the session is closed.
//!
//! Closing a session always stops its compute at once. Its storage (workspace, HOME and agent
//! state) is then either deleted or retained, depending on the [`CloseReason`] and the
//! [`RetentionPolicy`] configured in `[session_runtime.retention]`. Suspending a session never
//! deletes storage, whatever the policy says.
//!
//! Retention only ever applies to storage the runtime created itself: storage an administrator
//! lends to a session (an existing volume, a host directory) is borrowed and never deleted.

use std::fmt;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use crate::config::serde_duration;
use crate::CloseReason;

/// What to do with a closed session's storage.
///
/// In TOML: `"delete"` or `"retain"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Retention {
    /// Delete the storage as part of the close. The default for every close reason.
    #[default]
    Delete,
    /// Keep the storage after the close: for
    /// [`retain_for`](RetentionPolicy::retain_for) if that is set, otherwise until an operator
    /// deletes it.
    Retain,
}

impl Retention {
    /// The configuration spelling: `"delete"` or `"retain"`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Retention::Delete => "delete",
            Retention::Retain => "retain",
        }
    }
}

impl fmt::Display for Retention {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The retention policy: what happens to a closed session's storage, per [`CloseReason`].
///
/// This is the `[session_runtime.retention]` table:
///
/// ```toml
/// [session_runtime.retention]
/// reset = "delete"     # default "delete"
/// ended = "retain"     # default "delete"
/// expired = "delete"   # default "delete"
/// retain_for = "7d"    # default: absent (retained storage is kept until an operator deletes it)
/// ```
///
/// The default deletes storage for every reason.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct RetentionPolicy {
    /// Storage of a session closed with [`CloseReason::Reset`] (the user asked for a clean
    /// slate). Default [`Retention::Delete`].
    pub reset: Retention,
    /// Storage of a session closed with [`CloseReason::Ended`] (the thread was closed by a user
    /// or an administrator). Default [`Retention::Delete`].
    pub ended: Retention,
    /// Storage of a session closed with [`CloseReason::Expired`] (the session's lifetime or
    /// retention policy ended it). Default [`Retention::Delete`].
    pub expired: Retention,
    /// How long storage is kept after a close whose reason is set to [`Retention::Retain`];
    /// `reconcile` deletes it once this has passed. `None` (the default, key absent) keeps
    /// retained storage until an operator deletes it. It has no effect on reasons set to
    /// [`Retention::Delete`]. In TOML a duration string such as `"7d"` or `"12h"`; at most
    /// [`RetentionPolicy::MAX_RETAIN_FOR`].
    #[serde(with = "serde_duration::option", skip_serializing_if = "Option::is_none")]
    pub retain_for: Option<Duration>,
}

impl RetentionPolicy {
    /// The longest [`retain_for`](Self::retain_for) a configuration may set: 3650 days (about
    /// ten years); leave it out to keep retained storage until an operator removes it.
    pub const MAX_RETAIN_FOR: Duration = Duration::from_secs(3650 * 24 * 3600);

    /// What to do with the storage of a session closed for `reason`.
    pub fn for_reason(&self, reason: CloseReason) -> Retention {
        match reason {
            CloseReason::Reset => self.reset,
            CloseReason::Ended => self.ended,
            CloseReason::Expired => self.expired,
        }
    }

    /// How long the storage of a session closed for `reason` at `closed_at` is kept.
    ///
    /// `None` means the storage is deleted as part of the close. Otherwise it is kept
    /// [`RetainedUntil::Until`] `closed_at + retain_for`, or [`RetainedUntil::Forever`] (until an
    /// operator deletes it) when `retain_for` is not set or the sum is not representable.
    pub fn retained_until(&self, reason: CloseReason, closed_at: SystemTime) -> Option<RetainedUntil> {
        match self.for_reason(reason) {
            Retention::Delete => None,
            Retention::Retain => Some(
                self.retain_for
                    .and_then(|keep| closed_at.checked_add(keep))
                    .map_or(RetainedUntil::Forever, RetainedUntil::Until),
            ),
        }
    }
}

/// How long a closed session's retained storage is kept (see
/// [`RetentionPolicy::retained_until`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RetainedUntil {
    /// Kept until an operator deletes it; `reconcile` never deletes it.
    Forever,
    /// Kept until this instant; after it `reconcile` deletes it.
    Until(SystemTime),
}

impl RetainedUntil {
    /// Whether the retention time has passed at `now`, i.e. the storage is due for deletion.
    ///
    /// Always `false` for [`RetainedUntil::Forever`]; for [`RetainedUntil::Until`] `true` from
    /// the deadline on.
    pub fn has_passed(&self, now: SystemTime) -> bool {
        match self {
            RetainedUntil::Forever => false,
            RetainedUntil::Until(deadline) => now >= *deadline,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_deletes_for_every_reason() {
        let policy = RetentionPolicy::default();
        let now = SystemTime::now();
        for reason in [CloseReason::Reset, CloseReason::Ended, CloseReason::Expired] {
            assert_eq!(policy.for_reason(reason), Retention::Delete);
            assert_eq!(policy.retained_until(reason, now), None);
        }
    }

    #[test]
    fn retained_storage_is_kept_for_retain_for() {
        let policy = RetentionPolicy {
            ended: Retention::Retain,
            retain_for: Some(Duration::from_secs(60)),
            ..RetentionPolicy::default()
        };
        let closed = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let until = policy.retained_until(CloseReason::Ended, closed);
        assert_eq!(
            until,
            Some(RetainedUntil::Until(closed + Duration::from_secs(60)))
        );
        let until = until.unwrap();
        assert!(!until.has_passed(closed + Duration::from_secs(59)));
        assert!(until.has_passed(closed + Duration::from_secs(60)));
        assert_eq!(policy.retained_until(CloseReason::Reset, closed), None);
    }

    #[test]
    fn retained_without_retain_for_is_kept_forever() {
        let policy = RetentionPolicy {
            expired: Retention::Retain,
            ..RetentionPolicy::default()
        };
        let until = policy.retained_until(CloseReason::Expired, SystemTime::now());
        assert_eq!(until, Some(RetainedUntil::Forever));
        assert!(!until
            .unwrap()
            .has_passed(SystemTime::now() + Duration::from_secs(1 << 40)));
    }

    #[test]
    fn unrepresentable_deadline_is_forever() {
        let policy = RetentionPolicy {
            reset: Retention::Retain,
            retain_for: Some(Duration::MAX),
            ..RetentionPolicy::default()
        };
        assert_eq!(
            policy.retained_until(CloseReason::Reset, SystemTime::now()),
            Some(RetainedUntil::Forever)
        );
    }
}
