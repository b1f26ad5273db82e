//! The warm pool: started workers of a profile with no session yet, which an attach claims
//! instead of starting a worker (the profile's `warm_pool`).
//!
//! A member is a worker Pod `oab-m-<random>` of the profile, labelled `role=pool` with its
//! profile version and the broker key that binds it, running as a ServiceAccount of its own (of
//! the same name, no token, nothing bound) and owned by the OabProfile. Its relay listens
//! unbound (`oab-relay serve --unbound`, holding only the hash of the member's bind token) and
//! no agent runs, so it holds nothing of any session.
//!
//! **Exactly one session gets each member.** An attach writes the member's name into the record
//! of its new generation (by compare-and-swap on the anchor, as every attach does), then
//! relabels the member as that session's worker, owned by its anchor, with the member's
//! `resourceVersion` as precondition: of two brokers that picked the same member one is refused
//! (409), puts the record back to the cold worker's name and starts one. The winner binds the
//! relay (session, generation, the hash of that generation's token, the agent's gateway
//! credential) and connects as to any worker; the agent starts on its first hello. A claimed
//! member is never returned: it is the session's worker from then on and goes as any worker goes.
//!
//! Members are kept by the brokers, which hold the key that binds them (the controller holds
//! none): an attach that picked a member refills in the background once it has its worker (an
//! empty pool at once), and `reconcile` refills, trims members of another
//! profile version or key and any beyond the pool's size, and deletes member accounts whose Pod
//! is gone.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use kube::{Api, ResourceExt};
use parking_lot::Mutex;
use session_runtime::{Error, Result, SessionId, WorkerFailure};
use worker_relay::token::BrokerKey;
use worker_relay::Binding;

use crate::anchor::OabSession;
use crate::api::{api_error, is_status};
use crate::names;
use crate::pod::{deadline_seconds, member_meta, member_pod, owned_by_anchor, MemberSpec};
use crate::profile::WorkerProfile;
use crate::record::SessionRecord;
use crate::start::{progress, Progress};
use crate::KubernetesRuntime;

/// How long one bind exchange may take, connection included.
const BIND_TIMEOUT: Duration = Duration::from_secs(10);
/// How long binding a claimed member may keep being retried (its relay was ready a moment ago).
const BIND_BUDGET: Duration = Duration::from_secs(20);
/// How long a member's account may be there without its Pod before a pass deletes it: a refill
/// makes the account a moment before the Pod.
const ACCOUNT_GRACE: Duration = Duration::from_secs(120);

/// What this process knows of the pool besides the API server.
#[derive(Debug, Default)]
pub(crate) struct PoolState {
    /// Members this process picked: never picked again (the watch may show one as a member for
    /// a moment after the claim relabelled it).
    picked: Mutex<HashSet<String>>,
    /// One refill at a time in this process, so two do not both make the missing members.
    refilling: tokio::sync::Mutex<()>,
    /// Background refills, stopped with the runtime.
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
}

impl PoolState {
    /// Stops the background refills.
    pub(crate) fn stop(&self) {
        for task in self.tasks.lock().drain(..) {
            task.abort();
        }
    }
}

/// What a refill did, for `reconcile`'s report.
#[derive(Debug, Default)]
pub(crate) struct Refill {
    pub(crate) started: Vec<String>,
    pub(crate) trimmed: Vec<String>,
    pub(crate) errors: Vec<String>,
}

/// The label value naming the broker key that binds a member: a prefix of the hash of a bind
/// token no member is named after (members are `oab-m-…`), which binds nothing.
pub(crate) fn key_label(key: &BrokerKey) -> String {
    let hash = key.bind_token("openab.dev/pool-key").hash().to_hex();
    hash[..20].to_owned()
}

/// A new member's name: [`names::MEMBER_PREFIX`] and 80 random bits.
fn member_name() -> Result<String> {
    let bytes: [u8; 10] = crate::runtime::random_bytes("a pool member's name", true)?;
    Ok(format!(
        "{}{}",
        names::MEMBER_PREFIX,
        data_encoding::BASE32_NOPAD.encode(&bytes).to_ascii_lowercase()
    ))
}

fn label<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata.labels.as_ref()?.get(key).map(String::as_str)
}

