//! Kubernetes Events on a session's anchor at each transition, so `kubectl describe oabsession
//! oab-s-<id>` (and `kubectl get events`) tells an operator what happened to a session in
//! Kubernetes' own terms.
//!
//! Events are a report, never part of an operation: each is published on a task of its own, and
//! a failure to publish (a Role without `events.k8s.io` `create`, an API server that refuses) is
//! logged, never returned. They are bounded twice: kube's [`Recorder`] folds a repeat of the same
//! reason on the same session within six minutes into one Event's series (one patch, not a new
//! object), and a token bucket of [`BURST`] events refilled at [`PER_SECOND`] drops what a crash
//! loop or a mass close would publish beyond it (counted in [`DROPPED`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Client, Resource};
use parking_lot::Mutex;
use session_runtime::{CloseReason, Error, Retention, SessionId, SuspendReason};

use crate::anchor::OabSession;
use crate::names;

/// The reporting controller's name on every Event.
pub(crate) const REPORTER: &str = "openab.dev/session-runtime";
/// Events a runtime may publish at once.
const BURST: f64 = 50.0;
/// Events a runtime may publish a second, over time.
const PER_SECOND: f64 = 5.0;
/// Events dropped over the rate bound (a counter of the `metrics` facade).
pub(crate) const DROPPED: &str = "openab_events_dropped_total";

