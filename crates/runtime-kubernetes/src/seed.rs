//! Seeding a new session's volume at create: a copy of another, idle session's storage, the
//! profile's HOME template, and a git clone into the workspace, done by a short-lived Job
//! `oab-p-<session id>-<incarnation>` with the worker's image, identity and restrictions.
//!
//! The Job mounts only this session's directories of the volume (and the template and a copied
//! source, read-only), holds no service-account token, and ends within the start timeout. Its
//! container runs the image's `sh` with a fixed script; the clone URL and reference and the
//! copied directories reach it as environment variables, never as script text. A Secret used as
//! HOME template is mounted by the kubelet: its values never pass through the broker.
//!
//! A copy's source is lent for the copy by compare-and-swap on its anchor (see [`Loan`]): its
//! attach is refused meanwhile, and a source with a worker is refused at once, never waited on.

use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{
    ConfigMapVolumeSource, Container, EmptyDirVolumeSource, PersistentVolumeClaimVolumeSource, Pod, PodSpec,
    PodTemplateSpec, SecretVolumeSource, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use session_runtime::SessionId;

use kube::api::{DeleteParams, ListParams, PostParams, Preconditions};
use kube::ResourceExt;
use session_runtime::{Error, Result, SessionState};

use crate::anchor::OabSession;
use crate::api::{api_error, is_status};
use crate::clone_source::{check_clone_url, CloneUrl};
use crate::names;
use crate::pod::{
    dirs_on_volume, owned_by_anchor, plain_env, prepare_container, restricted_container, restricted_pod,
    PREPARE_MOUNT,
};
use crate::profile::{HomeTemplate, Storage, WorkerProfile};
use crate::record::{now, Loan, Phase, SeedRecord, SessionRecord, Volume as RecordVolume};
use crate::{KubernetesRuntime, RUNTIME};

/// Where the Job mounts the HOME template.
const TEMPLATE_MOUNT: &str = "/template";
/// Where the Job mounts a copied session's volume, when it is not the session's own.
const SOURCE_MOUNT: &str = "/source";
/// How long a loan outlives the start timeout, for a broker that vanished mid-copy.
const LOAN_MARGIN_SECONDS: u64 = 60;

/// Empties the session's directories and copies the source's into them (a copy's source is
/// another session's, and a retried copy must not merge with a partial one); then copies the
/// template's keys (ConfigMap and Secret volumes hold each key as a symlink into a hidden `..data`
/// directory, so the copy follows links and skips names starting with `..`), removing first
/// whatever a copied HOME holds at that name, which may be a link; then clones into an emptied
/// workspace. `$1` is the session's HOME directory, `$2` its workspace directory.
const SCRIPT: &str = r#"set -eu
home="$1"
work="$2"
if [ -n "${OAB_SEED_COPY_WORKSPACE:-}" ]; then
  rm -rf "$work" "$home"
  mkdir -p "$work" "$home"
  if [ -d "$OAB_SEED_COPY_WORKSPACE" ]; then cp -a "$OAB_SEED_COPY_WORKSPACE/." "$work/"; fi
  if [ -d "$OAB_SEED_COPY_HOME" ]; then cp -a "$OAB_SEED_COPY_HOME/." "$home/"; fi
fi
mkdir -p "$home"
if [ -d /template ]; then
  for entry in /template/* /template/.[!.]*; do
    [ -e "$entry" ] || continue
    rm -rf "$home/${entry##*/}"
    cp -L "$entry" "$home/"
  done
fi
if [ -n "${OAB_SEED_GIT_URL:-}" ]; then
  rm -rf "$work"
  if [ -n "${OAB_SEED_GIT_REF:-}" ]; then
    git -c http.followRedirects=false clone --quiet --branch "$OAB_SEED_GIT_REF" -- "$OAB_SEED_GIT_URL" "$work"
  else
    git -c http.followRedirects=false clone --quiet -- "$OAB_SEED_GIT_URL" "$work"
  fi
fi
mkdir -p "$work"
"#;

/// The session whose storage a copy reads.
#[derive(Debug)]
pub(crate) struct CopySource {
    pub(crate) claim: String,
    /// The source's own directory on its volume when the volume is borrowed (shared by
    /// sessions), so the Job sees no other session's; `None` when the volume is the source's.
    pub(crate) sub_path: Option<String>,
}