/// Whether `pod` is an unclaimed member of `profile`'s pool, of any version or key.
fn of_profile(pod: &Pod, profile: &WorkerProfile) -> bool {
    label(pod, names::ROLE) == Some(names::POOL_ROLE)
        && label(pod, names::PROFILE) == Some(names::profile_label(profile.name()).as_str())
        && pod.metadata.deletion_timestamp.is_none()
}

/// Whether `pod` is a member of `profile`'s pool that this broker can claim: of the profile's
/// current version and bound with `key_label`'s key.
fn current(pod: &Pod, profile: &WorkerProfile, key_label: &str) -> bool {
    of_profile(pod, profile)
        && label(pod, names::POOL_KEY) == Some(key_label)
        && pod
            .annotations()
            .get(names::PROFILE_VERSION)
            .is_some_and(|version| version == profile.version())
}

impl KubernetesRuntime {
    /// Whether attaches of `profile` may claim warm workers: the profile keeps a pool and this
    /// broker's key was given (a random key binds only this process's members, which no other
    /// broker, nor this one after a restart, could use).
    pub(crate) fn pooled(&self, profile: &WorkerProfile) -> bool {
        profile.warm_pool > 0 && self.shared_key
    }

    /// A ready member of `profile`'s pool, as the broker's shared watch of its workers sees it,
    /// picked so that no other attach of this process picks it; `None` when the pool is empty
    /// (or the watch has not listed yet), which also starts a refill.
    pub(crate) async fn pick_member(&self, profile: &WorkerProfile) -> Option<Pod> {
        if !self.pooled(profile) {
            return None;
        }
        let watch = self.worker_watch().await.ok()?;
        let ready = watch
            .pods_where(|pod| current(pod, profile, &self.pool_key) && progress(pod) == Progress::Ready)
            .unwrap_or_default();
        let picked = {
            let mut picked = self.pool.picked.lock();
            // Forget the members no longer in the pool (claimed, or gone).
            let members: HashSet<String> = watch
                .pods_where(|pod| label(pod, names::ROLE) == Some(names::POOL_ROLE))
                .unwrap_or_default()
                .iter()
                .map(ResourceExt::name_any)
                .collect();
            if !members.is_empty() {
                picked.retain(|name| members.contains(name));
            }
            let oldest = ready
                .into_iter()
                .filter(|pod| !picked.contains(&pod.name_any()))
                .min_by_key(|pod| pod.metadata.creation_timestamp.clone().map(|time| time.0));
            if let Some(pod) = &oldest {
                picked.insert(pod.name_any());
            }
            oldest
        };
        // An empty pool needs filling now; a pick leaves a place the attach fills once it has
        // its worker, so that the refill's requests do not slow the claim.
        if picked.is_none() {
            self.spawn_refill(profile).await;
        }
        picked
    }

    /// Returns a member picked but not claimed (the attach did not get as far) to the pool.
    pub(crate) fn unpick(&self, member: &Pod) {
        self.pool.picked.lock().remove(&member.name_any());
    }

