//! Seeds applied at create, checked from inside the session in every mode this machine can run:
//!
//! - the administrator's HOME template is copied into the session's HOME (files, permission bits,
//!   symbolic links as links, never followed), owned by the session's user, writable by the agent,
//!   and the template itself is borrowed: unchanged by the session's writes and by a deleting close;
//! - a git repository is cloned into the workspace at the requested branch, and the source
//!   repository is left as it was;
//! - a clone that fails is a typed error that says so, and a later create of the same thread
//!   with a working seed provisions the session from scratch.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use runtime_local::LocalRuntime;
use session_runtime::config::SandboxMode;
use session_runtime::testing::AcpClient;
use session_runtime::{CloseReason, CreateOptions, Error, SessionIdentity, SessionRuntime, WorkspaceSeed};

const INSTALLATION: &str = "seeds";
const CREDENTIALS: &str = "{\"token\": \"admin-provided\"}\n";

/// Every entry under `top`: relative path → kind, mode and content (or link target).
fn snapshot(top: &Path) -> BTreeMap<PathBuf, String> {
    fn walk(top: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, String>) {
        for entry in std::fs::read_dir(dir).expect("read dir").flatten() {
            let path = entry.path();
            let meta = std::fs::symlink_metadata(&path).expect("metadata");
            let relative = path.strip_prefix(top).expect("under top").to_owned();
            let mode = meta.permissions().mode() & 0o7777;
            if meta.file_type().is_symlink() {
                let target = std::fs::read_link(&path).expect("link");
                out.insert(relative, format!("link -> {}", target.display()));
            } else if meta.is_dir() {
                out.insert(relative, format!("dir {mode:o}"));
                walk(top, &path, out);
            } else {
                let content = std::fs::read(&path).expect("file");
                out.insert(
                    relative,
                    format!("file {mode:o} {}", String::from_utf8_lossy(&content)),
                );
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(top, top, &mut out);
    out
}

/// An administrator's HOME template: credentials (0600), a config file, and a link out.
fn home_template(dir: &Path) -> PathBuf {
    let template = dir.join("agent-home");
    let config = template.join(".config/agent");
    std::fs::create_dir_all(&config).expect("template dirs");
    std::fs::write(config.join("credentials.json"), CREDENTIALS).expect("credentials");
    std::fs::set_permissions(
        config.join("credentials.json"),
        std::fs::Permissions::from_mode(0o600),
    )
    .expect("chmod");
    std::fs::write(template.join(".agentrc"), "model = default\n").expect("agentrc");
    std::os::unix::fs::symlink("/etc/hostname", template.join("link-out")).expect("symlink");
    for dir in [&template, &template.join(".config"), &config] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    template
}

fn git(dir: &Path, args: &[&str]) -> String {
    let output = Command::new("git")
        .current_dir(dir)
        .args(["-c", "user.name=seed", "-c", "user.email=seed@example.invalid"])
        .args(args)
        .output()
        .expect("running git");
    assert!(
        output.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

/// A repository with `main` (README) and `feature` (README and FEATURE); `main` checked out.
fn repository(dir: &Path) -> PathBuf {
    let repo = dir.join("repo");
    std::fs::create_dir_all(&repo).expect("repo dir");
    git(&repo, &["init", "--quiet", "--initial-branch=main"]);
    std::fs::write(repo.join("README"), "main branch\n").expect("README");
    git(&repo, &["add", "README"]);
    git(&repo, &["commit", "--quiet", "-m", "main"]);
    git(&repo, &["checkout", "--quiet", "-b", "feature"]);
    std::fs::write(repo.join("FEATURE"), "feature branch\n").expect("FEATURE");
    git(&repo, &["add", "FEATURE"]);
    git(&repo, &["commit", "--quiet", "-m", "feature"]);
    git(&repo, &["checkout", "--quiet", "main"]);
    repo
}

/// Checks the probe's `owner A B me U` line: both files belong to the session's user `U`.
fn assert_owned_by_session_user(out: &str, why: &str, context: &str) {
    let owner = out
        .lines()
        .find_map(|line| line.strip_prefix("owner "))
        .unwrap_or_else(|| panic!("no owner line: {context}"));
    let ids: Vec<&str> = owner.split_whitespace().collect();
    assert_eq!(ids.len(), 4, "{context}");
    assert_eq!((ids[0], ids[1]), (ids[3], ids[3]), "{why}: {context}");
}

fn build(mode: SandboxMode, root: &Path, template: &Path) -> Option<Arc<LocalRuntime>> {
    common::build_if_supported(
        common::builder(root, INSTALLATION, mode).home_template(template),
        mode,
    )
}

fn clone_of(repo: &Path, reference: Option<&str>) -> CreateOptions {
    CreateOptions::new().with_workspace_seed(WorkspaceSeed::GitClone {
        url: repo.display().to_string(),
        reference: reference.map(str::to_owned),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_home_template_and_a_git_clone_seed_the_session_and_stay_untouched() {
    let scratch = tempfile::tempdir().expect("scratch");
    std::fs::set_permissions(scratch.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let template = home_template(scratch.path());
    let repo = repository(scratch.path());
    let template_before = snapshot(&template);
    let heads_before = git(&repo, &["show-ref", "--heads"]);

    let mut ran = Vec::new();
    for mode in [SandboxMode::None, SandboxMode::Bubblewrap, SandboxMode::Landlock] {
        let root = scratch.path().join(format!("root-{mode}"));
        let Some(runtime) = build(mode, &root, &template) else {
            continue;
        };
        let identity =
            SessionIdentity::new(INSTALLATION, "agent", "slack", format!("seeded-{mode}")).expect("identity");
        let id = identity.id();
        runtime
            .create(&identity, &clone_of(&repo, Some("feature")))
            .await
            .unwrap_or_else(|e| panic!("{mode}: create: {e}"));
        let client = AcpClient::new(runtime.attach(&id).await.expect("attach"));
        client.initialize().await.expect("initialize");
        let probe = client
            .exec(
                "cat \"$HOME/.config/agent/credentials.json\"; \
                 echo \"mode $(stat -c %a \"$HOME/.config/agent/credentials.json\")\"; \
                 echo \"owner $(stat -c %u \"$HOME/.config/agent/credentials.json\") $(stat -c %u FEATURE) me $(id -u)\"; \
                 echo \"link $(readlink \"$HOME/link-out\")\"; \
                 echo \"head $(cat .git/HEAD)\"; cat README FEATURE; \
                 echo 'changed by the agent' >> \"$HOME/.agentrc\" && echo wrote",
            )
            .await
            .expect("exec");
        let out = &probe.stdout;
        let context = format!("{mode}:\n{out}\n{}", probe.stderr);
        assert!(out.contains(CREDENTIALS.trim()), "credentials copied: {context}");
        assert!(out.contains("mode 600"), "permission bits kept: {context}");
        assert_owned_by_session_user(out, "seeded files belong to the session's user", &context);
        assert!(
            out.contains("link /etc/hostname"),
            "a link stays a link: {context}"
        );
        assert!(
            out.contains("head ref: refs/heads/feature"),
            "the requested branch: {context}"
        );
        assert!(
            out.contains("main branch") && out.contains("feature branch"),
            "the branch's files: {context}"
        );
        assert!(
            out.contains("wrote"),
            "the agent can change its HOME copy: {context}"
        );
        drop(client);
        runtime.close(&id, CloseReason::Reset).await.expect("close");
        assert!(
            !root.join(id.as_str()).exists(),
            "{mode}: the session's storage is deleted"
        );
        assert_eq!(
            snapshot(&template),
            template_before,
            "{mode}: the template is borrowed"
        );
        assert_eq!(
            git(&repo, &["show-ref", "--heads"]),
            heads_before,
            "{mode}: the source repository"
        );
        ran.push(mode);
    }
    assert!(ran.contains(&SandboxMode::None), "plain mode always runs");
    println!("checked: {ran:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_clone_is_a_typed_error_and_the_next_create_starts_clean() {
    let scratch = tempfile::tempdir().expect("scratch");
    let template = home_template(scratch.path());
    let repo = repository(scratch.path());
    let root = scratch.path().join("root");
    let runtime = build(SandboxMode::None, &root, &template).expect("plain runtime");
    let identity = SessionIdentity::new(INSTALLATION, "agent", "slack", "bad-seed").expect("identity");
    let id = identity.id();

    let missing = scratch.path().join("no-such-repository");
    match runtime.create(&identity, &clone_of(&missing, None)).await {
        Err(error @ Error::Backend { retryable: false, .. }) => {
            assert!(error.to_string().contains("git clone"), "{error}");
        }
        other => panic!("a clone of a missing repository must fail, got {other:?}"),
    }
    match runtime
        .create(&identity, &clone_of(&repo, Some("no-such-branch")))
        .await
    {
        Err(Error::Backend { retryable: false, .. }) => {}
        other => panic!("a clone of a missing branch must fail, got {other:?}"),
    }
    runtime
        .create(&identity, &clone_of(&repo, None))
        .await
        .expect("create with a working seed");
    let client = AcpClient::new(runtime.attach(&id).await.expect("attach"));
    client.initialize().await.expect("initialize");
    let probe = client.exec("cat .git/HEAD; ls -A").await.expect("exec");
    assert!(
        probe.stdout.contains("ref: refs/heads/main"),
        "the default branch: {}",
        probe.stdout
    );
    assert!(!probe.stdout.contains("FEATURE"), "{}", probe.stdout);
    drop(client);
    runtime.close(&id, CloseReason::Reset).await.expect("close");
}

fn copy_of(source: &SessionIdentity) -> CreateOptions {
    CreateOptions::new().with_workspace_seed(WorkspaceSeed::CopyOf { source: source.id() })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_of_an_idle_session_seeds_the_new_one_and_a_source_in_use_is_refused() {
    let scratch = tempfile::tempdir().expect("scratch");
    std::fs::set_permissions(scratch.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let template = home_template(scratch.path());

    let mut ran = Vec::new();
    for mode in [SandboxMode::None, SandboxMode::Bubblewrap, SandboxMode::Landlock] {
        let root = scratch.path().join(format!("copy-root-{mode}"));
        let Some(runtime) = build(mode, &root, &template) else {
            continue;
        };
        let thread = |name: &str| {
            SessionIdentity::new(INSTALLATION, "agent", "slack", format!("{name}-{mode}")).expect("identity")
        };
        let (source, fork, other) = (thread("source"), thread("fork"), thread("other"));
        runtime
            .create(&source, &CreateOptions::new())
            .await
            .expect("create source");
        let client = AcpClient::new(runtime.attach(&source.id()).await.expect("attach source"));
        client.initialize().await.expect("initialize");
        let wrote = client
            .exec(
                "mkdir -p src && echo 'fn main() {}' > src/main.rs && echo 'from the source' > notes.txt \
                 && ln -s notes.txt latest && echo 'source state' > \"$HOME/.agent-state\" && echo wrote",
            )
            .await
            .expect("exec in the source");
        assert!(wrote.stdout.contains("wrote"), "{mode}: {}", wrote.stderr);

        // Attached: its worker may be writing, so the copy is refused at once and makes nothing.
        match runtime.create(&fork, &copy_of(&source)).await {
            Err(Error::StorageInUse { id, .. }) => assert_eq!(id, source.id(), "{mode}"),
            other => panic!("{mode}: a copy of an attached session must be refused, got {other:?}"),
        }
        assert!(
            matches!(runtime.status(&fork.id()).await, Err(Error::NotFound { .. })),
            "{mode}: a refused copy creates nothing"
        );
        drop(client);
        runtime
            .suspend(&source.id(), session_runtime::SuspendReason::Idle)
            .await
            .expect("suspend source");

        // Held by another broker process (here, a second runtime on the same root): refused too.
        let second = build(mode, &root, &template).expect("second runtime");
        let held = second
            .attach(&source.id())
            .await
            .expect("attach from the second broker");
        match runtime.create(&other, &copy_of(&source)).await {
            Err(Error::StorageInUse { id, .. }) => assert_eq!(id, source.id(), "{mode}"),
            other => panic!("{mode}: a copy of a session another broker runs must be refused, got {other:?}"),
        }
        drop(held);
        second
            .suspend(&source.id(), session_runtime::SuspendReason::Idle)
            .await
            .expect("suspend from the second broker");
        drop(second);

        // Idle: the fork gets the workspace and HOME, as its own user's, and changes only its copy.
        runtime
            .create(&fork, &copy_of(&source))
            .await
            .expect("create the fork");
        let client = AcpClient::new(runtime.attach(&fork.id()).await.expect("attach fork"));
        client.initialize().await.expect("initialize");
        let probe = client
            .exec(
                "cat notes.txt src/main.rs \"$HOME/.agent-state\"; echo \"link $(readlink latest)\"; \
                 echo \"owner $(stat -c %u notes.txt) $(stat -c %u \"$HOME/.agent-state\") me $(id -u)\"; \
                 test -f \"$HOME/.config/agent/credentials.json\" && echo template; \
                 echo 'changed in the fork' > notes.txt && echo wrote",
            )
            .await
            .expect("exec in the fork");
        let out = &probe.stdout;
        let context = format!("{mode}:\n{out}\n{}", probe.stderr);
        for expected in [
            "from the source",
            "fn main() {}",
            "source state",
            "link notes.txt",
            "template",
            "wrote",
        ] {
            assert!(out.contains(expected), "{expected:?} in the fork: {context}");
        }
        assert_owned_by_session_user(out, "the copy belongs to the fork's user", &context);
        drop(client);

        let client = AcpClient::new(runtime.attach(&source.id()).await.expect("attach source again"));
        client.initialize().await.expect("initialize");
        let probe = client.exec("cat notes.txt").await.expect("exec in the source");
        assert_eq!(
            probe.stdout.trim(),
            "from the source",
            "{mode}: the source is unchanged"
        );
        drop(client);

        match runtime.create(&thread("self"), &copy_of(&thread("self"))).await {
            Err(Error::InvalidArgument { .. }) => {}
            other => panic!("{mode}: a copy of itself must be refused, got {other:?}"),
        }
        match runtime.create(&other, &copy_of(&thread("never-created"))).await {
            Err(Error::NotFound { .. }) => {}
            other => panic!("{mode}: a copy of an unknown session must be NotFound, got {other:?}"),
        }
        for identity in [&source, &fork] {
            runtime
                .close(&identity.id(), CloseReason::Reset)
                .await
                .expect("close");
        }
        ran.push(mode);
    }
    assert!(ran.contains(&SandboxMode::None), "plain mode always runs");
    println!("checked: {ran:?}");
}
