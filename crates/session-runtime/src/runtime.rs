//! The [`SessionRuntime`] trait: one lifecycle for every place a session's agent can run.

use std::fmt;

use async_trait::async_trait;

use crate::{
    Attachment, Capabilities, CloseReason, CreateOptions, ReconcileReport, Result, SessionHandle, SessionId,
    SessionIdentity, SessionStatus, SuspendReason,
};

/// Where one chat thread's agent runs, and how its life is managed.
///
/// Held as `Arc<dyn SessionRuntime>` by the broker; one instance serves every session of one
/// installation.
///
/// # Lifecycle
///
/// 1. [`create`](Self::create) provisions everything session-exclusive (storage for workspace, HOME
///    and agent state, and the durable session record) before any agent process exists, so the
///    isolation boundary is in place before the first prompt.
/// 2. [`attach`](Self::attach) makes sure exactly one worker runs for the session's current
///    generation and returns the stream to it. The broker speaks ACP over it, sending the
///    attachment's [`working_dir`](crate::Attachment::working_dir) as `cwd` in `session/new`.
/// 3. [`suspend`](Self::suspend) releases compute and keeps storage; the next `attach` resumes
///    with a higher generation.
/// 4. [`close`](Self::close) stops compute and applies the retention policy for its reason.
/// 5. [`reconcile`](Self::reconcile) is the garbage collector: it makes what runs match the
///    records, finishes interrupted closes, suspends idle sessions and expires retained storage.
///
/// # Guarantees
///
/// - For one session, at most one worker is attached and writing at any time, under concurrent
///   attaches, retries and broker restarts (generation fencing).
/// - Every operation is idempotent and safe to call concurrently with any other.
/// - A [`SessionId`] is the only thing about a session that appears in paths, object names, labels
///   and logs; the raw thread id never does.
/// - Storage is deleted only when the runtime can prove it created it; borrowed storage never is.
/// - Failures are [`Error`](crate::Error) kinds; an unsupported operation is
///   [`Error::Unsupported`](crate::Error::Unsupported), never a silent no-op.
#[async_trait]
pub trait SessionRuntime: fmt::Debug + Send + Sync + 'static {
    /// A short lower-case name for logs and errors, e.g. `local`.
    fn name(&self) -> &'static str;

    /// What this runtime provides. Constant for the life of the instance.
    fn capabilities(&self) -> Capabilities;

    /// Provisions a session: storage for workspace, HOME and agent state, and its durable record.
    /// No agent process is started.
    ///
    /// # Errors
    /// - [`InvalidIdentity`](crate::Error::InvalidIdentity) if the identity names another installation.
    /// - [`StorageInUse`](crate::Error::StorageInUse) if another process holds the session's record,
    ///   or a [`WorkspaceSeed::CopyOf`](crate::WorkspaceSeed::CopyOf) source has a worker or is held.
    /// - [`NotFound`](crate::Error::NotFound) or [`InvalidState`](crate::Error::InvalidState) if a
    ///   copy's source does not exist or is closed.
    /// - [`Unsupported`](crate::Error::Unsupported) for a seed the backend cannot apply, or an
    ///   [`overlay`](CreateOptions::overlay) field it cannot apply (the error names the field).
    /// - [`InvalidOverlay`](crate::Error::InvalidOverlay) naming the field for an overlay the
    ///   backend refuses (see [`SessionOverlay`](crate::SessionOverlay)); nothing is created or
    ///   changed.
    /// - [`Backend`](crate::Error::Backend) if provisioning failed; nothing half-made is left that
    ///   a retry or `reconcile` cannot finish.
    ///
    /// # Idempotency
    /// For an existing session (any state but closed) it returns that session with
    /// [`SessionHandle::created`] `false`, and `options` are ignored but for an
    /// [`overlay`](CreateOptions::overlay), which replaces the session's for its next attach (the
    /// running worker, if any, keeps the one it was started with); the same overlay again changes
    /// nothing. For a closed session it starts a
    /// new one under the same id with fresh storage: storage retained by the close is never handed
    /// to the new session.
    ///
    /// # Cancellation
    /// Dropping the future may leave a partly provisioned session; the next `create` for the same
    /// identity completes it. Replacing an existing session's overlay is one atomic record write:
    /// dropped, it either happened or did not, and repeating the call settles it.
    async fn create(&self, identity: &SessionIdentity, options: &CreateOptions) -> Result<SessionHandle>;

    /// Returns the stream to the session's worker, starting one if none runs for the current
    /// generation, with the session's [`SessionOverlay`](crate::SessionOverlay) (its working
    /// directory, reported by the attachment, and its environment).
    ///
    /// A new attach fences every previous attachment of the session: their streams end with
    /// [`Fenced`](crate::Error::Fenced). Unless the runtime declares
    /// [`replay_on_reattach`](Capabilities::replay_on_reattach), re-attaching to a running session
    /// replaces its worker with one of a new generation (the broker then uses `session/load`).
    ///
    /// # Errors
    /// - [`NotFound`](crate::Error::NotFound) for a session that was never created.
    /// - [`InvalidState`](crate::Error::InvalidState) for a closing or closed session.
    /// - [`WorkerFailed`](crate::Error::WorkerFailed) with a classified cause if the worker could
    ///   not be started.
    /// - [`Fenced`](crate::Error::Fenced) if a concurrent attach won the race while this one was
    ///   starting its worker.
    /// - [`StorageInUse`](crate::Error::StorageInUse) if another broker process runs the session's
    ///   worker.
    /// - [`StorageLost`](crate::Error::StorageLost) if the session's storage went away without its
    ///   runtime (where the backend can tell); the session can only be closed.
    /// - [`InvalidOverlay`](crate::Error::InvalidOverlay) naming the working directory if it can no
    ///   longer be used (something else or a symbolic link is there now, or the operator no longer
    ///   allows it); no worker is started.
    /// - [`Backend`](crate::Error::Backend): retryable for a session whose `create` has not
    ///   finished (calling `create` again finishes it); not retryable for a session record that
    ///   cannot be read.
    ///
    /// # Idempotency
    /// Each successful call yields the one live attachment; calling it again replaces that
    /// attachment, never adds a second worker.
    ///
    /// # Cancellation
    /// If dropped after the generation was incremented, the worker it may have started is fenced
    /// by the next `attach` and reclaimed by `reconcile`; the Kubernetes runtime undoes it itself
    /// (its Pod deleted, the session back in the state it had) as it does for a failed attach.
    async fn attach(&self, id: &SessionId) -> Result<Attachment>;

    /// Releases the session's compute and keeps storage, identity and record.
    ///
    /// [`SuspendReason::Hung`] kills without grace; the others let the agent stop within the
    /// configured grace period. The current attachment is fenced.
    ///
    /// # Errors
    /// - [`NotFound`](crate::Error::NotFound) for an unknown session.
    /// - [`InvalidState`](crate::Error::InvalidState) for a closing or closed session.
    /// - [`StorageInUse`](crate::Error::StorageInUse) if another broker process runs the session's
    ///   worker.
    /// - [`Backend`](crate::Error::Backend) if the session's record cannot be read or written.
    ///
    /// # Idempotency
    /// Suspending a suspended or never-attached session returns `Ok(())`.
    ///
    /// # Cancellation
    /// The suspend is recorded before the worker is stopped; if dropped in between, `reconcile`
    /// stops the worker.
    async fn suspend(&self, id: &SessionId, reason: SuspendReason) -> Result<()>;

    /// Ends the session: stops compute now, then deletes or retains storage per the retention
    /// policy for `reason`.
    ///
    /// # Errors
    /// - [`StorageInUse`](crate::Error::StorageInUse) if another broker process runs the session's
    ///   worker: nothing was changed; retry once that broker has let it go.
    /// - [`Backend`](crate::Error::Backend) if stopping or deleting failed; the close is recorded
    ///   and a retry or `reconcile` finishes it. Not retryable for a session record that cannot be
    ///   read, whose storage is left in place.
    ///
    /// # Idempotency
    /// Closing a closed session, or one that never existed, returns `Ok(())` and changes nothing
    /// (the first reason wins).
    ///
    /// # Cancellation
    /// The intent is recorded durably before any side effect, so a dropped call is finished by the
    /// next `close` or `reconcile`.
    async fn close(&self, id: &SessionId, reason: CloseReason) -> Result<()>;

    /// The session's current state, generation, worker and storage.
    ///
    /// # Errors
    /// [`NotFound`](crate::Error::NotFound) for a session with no record (never created, or closed
    /// and forgotten).
    ///
    /// # Idempotency
    /// Read-only.
    ///
    /// # Cancellation
    /// Safe to drop at any point.
    async fn status(&self, id: &SessionId) -> Result<SessionStatus>;

    /// Every session of this installation that has a record, in no particular order.
    ///
    /// # Errors
    /// [`Backend`](crate::Error::Backend) if the records cannot be read. Records that cannot be
    /// parsed are skipped and logged, never fatal.
    ///
    /// # Idempotency
    /// Read-only.
    ///
    /// # Cancellation
    /// Safe to drop at any point.
    async fn list(&self) -> Result<Vec<SessionStatus>>;

    /// Makes what runs match the records: kills workers that no record says should run, finishes
    /// interrupted closes, suspends workers idle past the TTL and deletes retained storage whose
    /// retention ran out.
    ///
    /// # Errors
    /// [`Backend`](crate::Error::Backend) only if the records cannot be read at all; problems with
    /// single sessions are reported in [`ReconcileReport::errors`] and retried by the next pass.
    ///
    /// # Idempotency
    /// A second pass right after a first one finds nothing to do.
    ///
    /// # Cancellation
    /// Every step is individually durable; a dropped pass is continued by the next one.
    async fn reconcile(&self) -> Result<ReconcileReport>;
}

/// `Arc<dyn SessionRuntime>`, the form the broker holds.
pub type DynSessionRuntime = dyn SessionRuntime;

// Compile-time checks: the trait is object safe, its objects can be shared between threads, and
// its futures are `Send` (so a broker can `tokio::spawn` them).
const _: () = {
    fn assert_send_sync<T: Send + Sync + ?Sized>() {}
    fn assert_send<T: Send>(_: &T) {}
    #[allow(dead_code)]
    fn checks(
        runtime: &dyn SessionRuntime,
        id: &SessionId,
        identity: &SessionIdentity,
        options: &CreateOptions,
    ) {
        assert_send_sync::<dyn SessionRuntime>();
        assert_send_sync::<std::sync::Arc<dyn SessionRuntime>>();
        assert_send(&runtime.create(identity, options));
        assert_send(&runtime.attach(id));
        assert_send(&runtime.suspend(id, SuspendReason::Idle));
        assert_send(&runtime.close(id, CloseReason::Reset));
        assert_send(&runtime.status(id));
        assert_send(&runtime.list());
        assert_send(&runtime.reconcile());
    }
};
