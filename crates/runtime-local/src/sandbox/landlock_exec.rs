//! Landlock mode: finding the `oab-landlock-exec` helper and writing its command line.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use parking_lot::Mutex;
use session_runtime::config::ReadonlyMount;
use session_runtime::Error;

use super::host::{self, HostLayout};
use super::landlock_rules::{self, Rules};
use super::LaunchSpec;

/// The helper's file name.
pub(crate) const HELPER_NAME: &str = "oab-landlock-exec";

/// The environment variable that names the helper explicitly.
pub(crate) const HELPER_ENV: &str = "OAB_LANDLOCK_EXEC";

/// Device files the agent may read and write.
const DEVICES: [&str; 5] = [
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
];

/// Results of helper probes, per path: run once per process.
static PROBES: OnceLock<Mutex<HashMap<PathBuf, Result<(), String>>>> = OnceLock::new();

/// Where the helper is: `explicit`, else as [`host::locate_helper`] finds it.
fn locate(explicit: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(path) = explicit {
        return Ok(path.to_path_buf());
    }
    host::locate_helper(HELPER_NAME, HELPER_ENV)
}

/// A helper that works here: found, and able to restrict itself (so the kernel enforces Landlock).
///
/// # Errors
///
/// Why not, in a few words.
pub(super) fn find_working(explicit: Option<&Path>) -> Result<PathBuf, String> {
    if landlock_rules::kernel_abi().is_none() {
        return Err(
            "this kernel does not enforce landlock (it needs Linux 5.13 or later with `landlock` \
                    in the `lsm=` boot parameter)"
                .to_owned(),
        );
    }
    located_and_probed(explicit, &PROBES, &["--probe"])
}

/// Results of probes of the helper's `--scopes-only` mode, per path: run once per process.
static SCOPE_PROBES: OnceLock<Mutex<HashMap<PathBuf, Result<(), String>>>> = OnceLock::new();

/// A helper that can confine a bubblewrap session to Landlock's scopes (`--scopes-only`): the
/// kernel enforces them (Linux 6.12 and later), and the helper is found (`explicit`, else as
/// [`host::locate_helper`] finds it) and applies them.
///
/// # Errors
///
/// Why not, in a few words.
pub(super) fn find_scoping(explicit: Option<&Path>) -> Result<PathBuf, String> {
    if !landlock_rules::kernel_scopes() {
        return Err(
            "this kernel does not enforce landlock's scopes of abstract sockets and signals \
                    (Linux 6.12 or later with `landlock` in the `lsm=` boot parameter)"
                .to_owned(),
        );
    }
    located_and_probed(explicit, &SCOPE_PROBES, &["--scopes-only", "--", "true"])
}

/// The helper (`explicit`, else as [`host::locate_helper`] finds it), if it is an executable
/// file and `probe_args` run by it succeed; each path is probed once per process (`probes`).
fn located_and_probed(
    explicit: Option<&Path>,
    probes: &OnceLock<Mutex<HashMap<PathBuf, Result<(), String>>>>,
    probe_args: &[&str],
) -> Result<PathBuf, String> {
    let helper = locate(explicit)?;
    if !host::is_executable(&helper) {
        return Err(format!(
            "the landlock helper {} is not an executable file",
            helper.display()
        ));
    }
    let probes = probes.get_or_init(Mutex::default);
    if let Some(result) = probes.lock().get(&helper) {
        return result.clone().map(|()| helper);
    }
    let result = host::probe(&helper, probe_args.iter().copied());
    probes.lock().insert(helper.clone(), result.clone());
    result.map(|()| helper)
}

/// The helper's arguments that run `spec` restricted to its own storage, read-only system paths
/// and read-only inputs, as the session's uid.
///
/// # Errors
///
/// [`Error::Backend`] (not retryable) if the broker is root but the session has no uid (the agent
/// would run as root, which Landlock alone does not contain), or the session has a uid the broker
/// cannot switch to.
pub(super) fn helper_args(
    layout: &HostLayout,
    readonly: &[ReadonlyMount],
    spec: &LaunchSpec<'_>,
) -> Result<Vec<OsString>, Error> {
    match spec.uid {
        Some(uid) if !layout.root => return Err(super::cannot_switch(spec.id, uid)),
        None if layout.root => {
            return Err(Error::Backend {
                runtime: crate::RUNTIME,
                retryable: false,
                message: format!(
                    "session {} has no uid of its own, and landlock will not run an agent as root",
                    spec.id
                ),
                source: None,
            })
        }
        _ => {}
    }
    Ok(rules(layout, readonly, spec).to_args(
        spec.program.as_ref(),
        &spec.args.iter().map(OsString::from).collect::<Vec<_>>(),
    ))
}

/// The rules for `spec`.
pub(crate) fn rules(layout: &HostLayout, readonly: &[ReadonlyMount], spec: &LaunchSpec<'_>) -> Rules {
    // A link (`/bin -> usr/bin`) grants what it points to: Landlock rules follow links.
    let mut read: Vec<PathBuf> = layout
        .system
        .iter()
        .map(|entry| entry.path().to_path_buf())
        .collect();
    read.push(PathBuf::from("/proc"));
    read.extend(layout.resolv_conf.iter().cloned());
    read.extend(readonly.iter().map(|mount| mount.host().to_path_buf()));
    let program = Path::new(spec.program);
    let program = program
        .is_absolute()
        .then(|| std::fs::canonicalize(program).ok())
        .flatten();
    // What the agent needs, outer directories first, so that what lies inside one adds no rule.
    let mut needed: Vec<PathBuf> = spec.needs.iter().map(|need| need.real.clone()).collect();
    needed.sort_by_key(|path| path.components().count());
    let mut granted_needs: Vec<PathBuf> = Vec::new();
    for real in needed.into_iter().chain(program) {
        if !read
            .iter()
            .chain(&granted_needs)
            .any(|granted| real.starts_with(granted))
        {
            granted_needs.push(real);
        }
    }
    // The file that was checked, by descriptor: never the name, which may lead elsewhere now.
    read.extend(
        granted_needs
            .into_iter()
            .map(|real| spec.pinned.source(&real).unwrap_or(real)),
    );
    let dirs = spec.dirs;
    let mut write: Vec<PathBuf> = [&dirs.workspace, &dirs.home, &dirs.tmp, &dirs.state]
        .into_iter()
        .cloned()
        .collect();
    write.extend(DEVICES.iter().map(PathBuf::from).filter(|device| device.exists()));
    Rules {
        uid: spec.uid,
        gid: spec.uid,
        read,
        write,
    }
}