/// What one seed Job is made of besides the profile.
#[derive(Debug)]
pub(crate) struct SeedSpec<'a> {
    pub(crate) id: &'a SessionId,
    pub(crate) installation: &'a str,
    pub(crate) incarnation: u64,
    pub(crate) anchor_uid: &'a str,
    pub(crate) claim: &'a str,
    /// The checked clone URL, if the seed clones.
    pub(crate) clone: Option<&'a CloneUrl>,
    /// The git reference to check out, if the seed clones one.
    pub(crate) clone_reference: Option<&'a str>,
    pub(crate) copy: Option<&'a CopySource>,
    /// The Job's deadline, in seconds.
    pub(crate) deadline: i64,
}

/// The seed Job of a session.
///
/// Its container sees the session's own directories and nothing else of a volume: on a
/// borrowed volume (every session's directories side by side) it mounts the session's
/// directory alone, and a copied source's alone, read-only. The kubelet would make a missing
/// directory of a `subPath` as root, so on a borrowed volume the relay's `prepare` (a fixed
/// program with fixed arguments, never the caller's input) makes them first, as the worker user.
pub(crate) fn seed_job(profile: &WorkerProfile, spec: &SeedSpec<'_>) -> Job {
    let name = names::seed(spec.id, spec.incarnation);
    let mut metadata = names::meta(name, spec.installation, spec.id, "seed");
    if let Some(labels) = metadata.labels.as_mut() {
        // What the profile's egress policy selects (see network.rs).
        labels.insert(names::PROFILE.to_owned(), names::profile_label(profile.name()));
    }
    metadata.owner_references = Some(vec![owned_by_anchor(spec.id, spec.anchor_uid)]);
    let borrowed = matches!(profile.storage, Storage::Borrowed { .. });
    let own_dir = borrowed.then(|| spec.id.to_string());

    let mut volumes = vec![
        Volume {
            name: "session".to_owned(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: spec.claim.to_owned(),
                read_only: None,
            }),
            ..Volume::default()
        },
        Volume {
            name: "tmp".to_owned(),
            empty_dir: Some(EmptyDirVolumeSource {
                size_limit: Some(Quantity("256Mi".to_owned())),
                ..EmptyDirVolumeSource::default()
            }),
            ..Volume::default()
        },
    ];
    let mut mounts = vec![
        VolumeMount {
            name: "session".to_owned(),
            mount_path: PREPARE_MOUNT.to_owned(),
            sub_path: own_dir.clone(),
            ..VolumeMount::default()
        },
        VolumeMount {
            name: "tmp".to_owned(),
            mount_path: "/tmp".to_owned(),
            ..VolumeMount::default()
        },
    ];
    // Relative to a session's own directory (or its own volume): see pod::dirs_on_volume.
    let (workspace_dir, home_dir) = dirs_on_volume(false, spec.id);
    // On a borrowed volume, the directories `prepare` makes, relative to the whole volume.
    let mut to_prepare = own_dir
        .iter()
        .flat_map(|dir| [format!("{dir}/{workspace_dir}"), format!("{dir}/{home_dir}")])
        .collect::<Vec<_>>();
    if let Some(template) = &profile.home_template {
        let mut volume = Volume {
            name: "template".to_owned(),
            ..Volume::default()
        };
        match template {
            HomeTemplate::ConfigMap(map) => {
                volume.config_map = Some(ConfigMapVolumeSource {
                    name: map.clone(),
                    ..ConfigMapVolumeSource::default()
                })
            }
            HomeTemplate::Secret(secret) => {
                volume.secret = Some(SecretVolumeSource {
                    secret_name: Some(secret.clone()),
                    ..SecretVolumeSource::default()
                })
            }
        }
        volumes.push(volume);
        mounts.push(VolumeMount {
            name: "template".to_owned(),
            mount_path: TEMPLATE_MOUNT.to_owned(),
            read_only: Some(true),
            ..VolumeMount::default()
        });
    }

    let home = format!("{PREPARE_MOUNT}/{home_dir}");
    let mut env = vec![
        plain_env("HOME", home.clone()),
        plain_env("TMPDIR", "/tmp".to_owned()),
        plain_env("GIT_TERMINAL_PROMPT", "0".to_owned()),
    ];
    if let Some(clone) = spec.clone {
        env.push(plain_env("OAB_SEED_GIT_URL", clone.url.clone()));
        // git itself refuses any other transport (a submodule, a rewritten URL).
        env.push(plain_env("GIT_ALLOW_PROTOCOL", clone.scheme.to_owned()));
        if let Some(reference) = spec.clone_reference {
            env.push(plain_env("OAB_SEED_GIT_REF", reference.to_owned()));
        }
    }
    if let Some(source) = spec.copy {
        // The source's own directory, read-only: from the session's volume when both sessions
        // borrow it, else from the source's claim.
        let volume = if source.claim == spec.claim {
            "session".to_owned()
        } else {
            volumes.push(Volume {
                name: "source".to_owned(),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: source.claim.clone(),
                    read_only: Some(true),
                }),
                ..Volume::default()
            });
            "source".to_owned()
        };
        if let Some(dir) = &source.sub_path {
            if source.claim == spec.claim {
                // Its first worker would make them; a subPath the kubelet made would be root's.
                to_prepare.push(format!("{dir}/{workspace_dir}"));
                to_prepare.push(format!("{dir}/{home_dir}"));
            }
        }
        mounts.push(VolumeMount {
            name: volume,
            mount_path: SOURCE_MOUNT.to_owned(),
            sub_path: source.sub_path.clone(),
            read_only: Some(true),
            ..VolumeMount::default()
        });
        env.push(plain_env(
            "OAB_SEED_COPY_WORKSPACE",
            format!("{SOURCE_MOUNT}/{workspace_dir}"),
        ));
        env.push(plain_env(
            "OAB_SEED_COPY_HOME",
            format!("{SOURCE_MOUNT}/{home_dir}"),
        ));
    }
    let prepare = (!to_prepare.is_empty()).then(|| {
        prepare_container(
            profile,
            to_prepare
                .iter()
                .map(|dir| format!("{PREPARE_MOUNT}/{dir}"))
                .collect(),
        )
    });
    let container = Container {
        name: "seed".to_owned(),
        image: Some(profile.image.clone()),
        image_pull_policy: Some(profile.image_pull_policy.as_str().to_owned()),
        command: Some(vec![
            "/bin/sh".to_owned(),
            "-c".to_owned(),
            SCRIPT.to_owned(),
            "seed".to_owned(),
            home,
            format!("{PREPARE_MOUNT}/{workspace_dir}"),
        ]),
        working_dir: Some("/tmp".to_owned()),
        env: Some(env),
        volume_mounts: Some(mounts),
        security_context: Some(restricted_container()),
        resources: Some(crate::pod::resources(profile)),
        // git's own words, when it fails, become the container's termination message.
        termination_message_policy: Some("FallbackToLogsOnError".to_owned()),
        ..Container::default()
    };
    let labels = metadata.labels.clone();
    Job {
        metadata,
        spec: Some(JobSpec {
            backoff_limit: Some(0),
            active_deadline_seconds: Some(spec.deadline),
            // A backstop: the runtime deletes the Job once it ended.
            ttl_seconds_after_finished: Some(600),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels,
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    init_containers: prepare.map(|prepare| vec![prepare]),
                    containers: vec![container],
                    volumes: Some(volumes),
                    restart_policy: Some("Never".to_owned()),
                    service_account_name: Some(names::service_account(spec.id, spec.incarnation)),
                    automount_service_account_token: Some(false),
                    enable_service_links: Some(false),
                    runtime_class_name: profile.runtime_class.clone(),
                    security_context: Some(restricted_pod()),
                    termination_grace_period_seconds: Some(1),
                    ..PodSpec::default()
                }),
            },
            ..JobSpec::default()
        }),
        status: None,
    }
}

