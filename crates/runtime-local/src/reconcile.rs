//! `reconcile` for the local runtime: the garbage collector.

use std::fs::{self, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::time::SystemTime;

use rustix::process::Signal;
use session_runtime::{ReconcileReport, Result, SessionId, SessionState, StorageState};

use crate::layout::{self, SessionDirs};
use crate::process::{self, ProcessRef};
use crate::record::{self, DirEvidence};
use crate::runtime::{LocalRuntime, WORKER_MARKER};

pub(crate) async fn run(runtime: &LocalRuntime) -> Result<ReconcileReport> {
    let mut report = ReconcileReport::default();
    let root = &runtime.settings.root;
    if std::fs::symlink_metadata(root).is_err() {
        return Ok(report); // no root, no sessions: nothing to repair, and nothing is created
    }
    // One pass at a time per root, across broker processes; the others find nothing to do.
    // Never through a link, never truncating: one planted as the lock would otherwise have this
    // create or empty a file anywhere on the host.
    let guard = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .custom_flags(record::no_follow())
        .open(root.join(".reconcile.lock"))
        .map_err(|e| crate::backend_error(true, "opening the reconcile lock", e))?;
    match guard.try_lock() {
        Ok(()) => {}
        Err(fs::TryLockError::WouldBlock) => return Ok(report),
        Err(fs::TryLockError::Error(e)) => return Err(crate::backend_error(true, "locking reconcile", e)),
    }
    for id in runtime.live_ids()? {
        if let Err(error) = runtime.reconcile_session(id, &mut report).await {
            report.errors.push(format!("session {id}: {error}"));
        }
    }
    kill_unrecorded_workers(runtime, &mut report);
    expire_retained(runtime, &mut report);
    empty_trash(runtime, &mut report);
    runtime.release_unused_uids(&mut report).await;
    Ok(report)
}

/// Workers of this installation and root that no record accounts for: their session is gone, or its record
/// names another generation, or says nothing should run.
fn kill_unrecorded_workers(runtime: &LocalRuntime, report: &mut ReconcileReport) {
    let prefix = format!("{WORKER_MARKER}={}:", runtime.scope());
    for (pid, rest) in process::with_environment_prefix(&prefix) {
        let Some((id, generation)) = rest.split_once(':') else {
            continue;
        };
        let (Ok(id), Ok(generation)) = (SessionId::parse(id), generation.parse::<u64>()) else {
            continue;
        };
        let dirs = SessionDirs::live(&runtime.settings.root, &id);
        let accounted = match record::load(&dirs.record(), &id) {
            Ok(Some(record)) => {
                record.state() == SessionState::Running
                    && record.worker.is_some_and(|w| w.generation == generation)
                    && record.generation == generation
            }
            Ok(None) => false,
            // An unreadable record proves nothing either way: leave the process alone.
            Err(_) => true,
        };
        if accounted {
            continue;
        }
        // Only the top of a worker's tree carries a fresh marker in practice, but every process
        // inheriting it is part of that worker; signal each.
        if let Some(found) = ProcessRef::of(pid) {
            let _ = process::signal_tree(found, Signal::KILL);
            report
                .killed_workers
                .push((id, format!("no record accounts for its generation {generation}")));
        }
    }
    report.killed_workers.dedup();
}

fn retained_entries(
    runtime: &LocalRuntime,
    report: &mut ReconcileReport,
) -> Vec<(SessionId, std::path::PathBuf)> {
    let dir = layout::retained_dir(&runtime.settings.root);
    if let Err(error) = layout::plain_dir(&dir) {
        report
            .errors
            .push(format!("retained storage: {error}; left alone"));
        return Vec::new();
    }
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().into_string().ok()?;
            let (id, incarnation) = name.split_once('.')?;
            incarnation.parse::<u64>().ok()?;
            Some((SessionId::parse(id).ok()?, entry.path()))
        })
        .collect()
}

fn expire_retained(runtime: &LocalRuntime, report: &mut ReconcileReport) {
    let now = SystemTime::now();
    for (id, path) in retained_entries(runtime, report) {
        let dirs = SessionDirs::at(path.clone());
        let record = match record::load(&dirs.record(), &id) {
            Ok(Some(record)) => record,
            Ok(None) => continue,
            Err(error) => {
                report.errors.push(format!("retained session {id}: {error}"));
                continue;
            }
        };
        let StorageState::Retained { until } = record.storage else {
            continue;
        };
        if !until.has_passed(now) {
            continue;
        }
        // Delete only the directory the record was created with (a rename keeps its identity).
        if DirEvidence::of(&path).ok() != Some(record.evidence) {
            report.errors.push(format!(
                "retained session {id}: directory does not match its record; left in place"
            ));
            continue;
        }
        match fs::remove_dir_all(&path) {
            Ok(()) => {
                report.expired_storage.push(id);
                // The user goes with its last storage, unless a new session of the same id has it.
                if let Err(error) = runtime.release_uid_unless_stored(&id) {
                    report
                        .errors
                        .push(format!("retained session {id}: releasing its user: {error}"));
                }
            }
            Err(error) => report
                .errors
                .push(format!("retained session {id}: deleting: {error}")),
        }
    }
}

fn empty_trash(runtime: &LocalRuntime, report: &mut ReconcileReport) {
    let trash = layout::trash_dir(&runtime.settings.root);
    if let Err(error) = layout::plain_dir(&trash) {
        report.errors.push(format!("trash: {error}; left alone"));
        return;
    }
    let Ok(entries) = fs::read_dir(trash) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some((id, _)) = name.to_str().and_then(|n| n.split_once('.')) else {
            continue;
        };
        if SessionId::parse(id).is_err() {
            continue;
        }
        if let Err(error) = fs::remove_dir_all(entry.path()) {
            report
                .errors
                .push(format!("trash {}: {error}", entry.path().display()));
        }
    }
}
