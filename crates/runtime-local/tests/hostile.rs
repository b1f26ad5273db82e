//! Hostile input: identities and on-disk session state crafted to escape the runtime's root.
//!
//! - [`hostile_identities_are_typed_errors_or_only_name_a_hashed_directory`]: `../`, absolute
//!   paths, NUL, 10 KB strings, RTL override, emoji (and more) in every part of an identity. Each
//!   is either refused with `InvalidIdentity` naming the part, or accepted, in which case the
//!   session lives in `root/<session id>` and nowhere else, and its raw thread appears in no
//!   path and no file under the root. A sibling of the root is unchanged afterwards.
//! - [`hostile_records_give_typed_errors_and_never_touch_anything_outside_root`]: sessions whose
//!   storage was tampered with: garbage JSON, unknown fields, a wrong version, an id that is not
//!   one, a record naming another session, a huge record, `record.json` a symbolic link out of the
//!   root, the session directory itself a link out of the root, links planted as the record's
//!   temporary file, the lock file and the workspace, a session id that is a plain file,
//!   `.trash` and `.uids` links out of the root (holding entries named like what the runtime
//!   deletes there). `status`, `attach`, `suspend`, `close`, `list` and
//!   `reconcile` give typed errors (`list` and `reconcile` skip or report the broken session and
//!   go on), and nothing outside the root is created, changed or deleted: a tree of victims
//!   outside the root, the targets of every link, is compared byte for byte before and after.
//!   Nothing the runtime cannot prove it created is deleted inside the root either.
//! - [`a_record_naming_a_foreign_process_never_gets_it_signalled`]: a record claiming that some
//!   other process of the host (in a process group of its own) is the session's worker, started
//!   by a broker that is gone: `reconcile`, `attach` and `close` never signal it.
//! - [`a_reconcile_lock_planted_as_a_link_is_an_error_and_its_target_is_untouched`].
//! - [`session_directories_whose_modes_were_widened_are_made_private_again`]: a session's
//!   directories chmodded 0777 after create are narrowed back before its next worker starts, in
//!   every mode this machine runs.

mod common;

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use runtime_local::LocalRuntime;
use session_runtime::config::SandboxMode;
use session_runtime::testing::AcpClient;
use session_runtime::{
    CloseReason, CreateOptions, Error, SessionId, SessionIdentity, SessionRuntime, SuspendReason,
};

const INSTALLATION: &str = "hostile";

fn runtime(root: &Path) -> Arc<LocalRuntime> {
    Arc::new(
        LocalRuntime::builder(common::test_agent())
            .root(root)
            .installation(INSTALLATION)
            .sandbox(SandboxMode::None)
            .build()
            .expect("runtime"),
    )
}

/// What a tree holds: every path (relative) with its kind and content or link target.
fn snapshot(top: &Path) -> BTreeMap<PathBuf, String> {
    fn walk(top: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let relative = path.strip_prefix(top).expect("inside").to_path_buf();
            let meta = std::fs::symlink_metadata(&path).expect("metadata");
            let what = if meta.file_type().is_symlink() {
                format!("link -> {}", std::fs::read_link(&path).expect("link").display())
            } else if meta.is_dir() {
                walk(top, &path, out);
                "dir".to_owned()
            } else {
                format!(
                    "file {}",
                    String::from_utf8_lossy(&std::fs::read(&path).expect("read"))
                )
            };
            out.insert(relative, what);
        }
    }
    let mut out = BTreeMap::new();
    walk(top, top, &mut out);
    out
}