/// How a seed Job stands.
#[derive(Debug)]
pub(crate) enum SeedProgress {
    Running,
    Succeeded,
    /// It failed: the Job's reason and the Pod's own words.
    Failed(String),
}

/// Classifies a seed Job and its Pod (if one is known).
pub(crate) fn seed_progress(job: &Job, pod: Option<&Pod>) -> SeedProgress {
    let status = job.status.as_ref();
    if status.and_then(|s| s.succeeded).unwrap_or(0) > 0 {
        return SeedProgress::Succeeded;
    }
    let job_failed = status
        .and_then(|s| s.conditions.as_ref())
        .and_then(|conditions| {
            conditions
                .iter()
                .find(|c| (c.type_ == "Failed" || c.type_ == "FailureTarget") && c.status == "True")
        })
        .map(|c| {
            format!(
                "{}{}",
                c.reason.clone().unwrap_or_else(|| "Failed".to_owned()),
                c.message.as_ref().map(|m| format!(": {m}")).unwrap_or_default()
            )
        });
    // With no retries (backoffLimit 0), a failed Pod is the Job's end, and one the kubelet
    // cannot start (a missing image, a missing template) will not start later: no need to wait
    // for the Job's condition or its deadline.
    match (job_failed, pod.and_then(pod_failure)) {
        (Some(job), Some(pod)) => SeedProgress::Failed(format!("{job}; {pod}")),
        (Some(words), None) | (None, Some(words)) => SeedProgress::Failed(words),
        (None, None) => SeedProgress::Running,
    }
}

