//! What an agent program needs of the host is shown to it, read-only, in plain, bubblewrap and
//! Landlock modes, from `[agent] needs` and without it (issue 13, item 1).
//!
//! - [`a_script_agent_loads_the_files_beside_it_in_every_mode`]: a shell script that sources a
//!   file next to itself, and a Python script that imports a module next to itself and one from
//!   a directory listed in `needs`.
//! - [`an_interpreter_outside_the_system_directories_is_shown_in_every_mode`]: `#!` lines naming
//!   an interpreter by path, through a link, and through `/usr/bin/env` on the agent's `PATH`.
//! - [`an_agent_its_session_user_cannot_reach_fails_create_and_attach_naming_the_path`]: as root,
//!   sandboxed sessions run as a user of their own; a program under a private (0700) directory
//!   is an error at create (and at attach, once it became private), not an agent that fails.
//! - [`what_the_agent_needs_never_shows_the_session_root`]: a need containing the root, or inside
//!   it, is refused, naming the key.
//! - [`an_npm_installed_agent_needs_no_entry_in_every_mode`] (issue 24, item 1): a program linked
//!   from an npm prefix's `bin/` into its package, which loads a dependency nested in the package's
//!   `node_modules` and one hoisted beside it, without `needs`.
//! - [`a_virtual_environment_on_an_interpreter_outside_usr_runs_as_configured_in_every_mode`]
//!   (issue 24, item 2): `<venv>/bin/python` linking to an interpreter outside `/usr`, given a
//!   script in `args`, imports a module of the virtual environment, without `needs`.
//!
//! Installations live under Cargo's target temporary directory, outside `/tmp` (which a
//! bubblewrap sandbox replaces with the session's own) and outside every session root. A mode
//! this machine cannot run is skipped after checking that it is refused as documented.

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use runtime_local::LocalRuntime;
use session_runtime::config::SandboxMode;
use session_runtime::{AgentCommand, CloseReason, CreateOptions, Error, SessionIdentity, SessionRuntime};
use tokio::io::AsyncReadExt;

const MODES: [SandboxMode; 3] = [SandboxMode::None, SandboxMode::Bubblewrap, SandboxMode::Landlock];
const INSTALLATION: &str = "agent-files";

/// A directory for an agent's installation, readable by every user, outside `/tmp` (not in the
/// target directory, which is under `/tmp` when the checkout is).
fn install_dir(name: &str) -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix(&format!("oab-{name}"))
        .tempdir_in("/var/tmp")
        .expect("an installation directory");
    chmod(dir.path(), 0o755);
    dir
}

fn chmod(path: &Path, mode: u32) {
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).expect("chmod");
}

/// Writes `text` to `path` with `mode`.
fn write(path: &Path, text: &str, mode: u32) {
    fs::write(path, text).expect("write");
    chmod(path, mode);
}

/// A session root that sessions' own users may pass, as the runtime creates one.
fn session_root() -> tempfile::TempDir {
    let root = tempfile::tempdir().expect("root");
    chmod(root.path(), 0o711);
    root
}

/// A runtime in `mode` for `agent` under `root`, or `None` where this machine lacks the mode.
fn runtime(agent: AgentCommand, root: &Path, mode: SandboxMode) -> Option<std::sync::Arc<LocalRuntime>> {
    common::use_built_landlock_helper();
    let builder = LocalRuntime::builder(agent)
        .root(root)
        .installation(INSTALLATION)
        .sandbox(mode);
    common::build_if_supported(builder, mode)
}

fn identity(thread: &str) -> SessionIdentity {
    SessionIdentity::new(INSTALLATION, "agent", "discord", thread).expect("identity")
}

