//! An attach that did not end with a serving worker undoes what it started: the session goes
//! back to the state it had, with the failure on its record, and the worker Pod of that
//! generation is deleted (that exact Pod: UID precondition).
//!
//! The same steps run whatever stopped the attach: a start timeout, an unschedulable Pod, an API
//! error, or a caller that dropped the call ([`AttachInFlight`] runs them from its `Drop`). When
//! they cannot run (the API server is down, the broker was killed), `reconcile` finds the
//! generation never served and runs them (see [`abandoned_before`]).
//!
//! The record is written first: a `Running` record is what makes every other part of the runtime
//! keep a worker, so once it says otherwise a Pod left behind by a failed delete is removed by the
//! next `reconcile` pass like any worker of a session that is not running.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, Preconditions};
use kube::{Api, ResourceExt};
use session_runtime::{Generation, Result, SessionId, SessionState, SuspendReason};

use crate::anchor::OabSession;
use crate::api::{api_error, is_status};
use crate::names;
use crate::record::{now, FailedStart, Phase, SessionRecord};
use crate::runtime::{swap_anchor, Swap, CAS_ATTEMPTS, KILL_GRACE};

/// The longest an attach spends after its worker is ready: connecting to the relay and its
/// handshake. With the start timeout, it bounds how long a generation may go without serving
/// before `reconcile` takes it for abandoned.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// What the session was before an attach made it `Running`, so a failed attach can put it back.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Before {
    pub(crate) state: SessionState,
    pub(crate) suspend_reason: Option<SuspendReason>,
}

/// An attach between its generation's compare-and-swap and a serving worker. Dropped while
/// armed (the caller cancelled the attach), it undoes the attach on a task of its own.
pub(crate) struct AttachInFlight {
    anchors: Api<OabSession>,
    pods: Api<Pod>,
    id: SessionId,
    generation: Generation,
    before: Before,
    armed: bool,
}

impl AttachInFlight {
    pub(crate) fn new(
        anchors: Api<OabSession>,
        pods: Api<Pod>,
        id: SessionId,
        generation: Generation,
        before: Before,
    ) -> Self {
        AttachInFlight {
            anchors,
            pods,
            id,
            generation,
            before,
            armed: true,
        }
    }

    /// Nothing to undo: the attach served, or a newer generation owns what it started (and
    /// deletes its Pod).
    pub(crate) fn release(mut self) {
        self.armed = false;
    }

    /// The attach failed with `error`: undo it now. A failure to undo is logged, never returned
    /// over `error`: `reconcile` finishes it.
    pub(crate) async fn failed(mut self, error: &session_runtime::Error) {
        self.armed = false;
        let undone = undo(
            &self.anchors,
            &self.pods,
            &self.id,
            self.generation,
            Some(self.before),
            &error.to_string(),
        )
        .await;
        if let Err(undo) = undone {
            tracing::warn!(session = %self.id, generation = self.generation, "undoing a failed attach (reconcile finishes it): {undo}");
        }
    }
}

impl Drop for AttachInFlight {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (anchors, pods, id, generation, before) = (
            self.anchors.clone(),
            self.pods.clone(),
            self.id,
            self.generation,
            self.before,
        );
        handle.spawn(async move {
            let why = "the attach was cancelled before its worker served";
            if let Err(error) = undo(&anchors, &pods, &id, generation, Some(before), why).await {
                tracing::warn!(session = %id, generation, "undoing a cancelled attach (reconcile finishes it): {error}");
            }
        });
    }
}