/// What went wrong with the seed Pod, in its own words.
fn pod_failure(pod: &Pod) -> Option<String> {
    let container = pod.status.as_ref()?.container_statuses.as_ref()?.first()?;
    let state = container.state.as_ref()?;
    if let Some(terminated) = &state.terminated {
        if terminated.exit_code == 0 {
            return None;
        }
        let words = terminated.message.as_deref().map(str::trim).unwrap_or_default();
        return Some(format!("the seed exited with {}: {words}", terminated.exit_code));
    }
    match crate::start::progress(pod) {
        crate::start::Progress::Failed(cause) => Some(cause.to_string()),
        _ => None,
    }
}

/// How often a running seed Job is looked at.
const POLL: std::time::Duration = std::time::Duration::from_millis(200);

impl KubernetesRuntime {
    /// Seeds the session's volume (the recorded copy or clone, the profile's HOME template) with
    /// a Job, and waits for it. A Job an earlier, interrupted attempt left is adopted while it
    /// runs and replaced if it failed. A copy's source is lent for the Job's run and given back
    /// after it, whatever the outcome.
    ///
    /// # Errors
    /// [`Error::Backend`]: not retryable when the seed failed (the Pod's words: git's message, a
    /// missing image or template), retryable when it did not end within the start timeout or
    /// the API failed. For a copy, also the errors of [`Self::lend`].
    ///
    /// # Cancellation
    /// A Job already created runs on and is adopted by the next attempt; a loan lapses by itself
    /// after the start timeout and a minute.
    pub(crate) async fn seed(
        &self,
        id: &SessionId,
        anchor: &OabSession,
        record: &SessionRecord,
        profile: &WorkerProfile,
    ) -> Result<()> {
        let Some(claim) = record.volume.claim() else {
            return Err(Error::Unsupported {
                runtime: RUNTIME,
                operation: "a workspace seed with the profile's ephemeral storage (the seed would not outlive its Job)",
            });
        };
        let Some(SeedRecord::CopyOf { copy_of: source }) = &record.seed else {
            return self.run_seed_job(id, anchor, record, profile, claim, None).await;
        };
        let copy = self.lend(source, id).await?;
        let outcome = self
            .run_seed_job(id, anchor, record, profile, claim, Some(&copy))
            .await;
        self.end_loan(source, id).await;
        outcome
    }

    /// Checks, without writing, that `source` exists and is idle: [`Self::lend`]'s refusals,
    /// ahead of making the copy's anchor.
    pub(crate) async fn check_copy_source(&self, source: &SessionId) -> Result<()> {
        let (_, record) = self.load(source).await?.ok_or(Error::NotFound { id: *source })?;
        copyable(source, &record, None).map(drop)
    }

