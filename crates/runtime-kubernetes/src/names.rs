//! The names, labels and annotations of a session's objects.
//!
//! A session id is the only thing about a session in any name, label or annotation: the raw
//! thread id never reaches the API server. Names are fixed (never `generateName`), so a retried
//! create finds its own object instead of making a second one, and every object carries the full
//! id in an annotation that is checked before the runtime adopts an object it did not just create.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use session_runtime::{Generation, SessionId};

/// Label: which software manages the object.
pub(crate) const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
/// The value of [`MANAGED_BY`].
pub(crate) const MANAGER: &str = "openab";
/// Label: the installation's label form (see [`installation_label`]).
pub(crate) const INSTALLATION: &str = "openab.dev/installation";
/// Label: the session id.
pub(crate) const SESSION: &str = "openab.dev/session";
/// Label: the worker generation (Pods only).
pub(crate) const GENERATION: &str = "openab.dev/generation";
/// Label: which part of a session an object is (`anchor`, `worker`, `storage`).
pub(crate) const ROLE: &str = "openab.dev/role";
/// Label: the profile a worker Pod was made from (see [`profile_label`]).
pub(crate) const PROFILE: &str = "openab.dev/profile";
/// The [`ROLE`] of a warm pool member (a worker with no session yet); a claim makes it `worker`.
pub(crate) const POOL_ROLE: &str = "pool";
/// Label: which broker key binds a pool member (see `pool::key_label`).
pub(crate) const POOL_KEY: &str = "openab.dev/pool-key";
/// Annotation on an egress policy or a pool member: the profile version it was written from.
pub(crate) const PROFILE_VERSION: &str = "openab.dev/profile-version";
/// Annotation: the full session id, checked before adopting an object.
pub(crate) const SESSION_ID: &str = "openab.dev/session-id";

/// The anchor (an `OabSession`): the session's authoritative record.
pub(crate) fn anchor(id: &SessionId) -> String {
    format!("oab-s-{id}")
}

/// The prefix of a warm pool member's name (its Pod's and its ServiceAccount's).
pub(crate) const MEMBER_PREFIX: &str = "oab-m-";

/// The worker Pod (one at a time; owned by the anchor).
pub(crate) fn worker(id: &SessionId) -> String {
    format!("oab-w-{id}")
}

/// The session volume of one incarnation of the session. A closed session's retained volume
/// keeps its name, so the thread's next session (incarnation + 1) gets a volume of its own and
/// never sees the old one.
pub(crate) fn storage(id: &SessionId, incarnation: u64) -> String {
    format!("oab-d-{id}-{incarnation}")
}

/// The ServiceAccount of one incarnation of the session: its workers' and seed Job's identity.
pub(crate) fn service_account(id: &SessionId, incarnation: u64) -> String {
    format!("oab-i-{id}-{incarnation}")
}

/// The installation's leader Lease: `oab-leader-<installation>` when the installation is a DNS
/// label, else `oab-leader-h-<hash>`.
pub(crate) fn leader(installation: &str) -> String {
    let label = installation_label(installation);
    let dns = label.len() <= 50
        && label
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if dns {
        format!("oab-leader-{label}")
    } else {
        use sha2::{Digest, Sha256};
        let digest = Sha256::digest(installation.as_bytes());
        let encoded = data_encoding::BASE32_NOPAD.encode(&digest).to_ascii_lowercase();
        format!("oab-leader-h-{}", &encoded[..32])
    }
}

/// The Job that seeds the volume of one incarnation of the session at create.
pub(crate) fn seed(id: &SessionId, incarnation: u64) -> String {
    format!("oab-p-{id}-{incarnation}")
}

/// A profile name (a DNS subdomain, up to 253 characters) as a label value: itself when it fits
/// a label, else `h-` and a hash of it.
pub(crate) fn profile_label(profile: &str) -> String {
    installation_label(profile)
}

/// The NetworkPolicy of a profile's egress allowances (one per installation and profile).
pub(crate) fn egress_policy(installation: &str, profile: &str) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(format!("{installation}\n{profile}").as_bytes());
    let encoded = data_encoding::BASE32_NOPAD.encode(&digest).to_ascii_lowercase();
    format!("oab-egress-{}", &encoded[..20])
}