    /// Makes `member` the worker of the generation `record` holds: the session's labels and
    /// owner, its deadline counted from the member's start, with the `resourceVersion` the pick
    /// saw as precondition. `None`: another broker claimed it first, or it is gone.
    ///
    /// # Errors
    /// [`Error::Backend`] if the API server failed otherwise.
    pub(crate) async fn claim_member(
        &self,
        id: &SessionId,
        anchor: &OabSession,
        record: &SessionRecord,
        member: &Pod,
        profile: &WorkerProfile,
    ) -> Result<Option<Pod>> {
        let name = member.name_any();
        let owner = owned_by_anchor(id, &anchor.uid().unwrap_or_default());
        let mut patch = serde_json::json!({
            "metadata": {
                "resourceVersion": member.resource_version(),
                "labels": {
                    names::ROLE: "worker",
                    names::SESSION: id.to_string(),
                    names::GENERATION: record.generation.to_string(),
                    names::POOL_KEY: null,
                },
                "annotations": { names::SESSION_ID: id.to_string() },
                "ownerReferences": [owner],
            },
        });
        if let Some(limit) = profile.max_lifetime {
            // The kubelet counts the deadline from the Pod's start, which was before the claim.
            let started = member
                .status
                .as_ref()
                .and_then(|status| status.start_time.clone())
                .or(member.metadata.creation_timestamp.clone())
                .map_or(0, |time| time.0.as_second());
            let waited = u64::try_from(crate::runtime::jiff_now().as_second() - started).unwrap_or(0);
            patch["spec"] = serde_json::json!({
                "activeDeadlineSeconds": deadline_seconds(limit + Duration::from_secs(waited + 1)),
            });
        }
        match self
            .pods()
            .await?
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(claimed) => Ok(Some(claimed)),
            Err(error) if is_status(&error, 409) || is_status(&error, 404) => {
                tracing::debug!(session = %id, member = %name, "the warm worker was claimed or removed first");
                Ok(None)
            }
            Err(error) => Err(api_error(&format!("claiming the warm worker {name}"), error)),
        }
    }

    /// Binds the claimed member `pod`'s relay to the generation `record` holds: the session,
    /// the hash of that generation's token, and the agent's gateway credential.
    ///
    /// # Errors
    /// [`Error::WorkerFailed`] (`Spawn`) if the relay refused the binding or never answered
    /// within the bind budget.
    pub(crate) async fn bind_member(
        &self,
        id: &SessionId,
        pod: &Pod,
        record: &SessionRecord,
        profile: &WorkerProfile,
    ) -> Result<()> {
        let name = pod.name_any();
        let connector = self.connector(id, pod, profile.relay_port).await?;
        let token_hash = self.key.token(id.as_str(), record.generation).hash();
        let mut binding = Binding::new(id.to_string(), record.generation, token_hash);
        if let Some(egress) = self.worker_egress(id, profile)? {
            for (variable, value) in egress.env() {
                binding = binding.env(variable, value);
            }
        }
        let bind_token = self.key.bind_token(&name);
        let deadline = tokio::time::Instant::now() + BIND_BUDGET;
        loop {
            match worker_relay::bind(&*connector, &bind_token, &binding, BIND_TIMEOUT).await {
                Ok(()) => return Ok(()),
                Err(error) if error.is_retryable() && tokio::time::Instant::now() < deadline => {
                    tracing::debug!(session = %id, member = %name, "binding the warm worker: {error}");
                    tokio::time::sleep(crate::runtime::POLL).await;
                }
                Err(error) => {
                    return Err(Error::WorkerFailed {
                        id: *id,
                        cause: WorkerFailure::Spawn(format!(
                            "binding the warm worker {name} failed: {error}"
                        )),
                    })
                }
            }
        }
    }

    /// Starts a refill of `profile`'s pool in the background (stopped with the runtime).
    pub(crate) async fn spawn_refill(&self, profile: &WorkerProfile) {
        let Ok(keeper) = self.pool_keeper().await else {
            return;
        };
        let profile = profile.clone();
        let task = tokio::spawn(async move {
            let refill = keeper.refill(&profile).await;
            for error in refill.errors {
                tracing::warn!(profile = profile.name(), "refilling the warm pool: {error}");
            }
        });
        let mut tasks = self.pool.tasks.lock();
        tasks.retain(|task| !task.is_finished());
        tasks.push(task.abort_handle());
    }

    /// Refills `profile`'s pool, trims what does not belong in it and deletes member accounts
    /// whose Pod is gone; for `reconcile`.
    pub(crate) async fn refill_pool(&self, profile: &WorkerProfile) -> Result<Refill> {
        Ok(self.pool_keeper().await?.refill(profile).await)
    }

    async fn pool_keeper(&self) -> Result<Keeper> {
        Ok(Keeper {
            pods: self.pods().await?.clone(),
            accounts: self.service_accounts().await?.clone(),
            installation: self.installation().to_owned(),
            key: self.key.clone(),
            key_label: self.pool_key.clone(),
            state: Arc::clone(&self.pool),
        })
    }
}

/// What a refill does with the installation's workers and members as listed.
#[derive(Debug)]
struct Plan<'a> {
    /// Members to remove: of another profile version or key, failed (they serve nobody), and
    /// those beyond the pool's size.
    remove: Vec<&'a Pod>,
    /// How many members to start.
    start: usize,
}

fn plan<'a>(
    pods: &'a [Pod],
    profile: &WorkerProfile,
    key_label: &str,
    target: usize,
    picked: &HashSet<String>,
) -> Plan<'a> {
    let (members, mut remove): (Vec<&Pod>, Vec<&Pod>) = pods
        .iter()
        .filter(|pod| of_profile(pod, profile))
        // A member this process picked is on its way out of the pool (its claim may not have
        // landed yet): neither counted nor removed.
        .filter(|pod| !picked.contains(&pod.name_any()))
        .partition(|pod| current(pod, profile, key_label) && !matches!(progress(pod), Progress::Failed(_)));
    let mut members = members;
    // Ready ones first, the oldest first: what is cut is what would serve last.
    members.sort_by_key(|pod| {
        (
            progress(pod) != Progress::Ready,
            pod.metadata.creation_timestamp.clone().map(|time| time.0),
        )
    });
    let surplus = members.split_off(target.min(members.len()));
    remove.extend(surplus);
    Plan {
        remove,
        start: target - members.len(),
    }
}