    /// Lends `source`'s storage to a copy into `to`, by compare-and-swap on its anchor: until the
    /// loan ends, its attach is refused with [`Error::StorageInUse`].
    ///
    /// # Errors
    /// - [`Error::StorageInUse`] if `source` has a worker (recorded, or a Pod still there), is
    ///   being provisioned, or is lent to another copy: refused at once, never waited on.
    /// - [`Error::NotFound`] if there is no such session, [`Error::InvalidState`] if it is closed.
    /// - [`Error::Unsupported`] if its storage is ephemeral.
    pub(crate) async fn lend(&self, source: &SessionId, to: &SessionId) -> Result<CopySource> {
        let until = now() + self.start_timeout().as_secs() + LOAN_MARGIN_SECONDS;
        let (_, record) = self
            .update(source, |record| {
                copyable(source, record, Some(to))?;
                let mut next = record.clone();
                next.lent_to = Some(Loan { to: *to, until });
                Ok(Some(next))
            })
            .await?;
        // A suspend deletes the Pod and waits for it; one a crashed broker left is still there.
        if let Some(pod) = self.worker(source, &record.worker_pod()).await? {
            self.end_loan(source, to).await;
            return Err(Error::StorageInUse {
                id: *source,
                holder: format!("its worker Pod {} is still there", pod.name_any()),
            });
        }
        let claim = record.volume.claim().unwrap_or_default().to_owned();
        let borrowed = matches!(record.volume, RecordVolume::Borrowed { .. });
        Ok(CopySource {
            claim,
            sub_path: borrowed.then(|| source.to_string()),
        })
    }

    /// Ends `source`'s loan to `to`, if it still has it. A failure is logged: the loan lapses
    /// by itself.
    async fn end_loan(&self, source: &SessionId, to: &SessionId) {
        let ended = self
            .update(source, |record| match &record.lent_to {
                Some(loan) if loan.to == *to => {
                    let mut next = record.clone();
                    next.lent_to = None;
                    Ok(Some(next))
                }
                _ => Ok(None),
            })
            .await;
        match ended {
            Ok(_) | Err(Error::NotFound { .. }) => {}
            Err(error) => tracing::warn!(
                session = %source,
                "ending the loan of its storage to session {to} failed (it lapses by itself): {error}"
            ),
        }
    }