/// Puts the session back to `before` (or `Suspended` when unknown) if `generation` is still its
/// current one and it is `Running`, recording `why` as its last start failure; then deletes the
/// worker Pod of `generation`, if it is there.
///
/// # Errors
/// [`Backend`](session_runtime::Error::Backend) if the API server could not be read or written.
///
/// # Idempotency
/// A second call finds the record already changed and the Pod gone, and changes nothing. A newer
/// generation, or a session someone suspended or closed meanwhile, is left alone.
pub(crate) async fn undo(
    anchors: &Api<OabSession>,
    pods: &Api<Pod>,
    id: &SessionId,
    generation: Generation,
    before: Option<Before>,
    why: &str,
) -> Result<()> {
    let anchor = names::anchor(id);
    // Its worker's name as the record gives it (a claimed pool member has its own).
    let mut name = names::worker(id);
    for _ in 0..CAS_ATTEMPTS {
        let Some(anchor) = anchors
            .get_opt(&anchor)
            .await
            .map_err(|e| api_error(&format!("reading session {id}"), e))?
        else {
            break;
        };
        if !names::belongs_to(&anchor.metadata, id) {
            break;
        }
        let Some(record) = anchor.record(id)? else {
            break;
        };
        if record.generation == generation {
            name = record.worker_pod();
        }
        if record.generation != generation || record.state() != SessionState::Running {
            break;
        }
        let mut next = record.clone();
        let before = before.unwrap_or(Before {
            state: SessionState::Suspended,
            suspend_reason: None,
        });
        next.phase = Phase::Session(before.state);
        next.suspend_reason = before.suspend_reason;
        next.worker = None;
        next.last_start_failure = Some(FailedStart {
            at: now(),
            generation,
            error: why.to_owned(),
        });
        match swap_anchor(anchors, &anchor, &next).await {
            Ok(_) => break,
            Err(Swap::Lost) => continue,
            Err(Swap::Failed(error)) => return Err(error),
        }
    }
    let Some(pod) = pods
        .get_opt(&name)
        .await
        .map_err(|e| api_error(&format!("reading worker {name}"), e))?
    else {
        return Ok(());
    };
    if !names::belongs_to(&pod.metadata, id)
        || names::pod_generation(&pod.metadata) != Some(generation)
        || pod.metadata.deletion_timestamp.is_some()
    {
        return Ok(());
    }
    let params = DeleteParams {
        grace_period_seconds: Some(KILL_GRACE),
        preconditions: Some(Preconditions {
            uid: pod.uid(),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match pods.delete(&name, &params).await {
        Ok(_) => Ok(()),
        Err(error) if is_status(&error, 404) || is_status(&error, 409) => Ok(()),
        Err(error) => Err(api_error(&format!("deleting worker {name}"), error)),
    }
}

/// Whether the running `record`'s current generation is an attach that never served and can no
/// longer: its worker has not been confirmed by a connected broker (`pod_uid` is set when one
/// connects), and it was started longer ago than an attach may take (`start_timeout`, the
/// connect bound, and `grace` for clocks and slow API calls).
pub(crate) fn abandoned_before(record: &SessionRecord, start_timeout: Duration, grace: Duration) -> bool {
    let Some(worker) = record.worker.as_ref() else {
        return false;
    };
    let bound = start_timeout + CONNECT_TIMEOUT + grace;
    record.state() == SessionState::Running
        && worker.generation == record.generation
        && worker.pod_uid.is_none()
        && now().saturating_sub(worker.started_at) > bound.as_secs()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::WorkerRecord;
    use session_runtime::SessionIdentity;

    fn running(started_ago: u64, pod_uid: Option<&str>) -> SessionRecord {
        let id = SessionIdentity::new("prod", "agent", "test", "t")
            .expect("identity")
            .id();
        let mut record = SessionRecord::new(id, "digest".to_owned(), 4, 1);
        record.phase = Phase::Session(SessionState::Running);
        record.worker = Some(WorkerRecord {
            generation: 4,
            pod_uid: pod_uid.map(str::to_owned),
            started_at: now() - started_ago,
            holder_epoch: None,
            pod: None,
        });
        record
    }

    #[test]
    fn only_an_unconfirmed_generation_past_every_bound_is_abandoned() {
        let timeout = Duration::from_secs(10);
        let bound = 10 + CONNECT_TIMEOUT.as_secs();
        assert!(abandoned_before(
            &running(bound + 5, None),
            timeout,
            Duration::ZERO
        ));
        assert!(
            !abandoned_before(&running(bound - 5, None), timeout, Duration::ZERO),
            "an attach may still be starting"
        );
        assert!(
            !abandoned_before(&running(bound + 5, None), timeout, Duration::from_secs(60)),
            "within the grace"
        );
        assert!(
            !abandoned_before(&running(bound + 5, Some("uid")), timeout, Duration::ZERO),
            "a broker connected to it"
        );
        let mut suspended = running(bound + 5, None);
        suspended.phase = Phase::Session(SessionState::Suspended);
        assert!(!abandoned_before(&suspended, timeout, Duration::ZERO));
    }
}