/// A transition of a session.
#[derive(Debug, Clone)]
pub(crate) enum SessionEvent {
    /// `create` made the session.
    Created,
    /// A worker serves: its generation, and how it started.
    WorkerStarted { generation: u64, start: &'static str },
    /// An attach could not start a worker.
    StartFailed { cause: &'static str, message: String },
    /// A running worker was taken over from an older broker (after a restart).
    Adopted { generation: u64, epoch: u64 },
    /// An attach lost to a newer generation (another broker).
    Fenced { generation: u64, by: u64 },
    /// The session was suspended.
    Suspended { reason: SuspendReason },
    /// The session was closed, with the retention its storage got (`retain`, `delete`), or
    /// `None` when it had no volume of its own (ephemeral or borrowed storage).
    Closed {
        reason: CloseReason,
        retention: Option<Retention>,
    },
}

impl SessionEvent {
    /// The Event. Its action tells apart what kube's [`Recorder`] would otherwise fold into one
    /// series (it keys on type, reason and action, not the note): a resume is not a repeat of a
    /// first start, nor one start failure's cause of another's.
    fn event(&self) -> Event {
        let (type_, reason, action, note) = match self {
            SessionEvent::Created => (
                EventType::Normal,
                "Created",
                "Create".to_owned(),
                "session created".to_owned(),
            ),
            SessionEvent::WorkerStarted { generation, start } => (
                EventType::Normal,
                "WorkerStarted",
                format!("Attach:{start}"),
                format!("worker of generation {generation} serves ({start})"),
            ),
            SessionEvent::StartFailed { cause, message } => (
                EventType::Warning,
                "StartFailed",
                format!("Attach:{cause}"),
                format!("{cause}: {message}"),
            ),
            SessionEvent::Adopted { generation, epoch } => (
                EventType::Normal,
                "Adopted",
                "Attach:takeover".to_owned(),
                format!("running worker of generation {generation} taken over by broker epoch {epoch}"),
            ),
            SessionEvent::Fenced { generation, by } => (
                EventType::Warning,
                "Fenced",
                "Attach".to_owned(),
                format!("generation {generation} lost to generation {by} (another broker attached)"),
            ),
            SessionEvent::Suspended { reason } => (
                EventType::Normal,
                "Suspended",
                format!("Suspend:{reason}"),
                format!("suspended ({reason}); storage kept"),
            ),
            SessionEvent::Closed { reason, retention } => (
                EventType::Normal,
                "Closed",
                format!("Close:{reason}"),
                match retention {
                    Some(Retention::Retain) => format!("closed ({reason}); its volume is retained"),
                    Some(_) => format!("closed ({reason}); its volume is deleted"),
                    None => format!("closed ({reason}); it had no volume of its own"),
                },
            ),
        };
        // An Event's note is at most 1 kB.
        let mut note = note;
        if note.len() > 1000 {
            let mut end = 1000;
            while !note.is_char_boundary(end) {
                end -= 1;
            }
            note.truncate(end);
        }
        Event {
            type_,
            reason: reason.to_owned(),
            note: Some(note),
            action,
            secondary: None,
        }
    }
}

/// A token bucket.
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// Publishes a runtime's session Events.
#[derive(Clone)]
pub(crate) struct SessionEvents {
    recorder: Recorder,
    namespace: String,
    bucket: Arc<Mutex<Bucket>>,
    /// The anchors' UIDs as last read: `kubectl describe` finds an object's Events by its UID.
    anchor_uids: Arc<Mutex<HashMap<SessionId, String>>>,
}

impl std::fmt::Debug for SessionEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionEvents")
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

impl SessionEvents {
    /// Events in `namespace` through `client`, reported by `instance` (the broker's or the
    /// controller's name).
    pub(crate) fn new(client: Client, namespace: &str, instance: String) -> Self {
        let reporter = Reporter {
            controller: REPORTER.to_owned(),
            instance: Some(instance),
        };
        SessionEvents {
            recorder: Recorder::new(client, reporter),
            namespace: namespace.to_owned(),
            bucket: Arc::new(Mutex::new(Bucket {
                tokens: BURST,
                at: Instant::now(),
            })),
            anchor_uids: Arc::default(),
        }
    }

    /// Notes the UID of session `id`'s anchor, for the Events published on it from now on.
    pub(crate) fn learn_anchor(&self, id: &SessionId, uid: Option<String>) {
        if let Some(uid) = uid {
            self.anchor_uids.lock().insert(*id, uid);
        }
    }

    /// Publishes `event` on session `id`'s anchor, in the background, if the rate bound allows.
    pub(crate) fn publish(&self, id: &SessionId, event: SessionEvent) {
        if !self.take() {
            metrics::counter!(DROPPED).increment(1);
            tracing::debug!(session = %id, ?event, "event dropped over the rate bound");
            return;
        }
        let reference = ObjectReference {
            api_version: Some(OabSession::api_version(&()).into_owned()),
            kind: Some(OabSession::kind(&()).into_owned()),
            name: Some(names::anchor(id)),
            namespace: Some(self.namespace.clone()),
            uid: self.anchor_uids.lock().get(id).cloned(),
            ..ObjectReference::default()
        };
        let recorder = self.recorder.clone();
        let id = *id;
        tokio::spawn(async move {
            if let Err(error) = recorder.publish(&event.event(), &reference).await {
                tracing::debug!(session = %id, "publishing an event failed: {error}");
            }
        });
    }

    /// Publishes why an attach of `id` failed: a fence, or a start failure.
    pub(crate) fn attach_failed(&self, id: &SessionId, generation: u64, error: &Error) {
        let event = match error {
            Error::Fenced { current, .. } => SessionEvent::Fenced {
                generation,
                by: *current,
            },
            _ => SessionEvent::StartFailed {
                cause: error.cause_label(),
                message: error.to_string(),
            },
        };
        self.publish(id, event);
    }

    fn take(&self) -> bool {
        self.bucket.lock().take(Instant::now())
    }
}

impl Bucket {
    /// Takes a token at `now`, if one is left after the refill since the last take.
    fn take(&mut self, now: Instant) -> bool {
        let refill = now.saturating_duration_since(self.at).as_secs_f64() * PER_SECOND;
        self.tokens = (self.tokens + refill).min(BURST);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_is_bounded_and_the_rate_refills() {
        let start = Instant::now();
        let mut bucket = Bucket {
            tokens: BURST,
            at: start,
        };
        let burst = (0..1000).take_while(|_| bucket.take(start)).count();
        assert_eq!(burst, BURST as usize);
        assert!(!bucket.take(start));
        let later = start + std::time::Duration::from_secs(2);
        let refilled = (0..1000).take_while(|_| bucket.take(later)).count();
        assert_eq!(refilled, (2.0 * PER_SECOND) as usize);
    }

    #[test]
    fn each_transition_has_its_reason_and_a_bounded_note() {
        let cases = [
            (SessionEvent::Created, "Created", EventType::Normal),
            (
                SessionEvent::StartFailed {
                    cause: "image_pull",
                    message: "x".repeat(5000),
                },
                "StartFailed",
                EventType::Warning,
            ),
            (
                SessionEvent::Closed {
                    reason: CloseReason::Ended,
                    retention: Some(Retention::Delete),
                },
                "Closed",
                EventType::Normal,
            ),
            (
                SessionEvent::Fenced { generation: 3, by: 4 },
                "Fenced",
                EventType::Warning,
            ),
        ];
        for (transition, reason, type_) in cases {
            let event = transition.event();
            assert_eq!((event.reason.as_str(), event.type_), (reason, type_));
            assert!(event.note.as_ref().is_some_and(|note| note.len() <= 1000));
        }
        let closed = SessionEvent::Closed {
            reason: CloseReason::Ended,
            retention: Some(Retention::Retain),
        };
        assert_eq!(
            closed.event().note.as_deref(),
            Some("closed (ended); its volume is retained")
        );
    }
}