    /// Runs the seed Job and waits for it.
    async fn run_seed_job(
        &self,
        id: &SessionId,
        anchor: &OabSession,
        record: &SessionRecord,
        profile: &WorkerProfile,
        claim: &str,
        copy: Option<&CopySource>,
    ) -> Result<()> {
        let jobs = self.jobs().await?;
        let name = names::seed(id, record.incarnation);
        let timeout = self.start_timeout();
        // Checked again against the profile as it is now: it may have been narrowed since the
        // create recorded the URL.
        let (clone, clone_reference) = match &record.seed {
            Some(SeedRecord::GitClone {
                git_url,
                git_reference,
            }) => {
                let clone = check_clone_url(git_url, &profile.seed_hosts).map_err(|reason| {
                    Error::InvalidArgument {
                        reason: format!("session {id}: the workspace seed {reason}"),
                    }
                })?;
                (Some(clone), git_reference.as_deref())
            }
            _ => (None, None),
        };
        let spec = SeedSpec {
            id,
            installation: self.installation(),
            incarnation: record.incarnation,
            anchor_uid: &anchor.uid().unwrap_or_default(),
            claim,
            clone: clone.as_ref(),
            clone_reference,
            copy,
            deadline: i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX).max(1),
        };
        let job = seed_job(profile, &spec);
        let existing = jobs
            .get_opt(&name)
            .await
            .map_err(|e| api_error(&format!("reading seed Job {name}"), e))?;
        if let Some(existing) = existing {
            if !names::belongs_to(&existing.metadata, id) {
                return Err(Error::Backend {
                    runtime: RUNTIME,
                    retryable: false,
                    message: format!(
                        "session {id}: the Job {name} exists but is not this session's; it is left alone"
                    ),
                    source: None,
                });
            }
            if matches!(seed_progress(&existing, None), SeedProgress::Failed(_)) {
                self.remove_seed_job(&name, existing.uid()).await?;
                self.create_seed_job(&job).await?;
            }
        } else {
            self.create_seed_job(&job).await?;
        }
        let deadline = tokio::time::Instant::now() + timeout + std::time::Duration::from_secs(10);
        let pods = self.pods().await?;
        let selector = ListParams::default().labels(&format!("batch.kubernetes.io/job-name={name}"));
        loop {
            let current = jobs
                .get(&name)
                .await
                .map_err(|e| api_error(&format!("reading seed Job {name}"), e))?;
            let pod = pods
                .list(&selector)
                .await
                .map_err(|e| api_error(&format!("listing the Pod of seed Job {name}"), e))?
                .items
                .into_iter()
                .next();
            match seed_progress(&current, pod.as_ref()) {
                SeedProgress::Succeeded => {
                    self.remove_seed_job(&name, current.uid()).await?;
                    return Ok(());
                }
                SeedProgress::Failed(words) => {
                    self.remove_seed_job(&name, current.uid()).await?;
                    return Err(Error::Backend {
                        runtime: RUNTIME,
                        retryable: false,
                        message: format!("session {id}: seeding the volume failed: {words}"),
                        source: None,
                    });
                }
                SeedProgress::Running => {}
            }
            if tokio::time::Instant::now() >= deadline {
                self.remove_seed_job(&name, current.uid()).await?;
                return Err(Error::Backend {
                    runtime: RUNTIME,
                    retryable: true,
                    message: format!("session {id}: the seed Job did not end within {timeout:?}"),
                    source: None,
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }

    async fn create_seed_job(&self, job: &Job) -> Result<()> {
        let name = job.metadata.name.clone().unwrap_or_default();
        match self.jobs().await?.create(&PostParams::default(), job).await {
            Ok(_) => Ok(()),
            // Another broker's attempt: the same Job, waited on alike.
            Err(error) if is_status(&error, 409) => Ok(()),
            Err(error) => Err(api_error(&format!("creating seed Job {name}"), error)),
        }
    }

    /// Deletes the seed Job (that one: UID precondition) and its Pod.
    async fn remove_seed_job(&self, name: &str, uid: Option<String>) -> Result<()> {
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid,
                resource_version: None,
            }),
            ..DeleteParams::background()
        };
        match self.jobs().await?.delete(name, &params).await {
            Ok(_) => Ok(()),
            Err(error) if is_status(&error, 404) || is_status(&error, 409) => Ok(()),
            Err(error) => Err(api_error(&format!("deleting seed Job {name}"), error)),
        }
    }
}