/// What a refill needs, detached from the runtime so it can run in the background.
struct Keeper {
    pods: Api<Pod>,
    accounts: Api<ServiceAccount>,
    installation: String,
    key: BrokerKey,
    key_label: String,
    state: Arc<PoolState>,
}

impl Keeper {
    async fn refill(&self, profile: &WorkerProfile) -> Refill {
        let _one = self.state.refilling.lock().await;
        let mut refill = Refill::default();
        let selector = names::workers_selector(&self.installation);
        let pods = match self.pods.list(&ListParams::default().labels(&selector)).await {
            Ok(list) => list.items,
            Err(error) => {
                refill.errors.push(format!("listing the pool's members: {error}"));
                return refill;
            }
        };
        let target = usize::try_from(profile.warm_pool).unwrap_or(0);
        let picked = self.state.picked.lock().clone();
        let plan = plan(&pods, profile, &self.key_label, target, &picked);
        if target == 0 && plan.remove.is_empty() {
            // No pool and no member: nothing to do. (The accounts of members claimed before the
            // pool was turned off go with the first pass that keeps a pool again.)
            return refill;
        }
        for pod in plan.remove {
            match self.remove(pod).await {
                Ok(()) => refill.trimmed.push(pod.name_any()),
                Err(error) => refill.errors.push(error.to_string()),
            }
        }
        for _ in 0..plan.start {
            match self.start_member(profile).await {
                Ok(name) => refill.started.push(name),
                Err(error) => {
                    refill.errors.push(error.to_string());
                    break;
                }
            }
        }
        // The members just started have an account and a Pod the list predates.
        let named: HashSet<String> = pods
            .iter()
            .map(ResourceExt::name_any)
            .chain(refill.started.iter().cloned())
            .collect();
        self.delete_stray_accounts(&named, &mut refill.errors).await;
        refill
    }

    /// Makes one member: its account, then its Pod.
    async fn start_member(&self, profile: &WorkerProfile) -> Result<String> {
        let name = member_name()?;
        let bind_hash = self.key.bind_token(&name).hash();
        let spec = MemberSpec {
            name: &name,
            installation: &self.installation,
            profile_uid: profile.uid().unwrap_or_default(),
            bind_hash: &bind_hash,
            key_label: &self.key_label,
        };
        let account = ServiceAccount {
            metadata: member_meta(profile, &spec),
            automount_service_account_token: Some(false),
            ..ServiceAccount::default()
        };
        self.accounts
            .create(&PostParams::default(), &account)
            .await
            .map_err(|e| api_error(&format!("creating the warm worker account {name}"), e))?;
        self.pods
            .create(&PostParams::default(), &member_pod(profile, &spec))
            .await
            .map_err(|e| api_error(&format!("creating the warm worker {name}"), e))?;
        Ok(name)
    }