/// Everything `agent` writes to stdout in a new session in `mode` until it exits, or `None`
/// where this machine lacks the mode.
async fn output_of(agent: AgentCommand, mode: SandboxMode) -> Option<String> {
    let root = session_root();
    let runtime = runtime(agent, root.path(), mode)?;
    let identity = identity("output");
    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .unwrap_or_else(|e| panic!("{mode}: create: {e}"));
    let attachment = runtime
        .attach(&identity.id())
        .await
        .unwrap_or_else(|e| panic!("{mode}: attach: {e}"));
    let (mut output, _input, _control) = attachment.into_split();
    let mut bytes = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), output.read_to_end(&mut bytes))
        .await
        .unwrap_or_else(|_| panic!("{mode}: the agent did not end"))
        .unwrap_or_else(|e| panic!("{mode}: reading the agent's output: {e}"));
    runtime
        .close(&identity.id(), CloseReason::Ended)
        .await
        .expect("close");
    Some(String::from_utf8_lossy(&bytes).into_owned())
}

/// A `PATH` without the broker's own entries (here pyenv's shims live under root's private
/// home), so that the agents below find the system's interpreters, or `first`'s.
fn agent_path(first: Option<&Path>) -> String {
    let system = "/usr/local/bin:/usr/bin:/bin";
    match first {
        Some(dir) => format!("{}:{system}", dir.display()),
        None => system.to_owned(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_script_agent_loads_the_files_beside_it_in_every_mode() {
    let shell = install_dir("shell-agent-");
    let script = shell.path().join("agent.sh");
    write(
        &script,
        "#!/bin/sh\nexec 2>&1\n. \"$(dirname \"$0\")/greeting.sh\"\necho \"greeting=$GREETING\"\n",
        0o755,
    );
    write(&shell.path().join("greeting.sh"), "GREETING=from-beside\n", 0o644);

    let python = install_dir("python-agent-");
    let library = install_dir("python-library-");
    write(
        &python.path().join("agent.py"),
        "#!/usr/bin/env python3\nimport sys\nsys.stderr = sys.stdout\nimport beside, shared\n\
         print('beside=' + beside.WORD, 'shared=' + shared.WORD)\n",
        0o755,
    );
    write(&python.path().join("beside.py"), "WORD = 'found'\n", 0o644);
    write(&library.path().join("shared.py"), "WORD = 'listed'\n", 0o644);
    let python_agent = AgentCommand::new(python.path().join("agent.py").display().to_string())
        .env("PATH", agent_path(None))
        .env("PYTHONPATH", library.path().display().to_string())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .needs(library.path());

    for mode in MODES {
        let shell_agent = AgentCommand::new(script.display().to_string()).env("PATH", agent_path(None));
        let Some(out) = output_of(shell_agent, mode).await else {
            continue;
        };
        assert_eq!(out, "greeting=from-beside\n", "{mode}: the shell agent");
        let out = output_of(python_agent.clone(), mode)
            .await
            .expect("the mode worked above");
        assert_eq!(out, "beside=found shared=listed\n", "{mode}: the Python agent");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interpreter_outside_the_system_directories_is_shown_in_every_mode() {
    // A shell of its own, as a Node or Python installation under /opt would be.
    let interpreters = install_dir("interpreter-");
    let own_shell = interpreters.path().join("own-sh");
    fs::copy(fs::canonicalize("/bin/sh").expect("sh"), &own_shell).expect("copy sh");
    chmod(&own_shell, 0o755);
    let links = install_dir("interpreter-links-");
    std::os::unix::fs::symlink(&own_shell, links.path().join("linked-sh")).expect("symlink");

    let agents = install_dir("interpreted-agents-");
    let lines = [
        ("direct", format!("#!{}", own_shell.display())),
        (
            "linked",
            format!("#!{}", links.path().join("linked-sh").display()),
        ),
        ("env", "#!/usr/bin/env own-sh".to_owned()),
    ];
    for mode in MODES {
        for (name, shebang) in &lines {
            let script = agents.path().join(name);
            write(
                &script,
                &format!("{shebang}\nexec 2>&1\necho ran={name}\n"),
                0o755,
            );
            let agent = AgentCommand::new(script.display().to_string())
                .env("PATH", agent_path(Some(interpreters.path())));
            let Some(out) = output_of(agent, mode).await else {
                break;
            };
            assert_eq!(out, format!("ran={name}\n"), "{mode}: {shebang}");
        }
    }
}

/// The reason of an [`Error::InvalidConfig`] with `key`; panics on anything else.
fn config_error(result: Result<impl std::fmt::Debug, Error>, key: &str, what: &str) -> String {
    match result {
        Err(Error::InvalidConfig { key: got, reason }) if got == key => reason,
        other => panic!("{what}: expected an invalid {key}, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_its_session_user_cannot_reach_fails_create_and_attach_naming_the_path() {
    let as_root = rustix::process::geteuid().is_root();
    let install = install_dir("private-agent-");
    let private = install.path().join("venv");
    fs::create_dir(&private).expect("mkdir");
    let script = private.join("agent.sh");
    write(&script, "#!/bin/sh\necho started\n", 0o755);
    chmod(&private, 0o700);
    let shared = install.path().join("shared");
    fs::create_dir(&shared).expect("mkdir");
    chmod(&shared, 0o755);
    let reachable = shared.join("agent.sh");
    write(&reachable, "#!/bin/sh\necho started\n", 0o755);

    for mode in MODES {
        let root = session_root();
        let agent = AgentCommand::new(script.display().to_string());
        let Some(runtime) = runtime(agent, root.path(), mode) else {
            continue;
        };
        let created = runtime.create(&identity("private"), &CreateOptions::new()).await;
        if mode == SandboxMode::None || !as_root {
            // The agent runs as the broker's user, which reaches what the broker does.
            created.unwrap_or_else(|e| panic!("{mode}: {e}"));
            continue;
        }
        let reason = config_error(created, "agent.command", &format!("{mode}: create"));
        assert!(
            reason.contains(&private.display().to_string()) && reason.contains("cannot be reached"),
            "{mode}: {reason}"
        );
        assert!(reason.contains("mode 700"), "{mode}: says why: {reason}");
        assert!(
            runtime.list().await.expect("list").is_empty(),
            "{mode}: nothing was created"
        );

        // A listed need, private after the session was created: attach refuses it.
        let listed = install.path().join(format!("listed-{mode}"));
        fs::create_dir(&listed).expect("mkdir");
        chmod(&listed, 0o755);
        let agent = AgentCommand::new(reachable.display().to_string()).needs(&listed);
        let runtime = runtime_for(agent, root.path(), mode);
        let identity = identity("listed");
        runtime
            .create(&identity, &CreateOptions::new())
            .await
            .unwrap_or_else(|e| panic!("{mode}: a reachable need: {e}"));
        chmod(&listed, 0o700);
        let reason = config_error(
            runtime.attach(&identity.id()).await,
            "agent.needs",
            &format!("{mode}: attach"),
        );
        assert!(
            reason.contains("entry 1 of agent.needs") && reason.contains(&listed.display().to_string()),
            "{mode}: {reason}"
        );
        let status = runtime.status(&identity.id()).await.expect("status");
        assert!(status.worker.is_none(), "{mode}: no worker started: {status:?}");
    }
}

/// [`runtime`] for a mode that worked before.
fn runtime_for(agent: AgentCommand, root: &Path, mode: SandboxMode) -> std::sync::Arc<LocalRuntime> {
    runtime(agent, root, mode).unwrap_or_else(|| panic!("{mode} worked before"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_agent_needs_never_shows_the_session_root() {
    let around = install_dir("around-the-root-");
    let script = around.path().join("agent.sh");
    write(&script, "#!/bin/sh\necho started\n", 0o755);
    let elsewhere = install_dir("apart-from-the-root-");
    let apart = elsewhere.path().join("agent.sh");
    write(&apart, "#!/bin/sh\necho started\n", 0o755);

    for mode in MODES {
        let root = around.path().join(format!("sessions-{mode}"));
        fs::create_dir(&root).expect("mkdir");
        chmod(&root, 0o711);
        let inside = root.join("shared");
        fs::create_dir(&inside).expect("mkdir");
        for (need, problem) in [
            (around.path(), "contains the session root"),
            (inside.as_path(), "lies inside the session root"),
        ] {
            let agent = AgentCommand::new(apart.display().to_string()).needs(need);
            let builder = LocalRuntime::builder(agent)
                .root(&root)
                .installation(INSTALLATION)
                .sandbox(mode);
            let reason = config_error(builder.build(), "agent.needs", &format!("{mode}: build"));
            assert!(reason.contains(problem), "{mode}: {reason}");
        }

        // The program's own directory holds the root: in a sandbox, create refuses it.
        let agent = AgentCommand::new(script.display().to_string());
        let Some(runtime) = runtime(agent, &root, mode) else {
            continue;
        };
        let created = runtime
            .create(&identity("beside-root"), &CreateOptions::new())
            .await;
        if mode == SandboxMode::None {
            created.expect("plain mode shows nothing, so refuses nothing");
            continue;
        }
        let reason = config_error(created, "agent.command", &format!("{mode}: create"));
        assert!(
            reason.contains("the agent program's directory") && reason.contains("contains the session root"),
            "{mode}: {reason}"
        );
    }
}

/// `needs` naming a directory bubblewrap replaces with the session's own (`/tmp`, `/proc`,
/// `/dev`) is refused at create in both sandboxes, so a configuration means the same in each:
/// Landlock would otherwise grant the host's `/tmp`, and the agent would list every file there.
/// A need elsewhere is the control: it creates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_need_under_a_directory_the_sandbox_replaces_is_refused_in_every_sandbox() {
    let install = install_dir("host-private-needs-");
    let program = install.path().join("agent.sh");
    write(&program, "#!/bin/sh\necho started\n", 0o755);
    let library = install_dir("host-private-control-");
    for mode in [SandboxMode::Bubblewrap, SandboxMode::Landlock] {
        for private in ["/tmp", "/proc", "/dev"] {
            // Not under /tmp, which would contain the root: that is refused for another reason.
            let root = install_dir("host-private-root-");
            chmod(root.path(), 0o711);
            let agent = AgentCommand::new(program.display().to_string()).needs(private);
            let Some(runtime) = runtime(agent, root.path(), mode) else {
                break;
            };
            let created = runtime
                .create(&identity("host-private"), &CreateOptions::new())
                .await;
            let reason = config_error(created, "agent.needs", &format!("{mode}: needs {private}"));
            assert!(
                reason.contains(&format!("lies under {private}")),
                "{mode}: {reason}"
            );
        }
        let root = install_dir("host-private-root-");
        chmod(root.path(), 0o711);
        let agent = AgentCommand::new(program.display().to_string()).needs(library.path());
        let Some(runtime) = runtime(agent, root.path(), mode) else {
            continue;
        };
        let thread = identity("host-private-control");
        runtime
            .create(&thread, &CreateOptions::new())
            .await
            .unwrap_or_else(|e| panic!("{mode}: a need elsewhere creates: {e}"));
        runtime
            .close(&thread.id(), CloseReason::Ended)
            .await
            .expect("close");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_npm_installed_agent_needs_no_entry_in_every_mode() {
    // `npm install --global --prefix <prefix>` as npm lays it out: `bin/agent` links into the
    // package, whose dependencies are nested in its `node_modules` or hoisted beside it.
    let prefix = install_dir("npm-prefix-");
    let modules = prefix.path().join("lib/node_modules");
    let package = modules.join("pkg");
    for dir in [
        prefix.path().join("bin"),
        prefix.path().join("lib"),
        modules.clone(),
        package.clone(),
        package.join("bin"),
        package.join("node_modules"),
        package.join("node_modules/nested"),
        modules.join("hoisted"),
    ] {
        fs::create_dir(&dir).expect("mkdir");
        chmod(&dir, 0o755);
    }
    for dir in [
        &package,
        &package.join("node_modules/nested"),
        &modules.join("hoisted"),
    ] {
        write(&dir.join("package.json"), "{}\n", 0o644);
    }
    write(
        &package.join("bin/agent.sh"),
        "#!/bin/sh\nexec 2>&1\nhere=$(dirname \"$(readlink -f \"$0\")\")\n\
         . \"$here/../node_modules/nested/lib.sh\"\n. \"$here/../../hoisted/lib.sh\"\n\
         echo \"nested=$NESTED hoisted=$HOISTED\"\n",
        0o755,
    );
    write(
        &package.join("node_modules/nested/lib.sh"),
        "NESTED=found\n",
        0o644,
    );
    write(&modules.join("hoisted/lib.sh"), "HOISTED=found\n", 0o644);
    let command = prefix.path().join("bin/agent");
    std::os::unix::fs::symlink("../lib/node_modules/pkg/bin/agent.sh", &command).expect("symlink");
    for mode in MODES {
        let agent = AgentCommand::new(command.display().to_string()).env("PATH", agent_path(None));
        let Some(out) = output_of(agent, mode).await else {
            continue;
        };
        assert_eq!(out, "nested=found hoisted=found\n", "{mode}");
        // The same by name, on the agent's `PATH`.
        let agent = AgentCommand::new("agent").env("PATH", agent_path(Some(&prefix.path().join("bin"))));
        let out = output_of(agent, mode).await.expect("the mode worked above");
        assert_eq!(out, "nested=found hoisted=found\n", "{mode}: by name");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_virtual_environment_on_an_interpreter_outside_usr_runs_as_configured_in_every_mode() {
    // An interpreter outside /usr, as pyenv, uv or conda install one, and a virtual environment
    // made with it: its `bin/python` links to that interpreter.
    let system_python = fs::canonicalize("/usr/bin/python3").expect("/usr/bin/python3");
    let interpreter_dir = install_dir("interpreter-");
    let bin = interpreter_dir.path().join("bin");
    fs::create_dir(&bin).expect("mkdir");
    chmod(&bin, 0o755);
    let interpreter = bin.join(system_python.file_name().expect("a file name"));
    fs::copy(&system_python, &interpreter).expect("copy python");
    chmod(&interpreter, 0o755);
    let environments = install_dir("venv-");
    let venv = environments.path().join("venv");
    // Another test's fork may hold the copy's write descriptor until that child execs
    // (ETXTBSY): try again shortly, a bounded number of times.
    let mut attempts = 0;
    let made = loop {
        match std::process::Command::new(&interpreter)
            .args(["-m", "venv", "--without-pip"])
            .arg(&venv)
            .output()
        {
            Err(error) if error.kind() == std::io::ErrorKind::ExecutableFileBusy && attempts < 100 => {
                attempts += 1;
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            made => break made.expect("python -m venv"),
        }
    };
    assert!(made.status.success(), "python -m venv: {made:?}");
    assert!(
        fs::symlink_metadata(venv.join("bin/python"))
            .expect("bin/python")
            .file_type()
            .is_symlink(),
        "the environment's python links to its interpreter"
    );
    let site = std::process::Command::new(venv.join("bin/python"))
        .args(["-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
        .output()
        .expect("site-packages");
    let site = std::path::PathBuf::from(String::from_utf8_lossy(&site.stdout).trim());
    write(&site.join("invenv.py"), "WORD = 'found'\n", 0o644);
    let scripts = install_dir("venv-scripts-");
    let script = scripts.path().join("agent.py");
    write(
        &script,
        "import sys\nsys.stderr = sys.stdout\nimport invenv\nprint('venv=' + invenv.WORD)\n",
        0o644,
    );
    for mode in MODES {
        let agent = AgentCommand::new(venv.join("bin/python").display().to_string())
            .args([script.display().to_string()])
            .env("PATH", agent_path(None))
            .env("PYTHONDONTWRITEBYTECODE", "1");
        let Some(out) = output_of(agent, mode).await else {
            continue;
        };
        assert_eq!(out, "venv=found\n", "{mode}");
    }
}
