//! Seeding a new session's volume at create: the profile's HOME template and a git clone into
//! the workspace, done by a short-lived Job `oab-p-<session id>-<incarnation>` with the worker's
//! image, identity and restrictions.
//!
//! The Job mounts only this session's directories of the volume (and the template, read-only),
//! holds no service-account token, and ends within the start timeout. Its container runs the
//! image's `sh` with a fixed script; the clone URL and reference reach it as environment
//! variables, never as script text. A Secret used as HOME template is mounted by the kubelet:
//! its values never pass through the broker.

use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{
    ConfigMapVolumeSource, Container, EmptyDirVolumeSource, PersistentVolumeClaimVolumeSource, Pod, PodSpec,
    PodTemplateSpec, SecretVolumeSource, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use session_runtime::SessionId;

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{DeleteParams, ListParams, PostParams, Preconditions};
use kube::ResourceExt;
use session_runtime::{Error, Result};

use crate::api::{api_error, is_status};
use crate::names;
use crate::pod::{
    owned_by_anchor, plain_env, restricted_container, restricted_pod, session_dirs, PREPARE_MOUNT,
};
use crate::profile::{HomeTemplate, WorkerProfile};
use crate::record::SeedRecord;
use crate::record::SessionRecord;
use crate::{KubernetesRuntime, RUNTIME};

/// Where the Job mounts the HOME template.
const TEMPLATE_MOUNT: &str = "/template";

/// Copies the template's keys (ConfigMap and Secret volumes hold each key as a symlink into a
/// hidden `..data` directory, so the copy follows links and skips names starting with `..`),
/// then clones into an emptied workspace. `$1` is the session's HOME directory, `$2` its
/// workspace directory.
const SCRIPT: &str = r#"set -eu
home="$1"
work="$2"
mkdir -p "$home"
if [ -d /template ]; then
  for entry in /template/* /template/.[!.]*; do
    [ -e "$entry" ] || continue
    cp -L "$entry" "$home/"
  done
fi
if [ -n "${OAB_SEED_GIT_URL:-}" ]; then
  rm -rf "$work"
  if [ -n "${OAB_SEED_GIT_REF:-}" ]; then
    git clone --quiet --branch "$OAB_SEED_GIT_REF" -- "$OAB_SEED_GIT_URL" "$work"
  else
    git clone --quiet -- "$OAB_SEED_GIT_URL" "$work"
  fi
fi
mkdir -p "$work"
"#;

/// What one seed Job is made of besides the profile.
#[derive(Debug)]
pub(crate) struct SeedSpec<'a> {
    pub(crate) id: &'a SessionId,
    pub(crate) installation: &'a str,
    pub(crate) incarnation: u64,
    pub(crate) anchor_uid: &'a str,
    pub(crate) claim: &'a str,
    pub(crate) seed: Option<&'a SeedRecord>,
    /// The Job's deadline, in seconds.
    pub(crate) deadline: i64,
}

pub(crate) fn seed_job(profile: &WorkerProfile, spec: &SeedSpec<'_>) -> Job {
    let name = names::seed(spec.id, spec.incarnation);
    let mut metadata = names::meta(name, spec.installation, spec.id, "seed");
    metadata.owner_references = Some(vec![owned_by_anchor(spec.id, spec.anchor_uid)]);
    let (workspace_dir, home_dir) = session_dirs(profile, spec.id);

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
    // The whole volume, as for the worker's init container: a subPath the kubelet has to make
    // would be root's, and the session's directories may not exist yet. The script touches only
    // the session's own.
    let mut mounts = vec![
        VolumeMount {
            name: "session".to_owned(),
            mount_path: PREPARE_MOUNT.to_owned(),
            ..VolumeMount::default()
        },
        VolumeMount {
            name: "tmp".to_owned(),
            mount_path: "/tmp".to_owned(),
            ..VolumeMount::default()
        },
    ];
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
    if let Some(seed) = spec.seed {
        env.push(plain_env("OAB_SEED_GIT_URL", seed.git_url.clone()));
        if let Some(reference) = &seed.git_reference {
            env.push(plain_env("OAB_SEED_GIT_REF", reference.clone()));
        }
    }
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
                    containers: vec![container],
                    volumes: Some(volumes),
                    restart_policy: Some("Never".to_owned()),
                    service_account_name: Some("oab-worker".to_owned()),
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
    /// Seeds the session's volume (the profile's HOME template, the recorded clone) with a Job,
    /// and waits for it. A Job an earlier, interrupted attempt left is adopted while it runs and
    /// replaced if it failed.
    ///
    /// # Errors
    /// [`Error::Backend`]: not retryable when the seed failed (the Pod's words: git's message, a
    /// missing image or template), retryable when it did not end within the start timeout or
    /// the API failed.
    pub(crate) async fn seed(
        &self,
        id: &SessionId,
        anchor: &Lease,
        record: &SessionRecord,
        profile: &WorkerProfile,
    ) -> Result<()> {
        let Some(claim) = record.volume.claim() else {
            return Err(Error::Unsupported {
                runtime: RUNTIME,
                operation: "a workspace seed with the profile's ephemeral storage (the seed would not outlive its Job)",
            });
        };
        let jobs = self.jobs().await?;
        let name = names::seed(id, record.incarnation);
        let timeout = self.start_timeout();
        let spec = SeedSpec {
            id,
            installation: self.installation(),
            incarnation: record.incarnation,
            anchor_uid: &anchor.uid().unwrap_or_default(),
            claim,
            seed: record.seed.as_ref(),
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
