//! Each session's own workload identity: a ServiceAccount per session incarnation, which its
//! worker Pods and seed Job run as.
//!
//! No two sessions share one, so a cloud identity bound to it (IRSA, GKE Workload Identity,
//! Azure Workload Identity) is bound to one session. It has no token mounted and no binding by
//! default: it holds nothing until an administrator binds something to it. It is owned by the
//! session's anchor (a deleted record takes it along) and deleted when the session closes.

use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::{DeleteParams, PostParams, Preconditions};
use kube::ResourceExt;
use session_runtime::{Error, Result, SessionId};

use crate::api::{api_error, delete_if_unchanged, is_status};
use crate::names;
use crate::pod::owned_by_anchor;
use crate::KubernetesRuntime;

/// How many accounts of earlier records a new record's first identity looks past.
const EARLIER_IDENTITIES: u64 = 64;

fn not_the_sessions(id: &SessionId, name: &str) -> Error {
    Error::Backend {
        runtime: crate::RUNTIME,
        retryable: false,
        message: format!(
            "session {id}: the ServiceAccount {name} exists but is not this session's; it is left alone"
        ),
        source: None,
    }
}

/// The ServiceAccount of one incarnation of a session.
pub(crate) fn service_account(
    installation: &str,
    id: &SessionId,
    incarnation: u64,
    anchor_uid: &str,
) -> ServiceAccount {
    let mut metadata = names::meta(
        names::service_account(id, incarnation),
        installation,
        id,
        "identity",
    );
    metadata.owner_references = Some(vec![owned_by_anchor(id, anchor_uid)]);
    ServiceAccount {
        metadata,
        automount_service_account_token: Some(false),
        ..ServiceAccount::default()
    }
}

impl KubernetesRuntime {
    /// Makes the session incarnation's ServiceAccount, or finds the one an earlier attempt made;
    /// with its UID.
    ///
    /// # Errors
    /// [`Error::Backend`]: not retryable when the name is taken by an object that is not this
    /// session's, retryable while one of that name is being deleted or the API fails.
    ///
    /// # Idempotency
    /// A second call finds the first call's account and changes nothing.
    pub(crate) async fn ensure_service_account(
        &self,
        id: &SessionId,
        incarnation: u64,
        anchor_uid: &str,
    ) -> Result<Option<String>> {
        let account = service_account(self.installation(), id, incarnation, anchor_uid);
        let name = account.name_any();
        let api = self.service_accounts().await?;
        match api.create(&PostParams::default(), &account).await {
            Ok(created) => Ok(created.uid()),
            Err(error) if is_status(&error, 409) => {
                let found = api
                    .get(&name)
                    .await
                    .map_err(|e| api_error(&format!("reading ServiceAccount {name}"), e))?;
                if !names::belongs_to(&found.metadata, id) {
                    return Err(not_the_sessions(id, &name));
                }
                if found.metadata.deletion_timestamp.is_some() {
                    return Err(Error::Backend {
                        runtime: crate::RUNTIME,
                        retryable: true,
                        message: format!("session {id}: the ServiceAccount {name} is still being deleted"),
                        source: None,
                    });
                }
                Ok(found.uid())
            }
            Err(error) => Err(api_error(&format!("creating ServiceAccount {name}"), error)),
        }
    }

    /// Makes the ServiceAccount of a new record's first incarnation, owned by its anchor
    /// (`anchor_uid`): at `incarnation`, or past it where an earlier record of the session left
    /// its account behind (orphaned when that record was deleted). With the incarnation and the
    /// account's UID. An account of this anchor already there (an earlier attempt's) is adopted.
    ///
    /// # Errors
    /// As [`ensure_service_account`](Self::ensure_service_account); retryable when
    /// [`EARLIER_IDENTITIES`] earlier accounts were in the way.
    ///
    /// # Idempotency
    /// A second call finds the first call's account and returns the same incarnation.
    pub(crate) async fn first_identity(
        &self,
        id: &SessionId,
        incarnation: u64,
        anchor_uid: &str,
    ) -> Result<(u64, Option<String>)> {
        let api = self.service_accounts().await?;
        for incarnation in incarnation..incarnation + EARLIER_IDENTITIES {
            let account = service_account(self.installation(), id, incarnation, anchor_uid);
            let name = account.name_any();
            let found = match api.create(&PostParams::default(), &account).await {
                Ok(created) => return Ok((incarnation, created.uid())),
                Err(error) if is_status(&error, 409) => api
                    .get(&name)
                    .await
                    .map_err(|e| api_error(&format!("reading ServiceAccount {name}"), e))?,
                Err(error) => return Err(api_error(&format!("creating ServiceAccount {name}"), error)),
            };
            if !names::belongs_to(&found.metadata, id) {
                return Err(not_the_sessions(id, &name));
            }
            let this_anchors = found
                .owner_references()
                .iter()
                .any(|owner| owner.uid == anchor_uid);
            if this_anchors && found.metadata.deletion_timestamp.is_none() {
                return Ok((incarnation, found.uid()));
            }
        }
        Err(Error::Backend {
            runtime: crate::RUNTIME,
            retryable: true,
            message: format!(
                "session {id}: {EARLIER_IDENTITIES} ServiceAccounts of earlier records are still there"
            ),
            source: None,
        })
    }

    /// Deletes the session incarnation's ServiceAccount, if it is there and is the session's:
    /// the one with `uid` when the record kept it (a ServiceAccount of that name with another
    /// UID is not the session's), else the one found under its name.
    ///
    /// # Errors
    /// [`Error::Backend`] when the API fails; a missing account is not an error.
    pub(crate) async fn delete_service_account(
        &self,
        id: &SessionId,
        incarnation: u64,
        uid: Option<&str>,
    ) -> Result<()> {
        let name = names::service_account(id, incarnation);
        let api = self.service_accounts().await?;
        if let Some(uid) = uid {
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: Some(uid.to_owned()),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            };
            return match api.delete(&name, &params).await {
                Ok(_) => Ok(()),
                Err(error) if is_status(&error, 404) || is_status(&error, 409) => Ok(()),
                Err(error) => Err(api_error(&format!("deleting ServiceAccount {name}"), error)),
            };
        }
        let found = api
            .get_opt(&name)
            .await
            .map_err(|e| api_error(&format!("reading ServiceAccount {name}"), e))?;
        match found {
            Some(found) if names::belongs_to(&found.metadata, id) => {
                delete_if_unchanged(api, &found, &format!("deleting ServiceAccount {name}"))
                    .await
                    .map(drop)
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use session_runtime::SessionIdentity;

    #[test]
    fn each_incarnation_has_an_account_of_its_own_with_no_token() {
        let id = SessionIdentity::new("prod", "agent", "discord", "1")
            .expect("identity")
            .id();
        let first = service_account("prod", &id, 1, "anchor-uid");
        let second = service_account("prod", &id, 2, "anchor-uid");
        assert_ne!(first.name_any(), second.name_any());
        assert_eq!(first.automount_service_account_token, Some(false));
        assert!(first.secrets.is_none() && first.image_pull_secrets.is_none());
        assert!(names::belongs_to(&first.metadata, &id));
        let owner = first.owner_references().first().cloned().expect("owned");
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str()),
            ("OabSession", "anchor-uid")
        );
    }
}
