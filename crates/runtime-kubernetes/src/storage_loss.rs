//! A session's volume that went away without this runtime: deleted by an operator (kept
//! `Terminating` by the claim-protection finalizer while a Pod uses it, then gone with its data),
//! or replaced by another claim of the same name. Loss is a state of the record, found by
//! `attach`, `status` and `reconcile`, reported as [`StorageState::Lost`] and
//! [`Error::StorageLost`], and logged once when found.
//!
//! [`StorageState::Lost`]: session_runtime::StorageState::Lost

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::ResourceExt;
use session_runtime::{Error, Result, Retention, SessionId};

use crate::api::api_error;
use crate::names;
use crate::record::{now, LostStorage, SessionRecord, Volume};
use crate::KubernetesRuntime;

/// Whether the record holds storage that should exist now: a volume not deleted by a close and
/// not already known lost.
pub(crate) fn expects_storage(record: &SessionRecord) -> bool {
    record.volume.claim().is_some()
        && record.storage_lost.is_none()
        && record
            .close
            .is_none_or(|close| close.retention == Retention::Retain)
}

/// What became of the record's claim, given what the API server has under its name (`None`:
/// nothing); `None` when it is still the session's.
pub(crate) fn loss(record: &SessionRecord, found: Option<&PersistentVolumeClaim>) -> Option<LostStorage> {
    let claim = record.volume.claim()?;
    let what = match (found, &record.volume) {
        (None, _) => "was deleted",
        (Some(found), _) if found.metadata.deletion_timestamp.is_some() => "is being deleted",
        (Some(found), Volume::Owned { uid, .. })
            if !names::belongs_to(&found.metadata, &record.id)
                || uid
                    .as_deref()
                    .is_some_and(|uid| found.uid().as_deref() != Some(uid)) =>
        {
            "was replaced by another claim of the same name"
        }
        _ => return None,
    };
    Some(LostStorage {
        claim: claim.to_owned(),
        at: now(),
        what: what.to_owned(),
    })
}

pub(crate) fn lost_error(id: &SessionId, lost: &LostStorage) -> Error {
    Error::StorageLost {
        id: *id,
        storage: format!(
            "{}; the session can only be closed (its identity's next session gets a new volume)",
            lost.describe()
        ),
    }
}

impl KubernetesRuntime {
    /// Reads the session's claim and, if it went away, records the loss (logging it once).
    /// Returns the loss, newly found or already recorded.
    ///
    /// # Errors
    /// [`Error::Backend`] if the claim or the record could not be read or written.
    pub(crate) async fn find_storage_loss(
        &self,
        id: &SessionId,
        record: &SessionRecord,
    ) -> Result<Option<LostStorage>> {
        if let Some(lost) = &record.storage_lost {
            return Ok(Some(lost.clone()));
        }
        let Some(claim) = record.volume.claim().filter(|_| expects_storage(record)) else {
            return Ok(None);
        };
        let found = self
            .claims()
            .await?
            .get_opt(claim)
            .await
            .map_err(|e| api_error(&format!("reading claim {claim}"), e))?;
        let Some(lost) = loss(record, found.as_ref()) else {
            return Ok(None);
        };
        let incarnation = record.incarnation;
        let (_, written) = self
            .update(id, |current| {
                let same = current.incarnation == incarnation
                    && current.volume.claim() == Some(lost.claim.as_str())
                    && expects_storage(current);
                if !same {
                    return Ok(None);
                }
                let mut next = current.clone();
                next.storage_lost = Some(lost.clone());
                Ok(Some(next))
            })
            .await?;
        if written.storage_lost.as_ref() == Some(&lost) {
            tracing::warn!(session = %id, claim = %lost.claim, "the session's storage is lost: {}", lost.describe());
        }
        Ok(written.storage_lost)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::CloseRecord;
    use session_runtime::{CloseReason, SessionIdentity};

    fn record() -> SessionRecord {
        let id = SessionIdentity::new("prod", "agent", "test", "t")
            .expect("identity")
            .id();
        let mut record = SessionRecord::new(id, "digest".to_owned(), 1, 1);
        record.volume = Volume::Owned {
            claim: "oab-d-x-1".to_owned(),
            uid: Some("u1".to_owned()),
        };
        record
    }

    fn claim(record: &SessionRecord, uid: &str) -> PersistentVolumeClaim {
        let mut meta = names::meta("oab-d-x-1".to_owned(), "prod", &record.id, "storage");
        meta.uid = Some(uid.to_owned());
        PersistentVolumeClaim {
            metadata: meta,
            ..PersistentVolumeClaim::default()
        }
    }

    #[test]
    fn a_claim_gone_deleting_or_replaced_is_lost_and_the_recorded_one_is_not() {
        let record = record();
        assert_eq!(loss(&record, Some(&claim(&record, "u1"))), None);
        let what = |found: Option<&PersistentVolumeClaim>| loss(&record, found).map(|l| l.what);
        assert_eq!(what(None).as_deref(), Some("was deleted"));
        assert_eq!(
            what(Some(&claim(&record, "u2"))).as_deref(),
            Some("was replaced by another claim of the same name")
        );
        let mut deleting = claim(&record, "u1");
        deleting.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::now(),
        ));
        assert_eq!(what(Some(&deleting)).as_deref(), Some("is being deleted"));
    }

    #[test]
    fn only_storage_a_close_did_not_delete_is_expected() {
        let mut record = record();
        assert!(expects_storage(&record));
        record.close = Some(CloseRecord {
            reason: CloseReason::Reset,
            retention: Retention::Delete,
            retain_until: None,
            storage_done: false,
        });
        assert!(!expects_storage(&record), "a close that deletes it");
        record.close = record.close.map(|close| CloseRecord {
            retention: Retention::Retain,
            ..close
        });
        assert!(expects_storage(&record), "retained storage is still expected");
        record.storage_lost = loss(&record, None);
        assert!(!expects_storage(&record), "lost once, not looked for again");
        assert_eq!(record.storage(), session_runtime::StorageState::Lost);
        assert!(!record.holds_storage(), "nothing is retained of it");
    }
}