    /// Deletes a member (that Pod, unclaimed: its resourceVersion as seen) and its account.
    async fn remove(&self, pod: &Pod) -> Result<()> {
        let name = pod.name_any();
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: pod.uid(),
                // A claim changes it: a member claimed meanwhile is a session's, not the pool's.
                resource_version: pod.resource_version(),
            }),
            ..DeleteParams::default()
        };
        match self.pods.delete(&name, &params).await {
            Ok(_) => {}
            Err(error) if is_status(&error, 404) => {}
            Err(error) if is_status(&error, 409) => return Ok(()),
            Err(error) => return Err(api_error(&format!("deleting the warm worker {name}"), error)),
        }
        match self.accounts.delete(&name, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(error) if is_status(&error, 404) => Ok(()),
            Err(error) => Err(api_error(
                &format!("deleting the warm worker account {name}"),
                error,
            )),
        }
    }

    /// Deletes the accounts of members whose Pod is gone (deleted as a session's worker, or
    /// never made), past [`ACCOUNT_GRACE`].
    async fn delete_stray_accounts(&self, pods: &HashSet<String>, errors: &mut Vec<String>) {
        let selector = format!(
            "{},{}={}",
            names::installation_selector(&self.installation),
            names::ROLE,
            names::POOL_ROLE
        );
        let accounts = match self.accounts.list(&ListParams::default().labels(&selector)).await {
            Ok(list) => list.items,
            Err(error) => {
                errors.push(format!("listing the warm workers' accounts: {error}"));
                return;
            }
        };
        let now = crate::runtime::jiff_now().as_second();
        let grace = i64::try_from(ACCOUNT_GRACE.as_secs()).unwrap_or(i64::MAX);
        for account in accounts {
            let name = account.name_any();
            let age = account
                .metadata
                .creation_timestamp
                .as_ref()
                .map_or(0, |time| now - time.0.as_second());
            if pods.contains(&name) || age < grace {
                continue;
            }
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: account.uid(),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            };
            match self.accounts.delete(&name, &params).await {
                Ok(_) => {}
                Err(error) if is_status(&error, 404) || is_status(&error, 409) => {}
                Err(error) => errors.push(format!("deleting the warm worker account {name}: {error}")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(document: &str) -> WorkerProfile {
        WorkerProfile::from_toml("coder", "7", document).expect("profile")
    }

    const POOLED: &str = "image = \"openab.dev/worker:test\"\nagent = [\"/agent\"]\nwarm_pool = 2\n[storage]\nkind = \"ephemeral\"\n";

    #[test]
    fn a_member_is_a_worker_of_the_profile_with_no_session_and_an_unbound_relay() {
        let profile = profile(POOLED);
        let key = BrokerKey::new(b"k".repeat(32));
        let name = "oab-m-abc";
        let hash = key.bind_token(name).hash();
        let pod = member_pod(
            &profile,
            &MemberSpec {
                name,
                installation: "prod",
                profile_uid: "uid-1",
                bind_hash: &hash,
                key_label: &key_label(&key),
            },
        );
        let labels = pod.labels().clone();
        assert_eq!(labels.get(names::ROLE).map(String::as_str), Some("pool"));
        assert!(!labels.contains_key(names::SESSION), "no session: {labels:?}");
        assert!(current(&pod, &profile, &key_label(&key)));
        assert!(!current(
            &pod,
            &profile,
            &key_label(&BrokerKey::new(b"j".repeat(32)))
        ));
        let spec = pod.spec.as_ref().expect("spec");
        assert_eq!(spec.service_account_name.as_deref(), Some(name));
        assert_eq!(spec.automount_service_account_token, Some(false));
        assert_eq!(
            spec.active_deadline_seconds, None,
            "the deadline is set at the claim"
        );
        let container = &spec.containers[0];
        let command = container.command.clone().unwrap_or_default();
        assert!(command.contains(&"--unbound".to_owned()), "{command:?}");
        let env: Vec<(String, Option<String>)> = container
            .env
            .clone()
            .unwrap_or_default()
            .into_iter()
            .map(|var| (var.name, var.value))
            .collect();
        assert!(env.contains(&(
            worker_relay::token::BIND_TOKEN_HASH_ENV.to_owned(),
            Some(hash.to_hex())
        )));
        assert!(
            env.iter().all(|(name, _)| !matches!(
                name.as_str(),
                "OAB_RELAY_SESSION" | "OAB_RELAY_GENERATION" | "OAB_RELAY_TOKEN_SHA256"
            )),
            "a member knows no session: {env:?}"
        );
        let owner = &pod.metadata.owner_references.as_ref().expect("owner")[0];
        assert_eq!((owner.kind.as_str(), owner.uid.as_str()), ("OabProfile", "uid-1"));
        let other_version = WorkerProfile::from_toml(profile.name(), "8", POOLED).expect("profile");
        assert!(
            !current(&pod, &other_version, &key_label(&key)),
            "another version is stale"
        );
        assert!(of_profile(&pod, &other_version));
    }

    /// A member of `profile` made with `key`, in `phase` and ready or not.
    fn member(profile: &WorkerProfile, name: &str, key: &BrokerKey, phase: &str, ready: bool) -> Pod {
        let hash = key.bind_token(name).hash();
        let mut pod = member_pod(
            profile,
            &MemberSpec {
                name,
                installation: "prod",
                profile_uid: "uid-1",
                bind_hash: &hash,
                key_label: &key_label(key),
            },
        );
        pod.status = Some(k8s_openapi::api::core::v1::PodStatus {
            phase: Some(phase.to_owned()),
            conditions: Some(vec![k8s_openapi::api::core::v1::PodCondition {
                type_: "Ready".to_owned(),
                status: if ready { "True" } else { "False" }.to_owned(),
                ..Default::default()
            }]),
            ..Default::default()
        });
        pod
    }

    #[test]
    fn a_refill_replaces_stale_failed_and_surplus_members_and_leaves_the_rest() {
        let profile = profile(POOLED);
        let key = BrokerKey::new(b"k".repeat(32));
        let old = WorkerProfile::from_toml("coder", "6", POOLED).expect("profile");
        let other = WorkerProfile::from_toml("other", "7", POOLED).expect("profile");
        let mut claimed = member(&profile, "oab-m-claimed", &key, "Running", true);
        claimed
            .metadata
            .labels
            .as_mut()
            .expect("labels")
            .insert(names::ROLE.to_owned(), "worker".to_owned());
        let pods = vec![
            member(&profile, "oab-m-ready", &key, "Running", true),
            member(&profile, "oab-m-starting", &key, "Pending", false),
            member(&profile, "oab-m-failed", &key, "Failed", false),
            member(&old, "oab-m-old", &key, "Running", true),
            member(
                &profile,
                "oab-m-foreign",
                &BrokerKey::new(b"j".repeat(32)),
                "Running",
                true,
            ),
            member(&other, "oab-m-other-profile", &key, "Running", true),
            claimed,
        ];
        let removed = |plan: &Plan<'_>| -> Vec<String> {
            let mut names: Vec<String> = plan.remove.iter().map(|pod| pod.name_any()).collect();
            names.sort();
            names
        };
        let nothing_picked = HashSet::new();
        let full = plan(&pods, &profile, &key_label(&key), 3, &nothing_picked);
        assert_eq!(
            removed(&full),
            ["oab-m-failed", "oab-m-foreign", "oab-m-old"],
            "never another profile's member nor a claimed worker"
        );
        assert_eq!(full.start, 1, "two members count, a third is started");
        let smaller = plan(&pods, &profile, &key_label(&key), 1, &nothing_picked);
        assert_eq!(
            removed(&smaller),
            ["oab-m-failed", "oab-m-foreign", "oab-m-old", "oab-m-starting"],
            "beyond the size, the one that would serve last goes"
        );
        assert_eq!(smaller.start, 0);
        let none = plan(&pods, &profile, &key_label(&key), 0, &nothing_picked);
        assert_eq!(none.remove.len(), 5);
        assert_eq!(none.start, 0);
    }

    /// A refill that runs while an attach's claim of a picked member has not landed yet (the
    /// claim starts one) sees that member still in the pool: it must count it as gone, or the
    /// pool stays one short until the next pass; and never remove it from under the claim.
    #[test]
    fn a_member_this_process_picked_is_neither_counted_nor_removed() {
        let profile = profile(POOLED);
        let key = BrokerKey::new(b"k".repeat(32));
        let pods = vec![
            member(&profile, "oab-m-picked", &key, "Running", true),
            member(&profile, "oab-m-other", &key, "Running", true),
        ];
        let picked = HashSet::from(["oab-m-picked".to_owned()]);
        let refill = plan(&pods, &profile, &key_label(&key), 2, &picked);
        assert!(refill.remove.is_empty());
        assert_eq!(refill.start, 1, "the picked one's place is filled");
        let trim = plan(&pods, &profile, &key_label(&key), 0, &picked);
        let removed: Vec<String> = trim.remove.iter().map(|pod| pod.name_any()).collect();
        assert_eq!(removed, ["oab-m-other"], "never the picked one");
    }

    #[test]
    fn the_key_label_names_the_key_without_binding_anything() {
        let key = BrokerKey::new(b"k".repeat(32));
        let label = key_label(&key);
        assert_eq!(label, key_label(&BrokerKey::new(b"k".repeat(32))));
        assert_ne!(label, key_label(&BrokerKey::new(b"j".repeat(32))));
        assert_eq!(label.len(), 20);
        let name = member_name().expect("a name");
        assert!(
            name.starts_with(names::MEMBER_PREFIX) && name.len() <= 63,
            "{name}"
        );
        assert_ne!(name, member_name().expect("another"));
        assert!(!key.bind_token(&name).hash().to_hex().starts_with(&label));
    }
}