/// An installation name as a label value: itself when it is one (at most 63 characters of
/// `[A-Za-z0-9._-]`, alphanumeric at both ends), else `h-` and a hash of it.
pub(crate) fn installation_label(installation: &str) -> String {
    let valid = !installation.is_empty()
        && installation.len() <= 63
        && installation
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && installation.as_bytes()[0].is_ascii_alphanumeric()
        && installation.as_bytes()[installation.len() - 1].is_ascii_alphanumeric();
    if valid {
        return installation.to_owned();
    }
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(installation.as_bytes());
    let encoded = data_encoding::BASE32_NOPAD.encode(&digest).to_ascii_lowercase();
    format!("h-{}", &encoded[..32])
}

/// Labels and annotations of one session object.
pub(crate) fn meta(name: String, installation: &str, id: &SessionId, role: &str) -> ObjectMeta {
    let labels = BTreeMap::from([
        (MANAGED_BY.to_owned(), MANAGER.to_owned()),
        (INSTALLATION.to_owned(), installation_label(installation)),
        (SESSION.to_owned(), id.to_string()),
        (ROLE.to_owned(), role.to_owned()),
    ]);
    ObjectMeta {
        name: Some(name),
        labels: Some(labels),
        annotations: Some(BTreeMap::from([(SESSION_ID.to_owned(), id.to_string())])),
        ..ObjectMeta::default()
    }
}

/// The label selector of every object of an installation.
pub(crate) fn installation_selector(installation: &str) -> String {
    format!(
        "{MANAGED_BY}={MANAGER},{INSTALLATION}={}",
        installation_label(installation)
    )
}

/// The label selector of an installation's worker Pods and warm pool members.
pub(crate) fn workers_selector(installation: &str) -> String {
    format!(
        "{},{ROLE} in (worker,{POOL_ROLE})",
        installation_selector(installation)
    )
}

/// The session an object is labelled for, if its annotation confirms it.
pub(crate) fn session_of(meta: &ObjectMeta) -> Option<SessionId> {
    let id = SessionId::parse(meta.labels.as_ref()?.get(SESSION)?).ok()?;
    belongs_to(meta, &id).then_some(id)
}

/// Whether an object found under one of our names is the session's own: it must carry the
/// session's full id in its annotation (and its label). Anything else is foreign and is never
/// adopted, changed or deleted.
pub(crate) fn belongs_to(meta: &ObjectMeta, id: &SessionId) -> bool {
    let id = id.to_string();
    let annotated = meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(SESSION_ID))
        .is_some_and(|value| *value == id);
    let labelled = meta
        .labels
        .as_ref()
        .and_then(|l| l.get(SESSION))
        .is_some_and(|value| *value == id);
    annotated && labelled
}

/// The generation a worker Pod was started for, from its label.
pub(crate) fn pod_generation(meta: &ObjectMeta) -> Option<Generation> {
    meta.labels.as_ref()?.get(GENERATION)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use session_runtime::SessionIdentity;

    fn id() -> SessionId {
        SessionIdentity::new("prod", "claude", "discord", "thread 123/with spaces")
            .expect("identity")
            .id()
    }

    #[test]
    fn names_are_dns_labels_and_hold_no_thread() {
        let id = id();
        for name in [anchor(&id), worker(&id), storage(&id, 7)] {
            assert!(name.len() <= 63, "{name}");
            assert!(
                name.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'),
                "{name}"
            );
            assert!(!name.contains("thread"), "{name}");
        }
        assert_ne!(storage(&id, 1), storage(&id, 2));
    }

    #[test]
    fn installation_labels_are_valid_label_values() {
        assert_eq!(installation_label("prod-bot"), "prod-bot");
        for awkward in ["", "with space", "-leading", "ü", &"x".repeat(64)] {
            let label = installation_label(awkward);
            assert!(
                label.starts_with("h-") && label.len() <= 63,
                "{awkward:?} -> {label}"
            );
        }
        assert_ne!(installation_label("a b"), installation_label("a c"));
    }

    #[test]
    fn only_an_object_with_the_full_id_belongs_to_the_session() {
        let id = id();
        let other = SessionIdentity::new("prod", "claude", "discord", "another")
            .expect("identity")
            .id();
        let ours = meta(anchor(&id), "prod", &id, "anchor");
        assert!(belongs_to(&ours, &id));
        assert!(!belongs_to(&ours, &other));
        let mut unannotated = ours.clone();
        unannotated.annotations = None;
        assert!(!belongs_to(&unannotated, &id));
        let mut relabelled = ours;
        relabelled
            .labels
            .as_mut()
            .expect("labels")
            .insert(SESSION.to_owned(), other.to_string());
        assert!(!belongs_to(&relabelled, &id));
    }
}