/// Whether `source`'s storage may be copied now (into `to`, whose own earlier loan does not
/// count against it).
fn copyable(source: &SessionId, record: &SessionRecord, to: Option<&SessionId>) -> Result<()> {
    let in_use = |holder: String| Error::StorageInUse { id: *source, holder };
    match record.phase {
        Phase::Provisioning => return Err(in_use("it is still being provisioned".to_owned())),
        Phase::Session(SessionState::Closing | SessionState::Closed) => {
            return Err(Error::InvalidState {
                id: *source,
                state: record.state(),
                operation: "copy its storage",
            })
        }
        Phase::Session(_) => {}
    }
    if let Some(worker) = &record.worker {
        return Err(in_use(format!(
            "its worker of generation {} is attached; suspend the session first",
            worker.generation
        )));
    }
    if record.volume.claim().is_none() {
        return Err(Error::Unsupported {
            runtime: RUNTIME,
            operation: "a copy of a session whose storage is ephemeral",
        });
    }
    if let Some(loan) = record
        .lent_to
        .as_ref()
        .filter(|loan| loan.active() && Some(&loan.to) != to)
    {
        return Err(in_use(format!(
            "a copy of it into session {} is being taken",
            loan.to
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::WorkerRecord;
    use session_runtime::SessionIdentity;

    fn session(thread: &str) -> SessionId {
        SessionIdentity::new("prod", "agent", "slack", thread)
            .expect("identity")
            .id()
    }

    fn idle_source() -> SessionRecord {
        let mut record = SessionRecord::new(session("source"), "digest".to_owned(), 2, 1);
        record.phase = Phase::Session(SessionState::Suspended);
        record.volume = RecordVolume::Owned {
            claim: "oab-d-source-1".to_owned(),
            uid: Some("uid".to_owned()),
        };
        record
    }

    fn refusal(record: &SessionRecord, to: &SessionId) -> Option<Error> {
        copyable(&record.id, record, Some(to)).err()
    }

    #[test]
    fn an_idle_source_with_a_volume_may_be_copied_and_nothing_else_may() {
        let (source, fork) = (idle_source(), session("fork"));
        assert!(refusal(&source, &fork).is_none(), "suspended, with a claim");
        let mut created = source.clone();
        created.phase = Phase::Session(SessionState::Created);
        assert!(refusal(&created, &fork).is_none(), "created, never attached");

        let mut running = source.clone();
        running.phase = Phase::Session(SessionState::Running);
        running.worker = Some(WorkerRecord {
            generation: 3,
            pod_uid: None,
            started_at: 0,
            holder_epoch: None,
            pod: None,
        });
        assert!(matches!(refusal(&running, &fork), Some(Error::StorageInUse { id, .. }) if id == source.id));

        let mut provisioning = source.clone();
        provisioning.phase = Phase::Provisioning;
        assert!(matches!(
            refusal(&provisioning, &fork),
            Some(Error::StorageInUse { .. })
        ));

        let mut closed = source.clone();
        closed.phase = Phase::Session(SessionState::Closed);
        assert!(matches!(
            refusal(&closed, &fork),
            Some(Error::InvalidState {
                state: SessionState::Closed,
                ..
            })
        ));

        let mut ephemeral = source.clone();
        ephemeral.volume = RecordVolume::Ephemeral;
        assert!(matches!(
            refusal(&ephemeral, &fork),
            Some(Error::Unsupported { .. })
        ));
    }

    #[test]
    fn a_source_lent_to_another_copy_is_refused_until_the_loan_ends_or_lapses() {
        let (mut source, fork, other) = (idle_source(), session("fork"), session("other"));
        source.lent_to = Some(Loan {
            to: other,
            until: now() + 300,
        });
        match refusal(&source, &fork) {
            Some(Error::StorageInUse { holder, .. }) => assert!(holder.contains(other.as_str()), "{holder}"),
            other => panic!("a source lent to another copy: {other:?}"),
        }
        assert!(
            copyable(&source.id, &source, None).is_err(),
            "the check ahead of create counts every loan"
        );
        assert!(
            refusal(&source, &other).is_none(),
            "the copy that holds the loan goes on (a retry)"
        );
        source.lent_to = Some(Loan {
            to: other,
            until: now().saturating_sub(1),
        });
        assert!(
            refusal(&source, &fork).is_none(),
            "a lapsed loan (its broker vanished) holds nothing"
        );
    }

    fn profile(extra: &str) -> WorkerProfile {
        WorkerProfile::from_toml(
            "worker",
            "1",
            &format!(
                "image = \"openab.dev/worker:test\"\nagent = [\"/usr/local/bin/acp-test-agent\"]\n{extra}"
            ),
        )
        .expect("profile")
    }

    fn pod_spec(job: Job) -> PodSpec {
        job.spec.and_then(|spec| spec.template.spec).expect("pod spec")
    }

    fn env(container: &Container, name: &str) -> Option<String> {
        container
            .env
            .iter()
            .flatten()
            .find(|var| var.name == name)
            .and_then(|var| var.value.clone())
    }

    fn mount<'a>(container: &'a Container, path: &str) -> &'a VolumeMount {
        container
            .volume_mounts
            .iter()
            .flatten()
            .find(|mount| mount.mount_path == path)
            .unwrap_or_else(|| panic!("a mount at {path}"))
    }

    #[test]
    fn a_copy_job_mounts_another_volume_read_only() {
        let profile = profile("");
        let (target, anchor_uid) = (session("fork"), "anchor-uid".to_owned());
        let copy = CopySource {
            claim: "oab-d-source-1".to_owned(),
            sub_path: None,
        };
        let spec = SeedSpec {
            id: &target,
            installation: "prod",
            incarnation: 1,
            anchor_uid: &anchor_uid,
            claim: "oab-d-fork-1",
            clone: None,
            clone_reference: None,
            copy: Some(&copy),
            deadline: 60,
        };
        let pod = pod_spec(seed_job(&profile, &spec));
        let source = pod
            .volumes
            .iter()
            .flatten()
            .find(|volume| volume.name == "source")
            .and_then(|volume| volume.persistent_volume_claim.clone())
            .expect("the source's claim");
        assert_eq!(source.claim_name, "oab-d-source-1");
        assert_eq!(source.read_only, Some(true));
        let container = &pod.containers[0];
        let source = mount(container, SOURCE_MOUNT);
        assert_eq!((source.read_only, source.sub_path.as_deref()), (Some(true), None));
        assert_eq!(
            mount(container, PREPARE_MOUNT).sub_path,
            None,
            "the session's own volume, whole"
        );
        assert_eq!(
            env(container, "OAB_SEED_COPY_WORKSPACE").as_deref(),
            Some("/source/workspace")
        );
        assert_eq!(
            env(container, "OAB_SEED_COPY_HOME").as_deref(),
            Some("/source/home")
        );
        assert!(
            pod.init_containers.is_none(),
            "a volume of its own needs no prepare"
        );
    }

    #[test]
    fn on_a_borrowed_volume_the_seed_sees_only_its_own_and_the_sources_directories() {
        let profile = profile("[storage]\nkind = \"borrowed\"\nclaim = \"shared-work\"\n");
        let (target, source_id, anchor_uid) = (session("fork"), session("source"), "uid".to_owned());
        let copy = CopySource {
            claim: "shared-work".to_owned(),
            sub_path: Some(source_id.to_string()),
        };
        let pod = pod_spec(seed_job(
            &profile,
            &SeedSpec {
                id: &target,
                installation: "prod",
                incarnation: 1,
                anchor_uid: &anchor_uid,
                claim: "shared-work",
                clone: None,
                clone_reference: None,
                copy: Some(&copy),
                deadline: 60,
            },
        ));
        let container = &pod.containers[0];
        for mount in container
            .volume_mounts
            .iter()
            .flatten()
            .filter(|m| m.name == "session")
        {
            assert!(
                mount.sub_path.is_some(),
                "the seed container never mounts the whole shared volume: {mount:?}"
            );
        }
        assert_eq!(
            mount(container, PREPARE_MOUNT).sub_path.as_deref(),
            Some(target.as_str())
        );
        let source = mount(container, SOURCE_MOUNT);
        assert_eq!(
            (source.name.as_str(), source.sub_path.as_deref(), source.read_only),
            ("session", Some(source_id.as_str()), Some(true))
        );
        assert_eq!(
            container.command.as_ref().map(|argv| argv[4..].to_vec()),
            Some(vec!["/session/home".to_owned(), "/session/workspace".to_owned()]),
            "the script's HOME and workspace, inside the session's own directory"
        );
        // Only the relay's prepare, with paths the runtime computed, sees the whole volume.
        let prepare = pod
            .init_containers
            .as_ref()
            .and_then(|c| c.first())
            .expect("prepare");
        assert_eq!(
            prepare.command.as_ref().map(|argv| argv[1..].to_vec()),
            Some(vec![
                "prepare".to_owned(),
                format!("/session/{target}/workspace"),
                format!("/session/{target}/home"),
                format!("/session/{source_id}/workspace"),
                format!("/session/{source_id}/home"),
            ])
        );
        assert!(prepare.env.is_none(), "no caller input reaches prepare");
    }

    #[test]
    fn a_clone_names_its_transport_to_git() {
        let profile = profile("seed_hosts = [\"git://10.244.0.9\"]\n");
        let target = session("clone");
        let clone = check_clone_url("git://10.244.0.9/repo", &profile.seed_hosts).expect("allowed");
        let pod = pod_spec(seed_job(
            &profile,
            &SeedSpec {
                id: &target,
                installation: "prod",
                incarnation: 1,
                anchor_uid: "uid",
                claim: "oab-d-clone-1",
                clone: Some(&clone),
                clone_reference: Some("topic"),
                copy: None,
                deadline: 60,
            },
        ));
        let container = &pod.containers[0];
        assert_eq!(env(container, "GIT_ALLOW_PROTOCOL").as_deref(), Some("git"));
        assert_eq!(
            env(container, "OAB_SEED_GIT_URL").as_deref(),
            Some("git://10.244.0.9/repo")
        );
        assert_eq!(env(container, "OAB_SEED_GIT_REF").as_deref(), Some("topic"));
    }
}