/// Every path and file content under `top`, as text.
fn everything_under(top: &Path) -> String {
    snapshot(top)
        .into_iter()
        .map(|(path, what)| format!("{} {what}\n", path.display()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_identities_are_typed_errors_or_only_name_a_hashed_directory() {
    let parent = tempfile::tempdir().expect("parent");
    let root = parent.path().join("root");
    let sibling = parent.path().join("sibling");
    std::fs::create_dir_all(sibling.join("etc")).expect("sibling");
    std::fs::write(sibling.join("etc/passwd"), "precious\n").expect("victim");
    let runtime = runtime(&root);
    let outside = || {
        let mut all = snapshot(parent.path());
        all.retain(|path, _| !path.starts_with("root"));
        all
    };
    let before = outside();

    let ten_kb = "x".repeat(10 * 1024);
    let sibling_path = sibling.display().to_string();
    // (value, accepted as a thread). Labels (installation, agent, platform) accept none of them.
    let cases: Vec<(&str, String, bool)> = vec![
        ("dot-dot", "../".to_owned(), true),
        ("deep dot-dot", "../../../../../../etc/passwd".to_owned(), true),
        ("dot-dot to the sibling", "../sibling/etc/passwd".to_owned(), true),
        ("dot", ".".to_owned(), true),
        ("absolute", "/etc/passwd".to_owned(), true),
        ("absolute sibling", sibling_path.clone(), true),
        ("root", "/".to_owned(), true),
        ("shell", "$(touch /tmp/pwned); `id` | rm -rf ~".to_owned(), true),
        ("emoji", "🦀 thread 🔥".to_owned(), true),
        ("nul", "abc\0def".to_owned(), false),
        ("nul only", "\0".to_owned(), false),
        ("10 KB", ten_kb.clone(), false),
        ("256 bytes", "y".repeat(256), true),
        ("257 bytes", "y".repeat(257), false),
        ("rtl override", "abc\u{202E}txt.exe".to_owned(), false),
        ("emoji zwj sequence", "👩\u{200D}💻".to_owned(), false),
        ("newline", "a\nb".to_owned(), false),
        ("escape", "\u{1b}[31mred".to_owned(), false),
        ("empty", String::new(), false),
        ("whitespace", "   ".to_owned(), false),
    ];
    let mut accepted = Vec::new();
    for (name, value, thread_ok) in &cases {
        for (part, result) in [
            (
                "installation",
                SessionIdentity::new(value.as_str(), "agent", "discord", "t"),
            ),
            (
                "agent",
                SessionIdentity::new(INSTALLATION, value.as_str(), "discord", "t"),
            ),
            (
                "platform",
                SessionIdentity::new(INSTALLATION, "agent", value.as_str(), "t"),
            ),
        ] {
            match result {
                Err(Error::InvalidIdentity { part: found, problem }) => {
                    assert_eq!(found, part, "{name}: {problem}")
                }
                other => panic!("{name} as {part} must be refused, got {other:?}"),
            }
        }
        match SessionIdentity::new(INSTALLATION, "agent", "discord", value.as_str()) {
            Err(Error::InvalidIdentity { part, problem }) => {
                assert!(!thread_ok, "{name} is a valid thread, yet: {problem}");
                assert_eq!(part, "thread");
                // The problem never quotes the thread.
                if value.len() > 3 {
                    assert!(!problem.contains(value.as_str()), "{name}: {problem}");
                }
            }
            Ok(identity) => {
                assert!(thread_ok, "{name} must be refused as a thread");
                accepted.push((*name, value.clone(), identity));
            }
            Err(other) => panic!("{name}: {other}"),
        }
        // Nor is a hostile string ever a session id.
        assert!(
            matches!(SessionId::parse(value), Err(Error::InvalidIdentity { .. })),
            "{name}"
        );
    }
    // A runtime refuses hostile installations, and identities of other installations.
    match LocalRuntime::builder(common::test_agent())
        .root(parent.path().join("other"))
        .installation("../../etc")
        .build()
    {
        Err(Error::InvalidConfig { key, .. }) => assert_eq!(key, "session_runtime.installation"),
        other => panic!("a hostile installation must be refused, got {other:?}"),
    }
    match LocalRuntime::builder(common::test_agent())
        .root("relative/../root")
        .build()
    {
        Err(Error::InvalidConfig { key, .. }) => assert_eq!(key, "session_runtime.local.root"),
        other => panic!("a relative root must be refused, got {other:?}"),
    }
    let foreign = SessionIdentity::new("other-installation", "agent", "discord", "t").expect("identity");
    match runtime.create(&foreign, &CreateOptions::new()).await {
        Err(Error::InvalidIdentity { part, .. }) => assert_eq!(part, "installation"),
        other => panic!("another installation's identity must be refused, got {other:?}"),
    }

    // Accepted ones: the session lives in root/<id>, and only there.
    for (name, value, identity) in &accepted {
        let id = identity.id();
        let handle = runtime
            .create(identity, &CreateOptions::new())
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(handle.id, id);
        let status = runtime.status(&id).await.expect("status");
        assert_eq!(
            status.storage_refs,
            vec![root.join(id.as_str()).display().to_string()]
        );
        let client = AcpClient::new(runtime.attach(&id).await.expect("attach"));
        client.initialize().await.expect("initialize");
        let pwd = client
            .exec("pwd && echo made-by-the-agent > in-workspace")
            .await
            .expect("exec");
        assert_eq!(
            pwd.stdout.trim(),
            root.join(id.as_str()).join("workspace").display().to_string(),
            "{name}"
        );
        // The raw thread is in no path and no file of the root.
        if value.len() >= 4 {
            let all = everything_under(&root);
            assert!(
                !all.contains(value.as_str()),
                "{name} leaked into the root:\n{all}"
            );
        }
        runtime.suspend(&id, SuspendReason::Idle).await.expect("suspend");
        drop(client);
        runtime.close(&id, CloseReason::Reset).await.expect("close");
        assert!(!root.join(id.as_str()).exists(), "{name}");
    }
    assert!(accepted.len() >= 8, "{}", accepted.len());

    // Nothing happened outside the root; the root holds only bookkeeping.
    assert_eq!(outside(), before, "something outside the root changed");
    assert!(!Path::new("/tmp/pwned").exists());
    for entry in std::fs::read_dir(&root).expect("root").flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        assert!(
            [".counters", ".reconcile.lock", ".trash", ".retained", ".uids"].contains(&name.as_str()),
            "unexpected {name} in the root"
        );
    }
}

/// One tampered session: how it was made, and what the runtime must say about it.
struct Case {
    name: &'static str,
    id: SessionId,
    /// `status` must fail with a typed (backend) error; `false`: it must succeed.
    status_fails: bool,
    /// `attach` must fail with a typed error; `false`: it must succeed.
    attach_fails: bool,
    /// The session directory must survive `close` and `reconcile` (nothing provable to delete).
    kept: bool,
}

/// A valid session record of `id`, as the runtime wrote it (read back as JSON).
async fn real_record(runtime: &LocalRuntime, root: &Path, thread: &str) -> (SessionId, serde_json::Value) {
    let identity = SessionIdentity::new(INSTALLATION, "agent", "discord", thread).expect("identity");
    let id = runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create")
        .id;
    let text = std::fs::read_to_string(root.join(id.as_str()).join("record.json")).expect("record");
    (id, serde_json::from_str(&text).expect("a record is JSON"))
}

fn write_json(path: &Path, value: &serde_json::Value) {
    std::fs::write(path, serde_json::to_vec_pretty(value).expect("json")).expect("write record");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_records_give_typed_errors_and_never_touch_anything_outside_root() {
    let parent = tempfile::tempdir().expect("parent");
    let root = parent.path().join("root");
    let outside = parent.path().join("outside");
    std::fs::create_dir_all(outside.join("victim-dir/nested")).expect("outside");
    std::fs::write(outside.join("victim.txt"), "precious\n").expect("victim");
    std::fs::write(outside.join("victim-dir/nested/file"), "also precious\n").expect("victim");
    let runtime = runtime(&root);
    let (other, _) = real_record(&runtime, &root, "the-other-session").await;

    let mut cases = Vec::new();
    let mut add = |name, id, status_fails, attach_fails, kept| {
        cases.push(Case {
            name,
            id,
            status_fails,
            attach_fails,
            kept,
        })
    };

    // Records that do not parse, or parse into something that is not this session's record.
    let (id, _) = real_record(&runtime, &root, "garbage").await;
    std::fs::write(root.join(id.as_str()).join("record.json"), "{ not json at all").expect("garbage");
    add("garbage JSON", id, true, true, true);

    let (id, mut record) = real_record(&runtime, &root, "unknown-field").await;
    record["delete_this_too"] = serde_json::json!("/");
    write_json(&root.join(id.as_str()).join("record.json"), &record);
    add("unknown field", id, true, true, true);

    let (id, mut record) = real_record(&runtime, &root, "wrong-version").await;
    record["version"] = serde_json::json!(99);
    write_json(&root.join(id.as_str()).join("record.json"), &record);
    add("wrong version", id, true, true, true);

    let (id, mut record) = real_record(&runtime, &root, "bad-id").await;
    record["id"] = serde_json::json!("../../../outside");
    write_json(&root.join(id.as_str()).join("record.json"), &record);
    add("an id that is no session id", id, true, true, true);

    let (id, _) = real_record(&runtime, &root, "names-another").await;
    std::fs::copy(
        root.join(other.as_str()).join("record.json"),
        root.join(id.as_str()).join("record.json"),
    )
    .expect("copy");
    add("a record naming another session", id, true, true, true);

    let (id, record) = real_record(&runtime, &root, "huge").await;
    let mut huge = serde_json::to_string(&record).expect("json");
    huge.push_str(&" ".repeat(4 * 1024 * 1024));
    std::fs::write(root.join(id.as_str()).join("record.json"), huge).expect("huge");
    add("a 4 MB record", id, true, true, true);

    // Links out of the root. Each target holds a valid record of the session, so a runtime that
    // followed the link would believe it.
    let (id, _) = real_record(&runtime, &root, "record-link").await;
    let record_path = root.join(id.as_str()).join("record.json");
    std::fs::rename(&record_path, outside.join("record-copy.json")).expect("move record");
    std::os::unix::fs::symlink(outside.join("record-copy.json"), &record_path).expect("link");
    add("record.json a link out of the root", id, true, true, true);

    let (id, _) = real_record(&runtime, &root, "dir-link").await;
    std::fs::rename(root.join(id.as_str()), outside.join("moved-session")).expect("move session");
    std::os::unix::fs::symlink(outside.join("moved-session"), root.join(id.as_str())).expect("link");
    add(
        "the session directory a link out of the root",
        id,
        true,
        true,
        true,
    );

    let (id, _) = real_record(&runtime, &root, "tmp-link").await;
    std::os::unix::fs::symlink(
        outside.join("victim.txt"),
        root.join(id.as_str()).join(".record.json.tmp"),
    )
    .expect("link");
    add(
        "the record's temporary file a link out of the root",
        id,
        false,
        false,
        false,
    );

    let (id, _) = real_record(&runtime, &root, "lock-link").await;
    let lock = root.join(id.as_str()).join("lock");
    let _ = std::fs::remove_file(&lock);
    std::os::unix::fs::symlink(outside.join("lock-created-outside"), &lock).expect("link");
    add("the lock file a link out of the root", id, false, true, true);

    let (id, _) = real_record(&runtime, &root, "workspace-link").await;
    let workspace = root.join(id.as_str()).join("workspace");
    std::fs::remove_dir(&workspace).expect("empty workspace");
    std::os::unix::fs::symlink(outside.join("victim-dir"), &workspace).expect("link");
    add("the workspace a link out of the root", id, false, true, false);

    // A session id that is a plain file.
    let id = SessionIdentity::new(INSTALLATION, "agent", "discord", "plain-file")
        .expect("identity")
        .id();
    std::fs::create_dir_all(&root).expect("root");
    std::fs::write(root.join(id.as_str()), "not a directory").expect("file");
    add("a session id that is a plain file", id, true, true, true);

    // Bookkeeping directories that are links out of the root, holding entries named like
    // storage the runtime deletes.
    let victim_trash = outside.join("trash-victim");
    std::fs::create_dir_all(victim_trash.join(format!("{other}.1"))).expect("victim trash");
    std::fs::write(victim_trash.join(format!("{other}.1/file")), "precious\n").expect("victim");
    std::os::unix::fs::symlink(&victim_trash, root.join(".trash")).expect("link");

    let victim_uids = outside.join("uids-victim");
    std::fs::create_dir_all(&victim_uids).expect("victim uids");
    for (n, case) in cases.iter().enumerate() {
        // Files named like uid claims, held by the sessions this test closes.
        std::fs::write(victim_uids.join(format!("{}", 4000 + n)), case.id.as_str()).expect("victim");
    }
    std::fs::write(victim_uids.join("4242"), other.as_str()).expect("victim");
    // And one of a session that has no storage at all: `reconcile` releases such claims.
    let never = SessionIdentity::new(INSTALLATION, "agent", "discord", "never-created").expect("identity");
    std::fs::write(victim_uids.join("4999"), never.id().as_str()).expect("victim");
    std::os::unix::fs::symlink(&victim_uids, root.join(".uids")).expect("link");

    let outside_before = snapshot(&outside);
    let mut kept = Vec::new();
    for case in &cases {
        let Case { name, id, .. } = case;
        let base = root.join(id.as_str());
        match runtime.status(id).await {
            Err(Error::Backend { retryable, .. }) if case.status_fails => {
                assert!(!retryable, "{name}: a broken record does not heal by retrying")
            }
            Ok(_) if !case.status_fails => {}
            other => panic!("{name}: status: unexpected {other:?}"),
        }
        match runtime.attach(id).await {
            Ok(attachment) if !case.attach_fails => drop(attachment),
            Err(Error::Backend { .. }) if case.attach_fails => {}
            other => panic!("{name}: attach: unexpected {other:?}"),
        }
        match runtime.suspend(id, SuspendReason::Idle).await {
            Ok(()) => assert!(!case.status_fails, "{name}: suspend succeeded on a broken record"),
            Err(Error::Backend { .. } | Error::StorageInUse { .. }) => {}
            Err(other) => panic!("{name}: suspend: unexpected {other:?}"),
        }
        match runtime.close(id, CloseReason::Reset).await {
            Ok(()) => assert!(!case.status_fails, "{name}: close succeeded on a broken record"),
            Err(Error::Backend { .. } | Error::StorageInUse { .. }) => {}
            Err(other) => panic!("{name}: close: unexpected {other:?}"),
        }
        if case.kept {
            assert!(
                std::fs::symlink_metadata(&base).is_ok(),
                "{name}: the runtime deleted storage it cannot prove it created"
            );
            kept.push(*id);
        }
        assert_eq!(
            snapshot(&outside),
            outside_before,
            "{name}: something outside the root changed"
        );
    }

    // `list` skips what it cannot read; `reconcile` reports it and goes on.
    let listed = runtime.list().await.expect("list");
    for status in &listed {
        assert!(
            !cases.iter().any(|c| c.status_fails && c.id == status.id),
            "list returned a broken session: {status:?}"
        );
    }
    let report = runtime.reconcile().await.expect("reconcile");
    let report_again = runtime.reconcile().await.expect("reconcile again");
    assert_eq!(
        snapshot(&outside),
        outside_before,
        "reconcile changed something outside the root"
    );
    for case in cases.iter().filter(|c| c.status_fails) {
        assert!(
            report.errors.iter().any(|e| e.contains(case.id.as_str())),
            "{}: reconcile must report it: {report:?}",
            case.name
        );
    }
    for what in ["trash", "uid claims"] {
        assert!(
            report.errors.iter().any(|e| e.contains(what)),
            "reconcile must report the linked {what} directory: {report:?}"
        );
    }
    assert_eq!(report.errors.len(), report_again.errors.len());
    for id in &kept {
        assert!(
            std::fs::symlink_metadata(root.join(id.as_str())).is_ok(),
            "reconcile deleted {id}"
        );
    }
    assert!(!outside.join("lock-created-outside").exists());
    assert_eq!(
        std::fs::read_to_string(outside.join("victim.txt")).expect("victim"),
        "precious\n"
    );
}

/// The start time of `pid` (field 22 of `/proc/<pid>/stat`), as the runtime records it.
fn start_time(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    let (_, rest) = stat.rsplit_once(") ").expect("stat format");
    rest.split_ascii_whitespace()
        .nth(19)
        .and_then(|field| field.parse().ok())
        .expect("start time")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_naming_a_foreign_process_never_gets_it_signalled() {
    let parent = tempfile::tempdir().expect("parent");
    let root = parent.path().join("root");
    let runtime = runtime(&root);
    // Any process on the host, in a process group of its own, and a broker pid that is gone.
    let mut victim = std::process::Command::new("sleep")
        .arg("1000")
        .process_group(0)
        .spawn()
        .expect("victim");
    let mut finished = std::process::Command::new("true").spawn().expect("true");
    let dead_broker = finished.id();
    finished.wait().expect("reap");

    let (id, record) = real_record(&runtime, &root, "foreign-pid").await;
    let mut hostile = record.clone();
    hostile["phase"] = serde_json::json!("running");
    hostile["worker"] = serde_json::json!({
        "generation": record["generation"],
        "process": {"pid": victim.id(), "start_time": start_time(victim.id())},
        "broker": {"pid": dead_broker, "start_time": 1},
        "started_at": record["created_at"],
    });
    let path = root.join(id.as_str()).join("record.json");

    // The garbage collector: the record says a worker of a dead broker runs.
    write_json(&path, &hostile);
    let report = runtime.reconcile().await.expect("reconcile");
    assert_eq!(
        victim.try_wait().expect("victim status"),
        None,
        "reconcile signalled a process that is not this session's worker: {report:?}"
    );
    // The record is repaired: no worker runs, so the session is suspended.
    let status = runtime.status(&id).await.expect("status");
    assert!(status.worker.is_none(), "{status:?}");

    // A new worker start stops the recorded one first; and a close stops it too.
    write_json(&path, &hostile);
    drop(runtime.attach(&id).await.expect("attach"));
    write_json(&path, &hostile);
    match runtime.close(&id, CloseReason::Reset).await {
        Ok(()) | Err(Error::Backend { .. }) => {}
        Err(other) => panic!("close: unexpected {other:?}"),
    }
    assert_eq!(
        victim.try_wait().expect("victim status"),
        None,
        "attach or close signalled a process that is not this session's worker"
    );
    victim.kill().expect("kill the victim");
    victim.wait().expect("reap the victim");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconcile_lock_planted_as_a_link_is_an_error_and_its_target_is_untouched() {
    let parent = tempfile::tempdir().expect("parent");
    let root = parent.path().join("root");
    let runtime = runtime(&root);
    let victim = parent.path().join("victim.txt");
    std::fs::write(&victim, "precious\n").expect("victim");
    std::fs::create_dir_all(&root).expect("root");
    std::os::unix::fs::symlink(&victim, root.join(".reconcile.lock")).expect("link");
    match runtime.reconcile().await {
        Err(Error::Backend { .. }) => {}
        other => panic!("reconcile through a planted lock link: unexpected {other:?}"),
    }
    assert_eq!(std::fs::read_to_string(&victim).expect("victim"), "precious\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_directories_whose_modes_were_widened_are_made_private_again() {
    use std::os::unix::fs::PermissionsExt;
    common::use_built_landlock_helper();
    let mode_of = |path: &Path| {
        std::fs::symlink_metadata(path)
            .expect("metadata")
            .permissions()
            .mode()
            & 0o7777
    };
    for sandbox in [SandboxMode::None, SandboxMode::Bubblewrap, SandboxMode::Landlock] {
        let root = tempfile::tempdir().expect("root");
        let builder = common::builder(root.path(), INSTALLATION, sandbox);
        let Some(runtime) = common::build_if_supported(builder, sandbox) else {
            continue;
        };
        let identity = SessionIdentity::new(INSTALLATION, "agent", "discord", "widened").expect("identity");
        let id = identity.id();
        runtime
            .create(&identity, &CreateOptions::new())
            .await
            .expect("create");
        let base = root.path().join(id.as_str());
        let dirs: Vec<PathBuf> = ["workspace", "home", "state", "tmp"]
            .iter()
            .map(|name| base.join(name))
            .collect();
        // What create gave them: the control, against which the widening is measured.
        let created: Vec<u32> = std::iter::once(&base).chain(&dirs).map(|d| mode_of(d)).collect();
        assert!(
            created.iter().all(|mode| mode & 0o007 == 0),
            "{sandbox}: {:?}",
            octal(&created)
        );
        for dir in std::iter::once(&base).chain(&dirs) {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        }
        let attachment = runtime.attach(&id).await.expect("attach");
        let now: Vec<u32> = std::iter::once(&base).chain(&dirs).map(|d| mode_of(d)).collect();
        drop(attachment);
        runtime.close(&id, CloseReason::Ended).await.expect("close");
        assert_eq!(octal(&now), octal(&created), "{sandbox}: modes after attach");
    }
}

/// Modes written in octal, for messages.
fn octal(modes: &[u32]) -> Vec<String> {
    modes.iter().map(|mode| format!("{mode:04o}")).collect()
}
