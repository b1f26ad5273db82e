//! The `oab-runtime` operator CLI, run as a program.

use std::process::Command;

fn oab_runtime() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_oab-runtime"));
    command.env("OAB_LOG", "error");
    command
}

fn write_config(dir: &std::path::Path, body: &str) -> std::path::PathBuf {
    let path = dir.join("config.toml");
    std::fs::write(&path, body).expect("write config");
    path
}

/// A configuration for the plain local runtime under `dir`, and the runtime's root.
fn plain_config(dir: &std::path::Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let root = dir.join("sessions");
    let config = write_config(
        dir,
        &format!("[session_runtime]\ninstallation = \"cli\"\n[session_runtime.local]\nstorage = \"per-session\"\nsandbox = \"none\"\nroot = {:?}\n", root),
    );
    (config, root)
}

/// `oab-runtime run` for `thread` (with `agent` as its argv, if any), fed one ACP `initialize`
/// line and then EOF on stdin. It must end by itself within a minute: a hang fails the test.
fn run_with_one_line(config: &std::path::Path, thread: &str, agent: &[&str]) -> std::process::Output {
    let mut command = oab_runtime();
    command
        .arg("--config")
        .arg(config)
        .args(["run", "--platform", "discord", "--thread", thread]);
    if !agent.is_empty() {
        command.arg("--").args(agent);
    }
    let mut run = command
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run");
    {
        use std::io::Write;
        let mut stdin = run.stdin.take().expect("stdin");
        stdin
            .write_all(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"initialize\",\"params\":{\"protocolVersion\":1}}\n")
            .expect("write");
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while run.try_wait().expect("run status").is_none() {
        if std::time::Instant::now() >= deadline {
            let _ = run.kill();
            panic!(
                "run did not end after its stdin closed: {:?}",
                run.wait_with_output()
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    run.wait_with_output().expect("run output")
}

/// `oab-runtime ls` with `config`: its standard output.
fn ls(config: &std::path::Path) -> String {
    let ls = oab_runtime()
        .arg("--config")
        .arg(config)
        .arg("ls")
        .output()
        .expect("ls");
    String::from_utf8_lossy(&ls.stdout).into_owned()
}

#[test]
fn verify_passes_for_the_default_runtime() {
    let output = oab_runtime().arg("verify").output().expect("run oab-runtime");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "verify must pass with the default (sandboxed) runtime:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("PASSED"), "{stdout}");
    assert!(stdout.contains(" 0 leaked"), "{stdout}");
}

/// Landlock mode passes too (its shared input shown where it is, since Landlock cannot move a
/// file), and the report names its isolation as what it is: access control, not namespaces.
#[test]
fn verify_in_landlock_mode_holds_files_and_names_the_loopback_it_shares() {
    let helper = std::path::Path::new(env!("CARGO_BIN_EXE_oab-runtime")).with_file_name("oab-landlock-exec");
    assert!(
        helper.exists(),
        "{} is missing: cargo build -p runtime-local --bin oab-landlock-exec (cargo test --workspace builds it)",
        helper.display()
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let config = write_config(
        dir.path(),
        "[session_runtime.local]\nstorage = \"per-session\"\nsandbox = \"landlock\"\n",
    );
    let output = oab_runtime()
        .arg("--config")
        .arg(&config)
        .arg("verify")
        .output()
        .expect("run oab-runtime");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    // Landlock gives a session no network namespace of its own: the sessions share the host's
    // loopback, which verify reports (both directions) and fails on; nothing else leaks, and the
    // abstract sockets are scoped.
    assert_eq!(
        output.status.code(),
        Some(1),
        "a shared loopback fails verify:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains(" 2 leaked"), "{stdout}");
    let leaked: Vec<&str> = stdout.lines().filter(|l| l.contains("LEAKED")).collect();
    assert_eq!(leaked.len(), 2, "{stdout}");
    assert!(leaked.iter().all(|l| l.contains("connect-loopback")), "{stdout}");
    assert!(stderr.contains("isolation level access-control"), "{stderr}");
    assert!(
        stderr.contains("network = \"host\" (landlock gives a session no network namespace of its own)"),
        "verify says what the sessions share:\n{stderr}"
    );
}

#[test]
fn verify_fails_and_names_the_leaks_in_plain_mode() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = write_config(
        dir.path(),
        "[session_runtime.local]\nstorage = \"per-session\"\nsandbox = \"none\"\n",
    );
    let output = oab_runtime()
        .arg("--config")
        .arg(&config)
        .arg("verify")
        .output()
        .expect("run oab-runtime");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(
        output.status.code(),
        Some(1),
        "plain mode must fail verify:\n{stdout}"
    );
    assert!(stdout.contains("FAILED"), "{stdout}");
    assert!(
        stdout.contains("LEAKED"),
        "the report must name the probes that leaked:\n{stdout}"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("isolates nothing"),
        "plain mode must say it isolates nothing:\n{stderr}"
    );
}

#[test]
fn bad_arguments_and_configs_are_clear_errors() {
    let dir = tempfile::tempdir().expect("temp dir");
    let bad_id = oab_runtime()
        .args(["status", "not-a-session-id"])
        .output()
        .expect("run");
    assert!(!bad_id.status.success());
    assert!(
        String::from_utf8_lossy(&bad_id.stderr).contains("session id"),
        "{bad_id:?}"
    );

    let config = write_config(dir.path(), "[session_runtime.local]\nsandbx = \"none\"\n");
    let bad_key = oab_runtime()
        .arg("--config")
        .arg(&config)
        .arg("ls")
        .output()
        .expect("run");
    assert!(!bad_key.status.success());
    assert!(
        String::from_utf8_lossy(&bad_key.stderr).contains("session_runtime.local.sandbx"),
        "the error must name the key: {bad_key:?}"
    );

    let unknown = oab_runtime().arg("fly").output().expect("run");
    assert_eq!(
        unknown.status.code(),
        Some(2),
        "clap reports usage errors with exit code 2"
    );
}

#[test]
fn ls_status_suspend_close_and_gc_manage_a_session() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (config, root) = plain_config(dir.path());
    // A session made by `run`, fed one ACP line on stdin.
    let output = run_with_one_line(&config, "42", &[]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{output:?}");
    assert!(
        stdout.contains("\"id\":1") && stdout.contains("protocolVersion"),
        "the agent answered: {stdout}"
    );

    let listing = ls(&config);
    let line = listing
        .lines()
        .find(|l| l.contains("suspended"))
        .unwrap_or_else(|| panic!("{listing}"));
    let id = line.split_whitespace().next().expect("id column").to_owned();
    assert_eq!(id.len(), 20, "{listing}");

    let status = oab_runtime()
        .arg("--config")
        .arg(&config)
        .args(["status", &id])
        .output()
        .expect("status");
    let json: serde_json::Value = serde_json::from_slice(&status.stdout).expect("status is JSON");
    assert_eq!(json["state"], "suspended");
    assert_eq!(json["suspend_reason"], "shutdown");

    let close = oab_runtime()
        .arg("--config")
        .arg(&config)
        .args(["close", &id, "--reason", "reset"])
        .output()
        .expect("close");
    assert!(close.status.success(), "{close:?}");
    assert!(!root.join(&id).exists(), "reset deletes the storage");
    let gc = oab_runtime()
        .arg("--config")
        .arg(&config)
        .arg("gc")
        .output()
        .expect("gc");
    assert!(gc.status.success(), "{gc:?}");
    assert!(
        String::from_utf8_lossy(&gc.stdout).contains("killed workers:    0"),
        "{gc:?}"
    );
}

#[test]
fn run_suspends_at_stdin_eof_even_when_the_agent_ignores_eof() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (config, _root) = plain_config(dir.path());
    // Real agents keep running when their stdin closes; so does this one.
    let agent = env!("CARGO_BIN_EXE_oab-runtime");
    let output = run_with_one_line(&config, "eof", &[agent, "__acp-test-agent", "--ignore-stdin-eof"]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert!(output.status.success(), "{stderr}");
    assert!(stdout.contains("\"id\":1"), "the agent answered first: {stdout}");
    assert!(stderr.contains("suspended"), "{stderr}");
    let listing = ls(&config);
    assert!(
        listing.lines().any(|l| l.contains("suspended")),
        "the session is suspended, its worker stopped: {listing}"
    );
}

/// `oab-runtime run` for `thread` with `agent` as its argv, its three standard streams piped.
fn spawn_run(config: &std::path::Path, thread: &str, agent: &[&str]) -> std::process::Child {
    oab_runtime()
        .arg("--config")
        .arg(config)
        .args(["run", "--platform", "discord", "--thread", thread, "--"])
        .args(agent)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run")
}

/// Waits for `run` to end by itself; a hang (a minute) fails the test.
fn wait_for_end(mut run: std::process::Child, why: &str) -> std::process::Output {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while run.try_wait().expect("run status").is_none() {
        if std::time::Instant::now() >= deadline {
            let _ = run.kill();
            panic!("{why}: run did not end: {:?}", run.wait_with_output());
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    run.wait_with_output().expect("run output")
}

/// The state of the only session in `ls`.
fn only_session_state(config: &std::path::Path) -> String {
    let listing = ls(config);
    let rows: Vec<&str> = listing.lines().skip(1).collect();
    assert_eq!(rows.len(), 1, "{listing}");
    rows[0]
        .split_whitespace()
        .nth(1)
        .expect("state column")
        .to_owned()
}

#[test]
fn run_ends_with_its_agent_and_exits_with_its_status() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (config, _root) = plain_config(dir.path());
    // stdin stays open: `run` must not wait for it once its agent is gone.
    let run = spawn_run(&config, "exit-3", &["/bin/sh", "-c", "echo bye; exit 3"]);
    let output = wait_for_end(run, "the agent exited");
    assert_eq!(output.status.code(), Some(3), "{output:?}");
    assert_eq!(String::from_utf8_lossy(&output.stdout), "bye\n");
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("exited with code 3"),
        "{output:?}"
    );
    assert_eq!(only_session_state(&config), "suspended");

    let run = spawn_run(&config, "exit-0", &["/bin/sh", "-c", "exit 0"]);
    let output = wait_for_end(run, "the agent exited cleanly");
    assert_eq!(output.status.code(), Some(0), "a clean end is 0: {output:?}");
}

#[test]
fn run_of_a_missing_agent_fails_with_enoent() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (config, _root) = plain_config(dir.path());
    for agent in ["no-such-agent-on-path", "/no/such/agent"] {
        let run = spawn_run(&config, agent, &[agent]);
        let output = wait_for_end(run, "the agent cannot start");
        assert_eq!(output.status.code(), Some(127), "{output:?}");
        assert!(
            String::from_utf8_lossy(&output.stderr).contains("No such file or directory"),
            "{output:?}"
        );
    }
}

#[test]
fn run_passes_every_byte_of_stdin_to_the_agent() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (config, _root) = plain_config(dir.path());
    let mut run = spawn_run(&config, "bytes", &["/bin/cat"]);
    // Not UTF-8 in the middle: the lines after it must arrive too.
    let input: &[u8] = b"{\"first\":1}\n{\"bad\":\"\xff\xfe\"}\n{\"last\":3}\n";
    {
        use std::io::Write;
        let mut stdin = run.stdin.take().expect("stdin");
        stdin.write_all(input).expect("write");
    }
    let output = wait_for_end(run, "cat ends at stdin EOF");
    assert_eq!(output.stdout, input, "{output:?}");
    assert_eq!(output.status.code(), Some(0), "{output:?}");
}

/// The pid in `run`'s `attached: worker pid:<pid>@<start>/g<n>` line, once it was printed.
fn attached_worker(stderr: &mut impl std::io::BufRead) -> (u32, u64) {
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            stderr.read_line(&mut line).expect("stderr") > 0,
            "run ended before attaching"
        );
        if let Some(rest) = line.split("worker pid:").nth(1) {
            let (pid, rest) = rest.split_once('@').expect("pid@start");
            let start = rest.split('/').next().expect("start time");
            return (pid.parse().expect("pid"), start.parse().expect("start time"));
        }
    }
}

/// Whether the process `pid` with start time `start` still runs (not a zombie).
fn still_runs(pid: u32, start: u64) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let fields: Vec<&str> = stat.rsplit_once(") ").expect("stat").1.split(' ').collect();
    fields[0] != "Z" && fields[19].parse::<u64>().ok() == Some(start)
}

#[test]
fn run_suspends_on_term_hup_and_int_and_leaves_no_agent() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (config, _root) = plain_config(dir.path());
    let agent = env!("CARGO_BIN_EXE_oab-runtime");
    for (signal, number) in [("TERM", 15), ("HUP", 1), ("INT", 2)] {
        let mut run = spawn_run(
            &config,
            "signals",
            &[agent, "__acp-test-agent", "--ignore-stdin-eof"],
        );
        let mut stderr = std::io::BufReader::new(run.stderr.take().expect("stderr"));
        let (pid, start) = attached_worker(&mut stderr);
        let killed = Command::new("kill")
            .args([format!("-{signal}"), run.id().to_string()])
            .status()
            .expect("kill");
        assert!(killed.success());
        // stdin stays open: the signal alone must end `run`.
        let output = wait_for_end(run, signal);
        assert_eq!(
            output.status.code(),
            Some(128 + number),
            "SIG{signal}: {output:?}"
        );
        assert_eq!(only_session_state(&config), "suspended", "SIG{signal}");
        assert!(
            !still_runs(pid, start),
            "SIG{signal} left the agent {pid} running"
        );
    }
}

#[test]
fn reading_commands_write_nothing_and_bad_roots_are_refused_untouched() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("temp dir");
    let (config, root) = plain_config(dir.path());
    let listing = oab_runtime()
        .arg("--config")
        .arg(&config)
        .arg("ls")
        .output()
        .expect("ls");
    assert!(listing.status.success(), "{listing:?}");
    let status = oab_runtime()
        .arg("--config")
        .arg(&config)
        .args(["status", "aaaaaaaaaaaaaaaaaaaa"])
        .output()
        .expect("status");
    assert!(!status.status.success(), "{status:?}");
    assert!(!root.exists(), "ls and status must not create the root");

    let shared = dir.path().join("shared");
    std::fs::create_dir(&shared).expect("mkdir");
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).expect("chmod");
    for (bad, why) in [
        (std::path::Path::new("/"), "filesystem root"),
        (std::path::Path::new("/tmp"), "system directory"),
        (shared.as_path(), "every user may write"),
    ] {
        let before = std::fs::metadata(bad).expect("meta").permissions().mode();
        let config = write_config(
            dir.path(),
            &format!(
                "[session_runtime.local]\nstorage = \"per-session\"\nsandbox = \"none\"\nroot = {bad:?}\n"
            ),
        );
        for command in [
            &["ls"][..],
            &["run", "--platform", "p", "--thread", "t", "--", "/bin/true"],
        ] {
            let output = oab_runtime()
                .arg("--config")
                .arg(&config)
                .args(command)
                .stdin(std::process::Stdio::null())
                .output()
                .expect("run");
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert!(!output.status.success(), "{bad:?} {command:?}: {output:?}");
            assert!(
                stderr.contains("session_runtime.local.root") && stderr.contains(why),
                "{bad:?} {command:?}: {stderr}"
            );
        }
        let after = std::fs::metadata(bad).expect("meta").permissions().mode();
        assert_eq!(before, after, "the mode of {bad:?} must not change");
    }
}

#[test]
fn closing_a_session_that_never_existed_says_so() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (config, _root) = plain_config(dir.path());
    let close = oab_runtime()
        .arg("--config")
        .arg(&config)
        .args(["close", "aaaaaaaaaaaaaaaaaaaa", "--reason", "ended"])
        .output()
        .expect("close");
    let stdout = String::from_utf8_lossy(&close.stdout);
    assert!(close.status.success(), "closing is idempotent: {close:?}");
    assert!(stdout.contains("nothing to close"), "{stdout}");
    assert!(!stdout.contains("closed "), "{stdout}");
}

#[test]
fn errors_show_their_os_cause() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("a-file");
    std::fs::write(&file, "").expect("write");
    let config = write_config(
        dir.path(),
        &format!(
            "[session_runtime.local]\nstorage = \"per-session\"\nsandbox = \"none\"\nroot = {:?}\n",
            file.join("sessions")
        ),
    );
    let output = oab_runtime()
        .arg("--config")
        .arg(&config)
        .args(["run", "--platform", "p", "--thread", "t", "--", "/bin/true"])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run");
    assert!(!output.status.success(), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("Not a directory (os error 20)"),
        "{output:?}"
    );
}

#[test]
fn a_grace_without_end_is_refused_naming_the_key() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = write_config(
        dir.path(),
        "[session_runtime.local]\nstorage = \"per-session\"\nsandbox = \"none\"\nterminate_grace = \"100000000y\"\n",
    );
    let output = oab_runtime()
        .arg("--config")
        .arg(&config)
        .arg("ls")
        .output()
        .expect("ls");
    assert!(!output.status.success(), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("session_runtime.local.terminate_grace"),
        "{output:?}"
    );
}

#[test]
fn a_cpu_limit_the_kernel_cannot_represent_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = write_config(
        dir.path(),
        "[session_runtime.local]\nstorage = \"per-session\"\nsandbox = \"none\"\n[session_runtime.local.limits]\ncpu = 1e308\n",
    );
    let output = oab_runtime()
        .arg("--config")
        .arg(&config)
        .arg("ls")
        .output()
        .expect("ls");
    assert!(!output.status.success(), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("session_runtime.local.limits.cpu"),
        "{output:?}"
    );
}

#[test]
fn nothing_the_agent_detaches_outlives_run_even_without_cgroups() {
    use std::io::BufRead;
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let home = dir.path().join("home");
    std::fs::create_dir(&home).expect("mkdir");
    let config = write_config(
        dir.path(),
        &format!(
            "[session_runtime]\ninstallation = \"cli\"\n[session_runtime.local]\nstorage = \"per-session\"\nsandbox = \"none\"\nroot = {:?}\n",
            home.join("sessions")
        ),
    );
    // As root, `run` would put the agent in a cgroup and kill what is left in it; as another
    // user it cannot, which is the case this test is about.
    let mut command = if rustix::process::geteuid().is_root() {
        std::os::unix::fs::chown(&home, Some(65534), Some(65534)).expect("chown");
        let mut command = Command::new("setpriv");
        command.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"]);
        command.arg(env!("CARGO_BIN_EXE_oab-runtime"));
        command
    } else {
        Command::new(env!("CARGO_BIN_EXE_oab-runtime"))
    };
    // A grandchild in a session of its own, with no environment (so no worker marker), whose
    // parent exits at once (so it is no descendant of the agent), then the agent waits.
    let script = "(setsid env -i /bin/sleep 300 & echo $!); exec /bin/sleep 300";
    let mut run = command
        .env("OAB_LOG", "error")
        .env("HOME", &home)
        .arg("--config")
        .arg(&config)
        .args([
            "run",
            "--platform",
            "p",
            "--thread",
            "orphan",
            "--",
            "/bin/sh",
            "-c",
            script,
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run");
    let mut stdout = std::io::BufReader::new(run.stdout.take().expect("stdout"));
    let mut line = String::new();
    stdout.read_line(&mut line).expect("the grandchild's pid");
    let Ok(pid) = line.trim().parse::<u32>() else {
        panic!("no pid from the agent: {line:?} {:?}", run.wait_with_output());
    };
    let start = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .expect("the grandchild runs")
        .rsplit_once(") ")
        .expect("stat")
        .1
        .split(' ')
        .nth(19)
        .expect("start time")
        .parse::<u64>()
        .expect("start time");
    let killed = Command::new("kill")
        .args(["-TERM", &run.id().to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    let output = wait_for_end(run, "SIGTERM");
    let survived = still_runs(pid, start);
    if survived {
        let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
    }
    assert!(
        !survived,
        "the detached grandchild {pid} outlived run: {output:?}"
    );
    assert_eq!(output.status.code(), Some(143), "{output:?}");
}

#[test]
fn run_reports_an_agent_killed_by_its_memory_limit_as_out_of_memory() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipping: memory limits need a root broker here");
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let config = write_config(
        dir.path(),
        &format!(
            "[session_runtime]\ninstallation = \"cli\"\n[session_runtime.local]\nstorage = \"per-session\"\nsandbox = \"none\"\nroot = {:?}\n\
             [session_runtime.local.limits]\nmemory = \"32Mi\"\n",
            dir.path().join("sessions")
        ),
    );
    // `tail` keeps all of an endless line in memory.
    let run = spawn_run(&config, "oom", &["/usr/bin/tail", "/dev/zero"]);
    let output = wait_for_end(run, "the agent was killed by its memory limit");
    assert_eq!(output.status.code(), Some(137), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("exceeding its memory limit"),
        "{output:?}"
    );
}

/// `-- ARGV` keeps `[agent]`'s environment rules, and `--env` adds to them: `KEY=VALUE` sets a
/// variable, `KEY` passes the caller's value through; nothing else of the caller's reaches it.
#[test]
fn run_keeps_the_configured_environment_with_an_argv_and_adds_env_flags() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path().join("sessions");
    let config = write_config(
        dir.path(),
        &format!(
            "[agent]\ncommand = \"/bin/false\"\nenv = {{ FROM_CONFIG = \"configured\" }}\ninherit_env = [\"OAB_TEST_INHERITED\"]\n\
             [session_runtime]\ninstallation = \"cli\"\n[session_runtime.local]\nstorage = \"per-session\"\nsandbox = \"none\"\nroot = {root:?}\n"
        ),
    );
    let script = "echo \"config=$FROM_CONFIG inherited=$OAB_TEST_INHERITED set=$FROM_FLAG passed=$OAB_TEST_PASSED leaked=$OAB_TEST_LEAKED\"";
    let output = oab_runtime()
        .arg("--config")
        .arg(&config)
        .args(["run", "--platform", "discord", "--thread", "env"])
        .args(["--env", "FROM_FLAG=flagged", "--env", "OAB_TEST_PASSED"])
        .args(["--", "/bin/sh", "-c", script])
        .env("OAB_TEST_INHERITED", "inherited")
        .env("OAB_TEST_PASSED", "passed")
        .env("OAB_TEST_LEAKED", "leaked")
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(
        stdout.trim(),
        "config=configured inherited=inherited set=flagged passed=passed leaked=",
        "{output:?}"
    );
    let refused = oab_runtime()
        .arg("--config")
        .arg(&config)
        .args([
            "run",
            "--platform",
            "discord",
            "--thread",
            "env2",
            "--env",
            "=value",
            "--",
            "/bin/true",
        ])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run");
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("--env"),
        "{refused:?}"
    );
}

/// The working directory in `run`'s `attached: ... cwd <dir>; ...` line, read from `stderr`.
fn attached_cwd(stderr: &mut impl std::io::BufRead) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        let read = stderr.read_line(&mut line).expect("stderr");
        assert!(read > 0, "run ended before it attached");
        if let Some(rest) = line.split_once(", cwd ").map(|(_, rest)| rest) {
            return rest.split_once(';').expect("`; ` after the cwd").0.to_owned();
        }
    }
}

/// `oab-runtime run` in plain mode with `flags` before `-- agent`, fed `input` and then EOF;
/// returns the session's working directory as `run` announced it, and how `run` ended.
fn run_fed(flags: &[&str], agent: &[&str], input: &[u8]) -> (String, std::process::Output) {
    use std::io::Write;
    let dir = tempfile::tempdir().expect("temp dir");
    let (config, _root) = plain_config(dir.path());
    let mut run = oab_runtime()
        .arg("--config")
        .arg(&config)
        .args(["run", "--platform", "discord", "--thread", "cwd"])
        .args(flags)
        .arg("--")
        .args(agent)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run");
    let mut stderr = std::io::BufReader::new(run.stderr.take().expect("stderr"));
    let cwd = attached_cwd(&mut stderr);
    run.stdin.take().expect("stdin").write_all(input).expect("write");
    let output = wait_for_end(run, "cat ends at stdin EOF");
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut rest).expect("stderr");
    (
        cwd,
        std::process::Output {
            stderr: rest.into_bytes(),
            ..output
        },
    )
}

#[test]
fn run_gives_session_new_and_load_the_session_working_directory() {
    let new = "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"session/new\",\"params\":{\"cwd\":\"/home/someone/checkout\",\"mcpServers\":[]}}\n";
    let other = "{ \"id\" : 2, \"method\":\"session/prompt\",\"params\":{\"cwd\":\"/home/someone\"}}\n";
    let load = "{\"jsonrpc\":\"2.0\",\"id\":3,\"method\":\"session/load\",\"params\":{\"sessionId\":\"s\",\"cwd\":\"checkout\",\"mcpServers\":[]}}\n";
    let not_utf8: &[u8] = b"{\"method\":\"session/new\",\"params\":{\"cwd\":\"\xff\"}}\n";
    let input = [
        new.as_bytes(),
        other.as_bytes(),
        b"not json\n",
        load.as_bytes(),
        not_utf8,
    ]
    .concat();

    let (cwd, output) = run_fed(&[], &["/bin/cat"], &input);
    assert!(cwd.ends_with("/workspace"), "{cwd}");
    let lines: Vec<&[u8]> = output.stdout.split_inclusive(|b| *b == b'\n').collect();
    assert_eq!(lines.len(), 5, "{output:?}");
    for (index, expected_id) in [(0, 1), (3, 3)] {
        let sent: serde_json::Value = serde_json::from_slice(lines[index]).expect("JSON");
        assert_eq!(sent["params"]["cwd"], cwd.as_str(), "{output:?}");
        assert_eq!(sent["id"], expected_id);
        assert_eq!(sent["params"]["mcpServers"], serde_json::json!([]));
    }
    assert_eq!(lines[1], other.as_bytes(), "another method passes byte for byte");
    assert_eq!(lines[2], b"not json\n");
    assert_eq!(lines[4], not_utf8, "not JSON (not UTF-8): byte for byte");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        stderr
            .matches("replaced with the session's working directory")
            .count(),
        1,
        "said once: {stderr}"
    );
    assert_eq!(output.status.code(), Some(0), "{output:?}");

    let (_, kept) = run_fed(&["--keep-cwd"], &["/bin/cat"], &input);
    assert_eq!(kept.stdout, input, "--keep-cwd: {kept:?}");
    assert!(
        !String::from_utf8_lossy(&kept.stderr).contains("replaced"),
        "{kept:?}"
    );
}

#[test]
fn the_acp_test_agent_works_in_the_session_directory_it_was_not_told() {
    use std::io::{BufRead, Write};
    let dir = tempfile::tempdir().expect("temp dir");
    let (config, root) = plain_config(dir.path());
    let mut run = oab_runtime()
        .arg("--config")
        .arg(&config)
        .args(["run", "--platform", "discord", "--thread", "agent-cwd"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run");
    let mut stderr = std::io::BufReader::new(run.stderr.take().expect("stderr"));
    let cwd = attached_cwd(&mut stderr);
    let mut stdin = run.stdin.take().expect("stdin");
    let mut stdout = std::io::BufReader::new(run.stdout.take().expect("stdout"));
    let mut answer = |id: u64| loop {
        let mut line = String::new();
        assert!(stdout.read_line(&mut line).expect("stdout") > 0, "no answer {id}");
        let message: serde_json::Value = serde_json::from_str(&line).expect("JSON");
        if message["id"] == id {
            return message;
        }
    };
    // A host path the agent cannot use, then a relative one it refuses: neither reaches it.
    writeln!(
        stdin,
        "{{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"session/new\",\"params\":{{\"cwd\":\"/nonexistent/checkout\",\"mcpServers\":[]}}}}"
    )
    .expect("write");
    let created = answer(1);
    let acp_session = created["result"]["sessionId"]
        .as_str()
        .unwrap_or_else(|| panic!("{created}"))
        .to_owned();
    writeln!(
        stdin,
        "{{\"jsonrpc\":\"2.0\",\"id\":2,\"method\":\"session/load\",\"params\":{{\"sessionId\":\"{acp_session}\",\"cwd\":\"checkout\",\"mcpServers\":[]}}}}"
    )
    .expect("write");
    let loaded = answer(2);
    assert!(loaded.get("error").is_none(), "{loaded}");
    drop(stdin);
    let output = wait_for_end(run, "the test agent ends at stdin EOF");
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    // The test agent records each new session's cwd under its HOME.
    let session_dir = std::path::Path::new(&cwd)
        .parent()
        .expect("the session's directory");
    assert_eq!(session_dir.parent(), Some(root.as_path()));
    let recorded = std::fs::read_to_string(session_dir.join("home/.acp-test-agent").join(&acp_session))
        .expect("the agent's record of the session");
    assert_eq!(recorded, cwd);
}

#[test]
fn run_shows_the_agent_what_agent_needs_lists_in_every_mode() {
    use std::os::unix::fs::PermissionsExt;
    let chmod = |path: &std::path::Path, mode: u32| {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod")
    };
    // Outside /tmp, which a bubblewrap sandbox replaces with the session's own: not the target
    // directory either, which is under /tmp when the checkout is.
    let install = tempfile::Builder::new()
        .prefix("oab-cli-agent-")
        .tempdir_in("/var/tmp")
        .expect("an installation directory");
    chmod(install.path(), 0o755);
    for (dir, file, text, mode) in [
        (
            "bin",
            "agent.sh",
            "#!/bin/sh\nexec 2>&1\n. \"$LIB/words.sh\"\necho \"$WORD\"\n",
            0o755,
        ),
        ("lib", "words.sh", "WORD=listed\n", 0o644),
    ] {
        let dir = install.path().join(dir);
        std::fs::create_dir(&dir).expect("mkdir");
        chmod(&dir, 0o755);
        std::fs::write(dir.join(file), text).expect("write");
        chmod(&dir.join(file), mode);
    }
    let lib = install.path().join("lib");
    for sandbox in ["none", "bubblewrap", "landlock"] {
        let dir = tempfile::tempdir().expect("temp dir");
        chmod(dir.path(), 0o711);
        let config = write_config(
            dir.path(),
            &format!(
                "[agent]\ncommand = {:?}\nenv = {{ LIB = {:?} }}\nneeds = [{:?}]\n\
                 [session_runtime]\ninstallation = \"cli\"\n\
                 [session_runtime.local]\nstorage = \"per-session\"\nsandbox = \"{sandbox}\"\nroot = {:?}\n",
                install.path().join("bin/agent.sh"),
                lib,
                lib,
                dir.path().join("sessions"),
            ),
        );
        let output = run_with_one_line(&config, "needs", &[]);
        assert_eq!(
            String::from_utf8_lossy(&output.stdout),
            "listed\n",
            "{sandbox}: {output:?}"
        );
        assert_eq!(output.status.code(), Some(0), "{sandbox}: {output:?}");
    }
}

#[test]
fn ls_shows_a_session_whose_start_failed() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (config, _root) = plain_config(dir.path());
    // The control: a session whose agent started shows no failure.
    let started = run_with_one_line(&config, "started", &[]);
    assert!(started.status.success(), "{started:?}");
    let missing = run_with_one_line(&config, "never-started", &["/no/such/dir/agent"]);
    assert_eq!(missing.status.code(), Some(127), "{missing:?}");
    let listing = ls(&config);
    let failed: Vec<&str> = listing.lines().filter(|l| l.contains("start failed")).collect();
    assert_eq!(failed.len(), 1, "only the session that never started:\n{listing}");
    let columns: Vec<&str> = failed[0].split_whitespace().collect();
    assert_eq!(columns[1..3], ["created", "0"], "{listing}");
    assert!(
        failed[0].contains("/no/such/dir/agent"),
        "the error names the agent:\n{listing}"
    );
}

/// `run -- ARGV` keeps `[agent]`'s `env`, `inherit_env` and `needs` when `[agent]` names no
/// `command` (the README and `run --help` say it keeps them); `run` without an argv then has no
/// command to start and refuses, naming `agent.command`.
#[test]
fn run_with_an_argv_keeps_an_agent_section_without_a_command() {
    use std::os::unix::fs::PermissionsExt;
    let chmod = |path: &std::path::Path, mode: u32| {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod")
    };
    // Outside /tmp, which a bubblewrap sandbox replaces with the session's own.
    let install = tempfile::Builder::new()
        .prefix("oab-cli-rules-")
        .tempdir_in("/var/tmp")
        .expect("an installation directory");
    chmod(install.path(), 0o755);
    let lib = install.path().join("lib");
    std::fs::create_dir(&lib).expect("mkdir");
    chmod(&lib, 0o755);
    std::fs::write(lib.join("words.sh"), "WORD=listed\n").expect("write");
    chmod(&lib.join("words.sh"), 0o644);
    for sandbox in ["none", "bubblewrap", "landlock"] {
        let dir = tempfile::tempdir().expect("temp dir");
        chmod(dir.path(), 0o711);
        let config = write_config(
            dir.path(),
            &format!(
                "[agent]\nenv = {{ LIB = {lib:?} }}\ninherit_env = [\"OAB_TEST_INHERITED\"]\nneeds = [{lib:?}]\n\
                 [session_runtime]\ninstallation = \"cli\"\n\
                 [session_runtime.local]\nstorage = \"per-session\"\nsandbox = \"{sandbox}\"\nroot = {:?}\n",
                dir.path().join("sessions"),
            ),
        );
        let output = oab_runtime()
            .arg("--config")
            .arg(&config)
            .args(["run", "--platform", "discord", "--thread", "rules", "--"])
            .args([
                "/bin/sh",
                "-c",
                ". \"$LIB/words.sh\" && echo \"$WORD $OAB_TEST_INHERITED\"",
            ])
            .env("OAB_TEST_INHERITED", "inherited")
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run");
        assert_eq!(
            String::from_utf8_lossy(&output.stdout),
            "listed inherited\n",
            "{sandbox}: {output:?}"
        );
        assert_eq!(output.status.code(), Some(0), "{sandbox}: {output:?}");

        let refused = oab_runtime()
            .arg("--config")
            .arg(&config)
            .args(["run", "--platform", "discord", "--thread", "no-command"])
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run");
        assert!(!refused.status.success(), "{sandbox}: {refused:?}");
        assert!(
            String::from_utf8_lossy(&refused.stderr).contains("agent.command"),
            "{sandbox}: {refused:?}"
        );
    }
}

/// A `run` killed by SIGKILL cannot suspend its session itself: its guard does, so no agent is
/// left running (nor anything it started) and the session is recorded `suspended`, in every
/// mode (bubblewrap's `--die-with-parent` ended its agent before; plain and Landlock agents ran
/// on until `gc`).
#[test]
fn a_run_killed_by_sigkill_leaves_no_agent_running_in_any_mode() {
    use std::io::BufRead;
    use std::os::unix::fs::PermissionsExt;
    for sandbox in ["none", "bubblewrap", "landlock"] {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).expect("chmod");
        let config = write_config(
            dir.path(),
            &format!(
                "[session_runtime]\ninstallation = \"cli\"\n\
                 [session_runtime.local]\nstorage = \"per-session\"\nsandbox = \"{sandbox}\"\nroot = {:?}\n",
                dir.path().join("sessions"),
            ),
        );
        // The agent starts a child and prints its pid (a host pid without a pid namespace).
        let mut run = spawn_run(
            &config,
            "sigkill",
            &["/bin/sh", "-c", "sleep 300 & echo $!; wait"],
        );
        let mut stderr = std::io::BufReader::new(run.stderr.take().expect("stderr"));
        let (pid, start) = attached_worker(&mut stderr);
        let mut stdout = std::io::BufReader::new(run.stdout.take().expect("stdout"));
        let mut line = String::new();
        stdout.read_line(&mut line).expect("the child's pid");
        let child: u32 = line.trim().parse().expect("a pid");
        let child_start = (sandbox != "bubblewrap").then(|| {
            std::fs::read_to_string(format!("/proc/{child}/stat"))
                .expect("the child runs")
                .rsplit_once(") ")
                .expect("stat")
                .1
                .split(' ')
                .nth(19)
                .expect("start time")
                .parse::<u64>()
                .expect("start time")
        });
        run.kill().expect("SIGKILL run");
        let _ = run.wait();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let left = || {
            still_runs(pid, start) || child_start.is_some_and(|child_start| still_runs(child, child_start))
        };
        while left() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let survived = left();
        if survived {
            for (pid, start) in [(pid, Some(start)), (child, child_start)] {
                if start.is_some_and(|start| still_runs(pid, start)) {
                    let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
                }
            }
        }
        if survived {
            let mut rest = String::new();
            let _ = std::io::Read::read_to_string(&mut stderr, &mut rest);
            panic!("{sandbox}: the agent {pid} (or its child {child}) outlived a SIGKILLed run: {rest}");
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while only_session_state(&config) != "suspended" && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        assert_eq!(only_session_state(&config), "suspended", "{sandbox}");
        // What the guard said reaches run's stderr, which it inherited.
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut rest);
        assert!(rest.contains("suspending it"), "{sandbox}: {rest}");
    }
}

/// The lock of a `run` killed a moment ago can outlive it (held by its last exiting thread, or a
/// process it was starting): its guard waits for that lock instead of failing on it. Here a
/// `flock` queued behind `run`'s lock takes it as `run` dies and holds it for a second.
#[test]
fn a_killed_runs_guard_waits_for_the_lock_its_broker_left() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().expect("temp dir");
    let (config, root) = plain_config(dir.path());
    let mut run = spawn_run(
        &config,
        "left-lock",
        &["/bin/sh", "-c", "echo up; exec sleep 300"],
    );
    let mut stderr = std::io::BufReader::new(run.stderr.take().expect("stderr"));
    let (pid, start) = attached_worker(&mut stderr);
    let mut stdout = std::io::BufReader::new(run.stdout.take().expect("stdout"));
    let mut line = String::new();
    stdout.read_line(&mut line).expect("the agent is up");
    let session = std::fs::read_dir(&root)
        .expect("the root")
        .flatten()
        .find(|entry| entry.path().join("lock").exists())
        .expect("the session's directory")
        .path();
    let mut holder = Command::new("flock")
        .arg(session.join("lock"))
        .args(["sleep", "1"])
        .spawn()
        .expect("flock");
    // `flock` is queued behind `run`'s lock before `run` dies.
    std::thread::sleep(std::time::Duration::from_millis(200));
    run.kill().expect("SIGKILL run");
    let _ = run.wait();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while still_runs(pid, start) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let survived = still_runs(pid, start);
    if survived {
        let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
    }
    let _ = holder.wait();
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut stderr, &mut rest);
    assert!(!survived, "the agent {pid} outlived a SIGKILLed run: {rest}");
    assert_eq!(only_session_state(&config), "suspended", "{rest}");
    assert!(rest.contains("suspended"), "{rest}");
}

/// A sandboxed agent that fails as it starts is most often missing a file of the host it was
/// not shown: the log says that `agent.needs` may be missing it (plain mode shows everything,
/// and says nothing of the kind).
#[test]
fn a_sandboxed_agent_failing_at_start_is_told_about_agent_needs() {
    use std::os::unix::fs::PermissionsExt;
    for sandbox in ["none", "bubblewrap", "landlock"] {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).expect("chmod");
        let config = write_config(
            dir.path(),
            &format!(
                "[session_runtime]\ninstallation = \"cli\"\n\
                 [session_runtime.local]\nstorage = \"per-session\"\nsandbox = \"{sandbox}\"\nroot = {:?}\n",
                dir.path().join("sessions"),
            ),
        );
        let output = oab_runtime()
            .env("OAB_LOG", "warn")
            .arg("--config")
            .arg(&config)
            .args(["run", "--platform", "discord", "--thread", "fails", "--"])
            .args(["/bin/sh", "-c", "echo 'cannot find /opt/lib/x' >&2; exit 3"])
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run");
        assert_eq!(output.status.code(), Some(3), "{sandbox}: {output:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(
            stderr.contains("`agent.needs` may be missing"),
            sandbox != "none",
            "{sandbox}: {stderr}"
        );
    }
}

/// The guard of a `run` suspends only the generation that `run` attached: a guard told another
/// generation (a later `run` of the thread already replaced the worker) leaves it running, and
/// so does one told `done`.
#[test]
fn a_run_guard_suspends_only_the_generation_its_run_attached() {
    use std::io::{BufRead, Write};
    let dir = tempfile::tempdir().expect("temp dir");
    let (config, _root) = plain_config(dir.path());
    let mut run = spawn_run(&config, "guarded", &["/bin/sh", "-c", "exec sleep 300"]);
    let mut stderr = std::io::BufReader::new(run.stderr.take().expect("stderr"));
    let mut line = String::new();
    let (id, generation) = loop {
        line.clear();
        assert!(
            stderr.read_line(&mut line).expect("stderr") > 0,
            "run ended early"
        );
        if let Some(rest) = line.split("worker pid:").nth(1) {
            let generation = rest
                .split("/g")
                .nth(1)
                .expect("generation")
                .split(' ')
                .next()
                .expect("g");
            let id = ls(&config)
                .lines()
                .nth(1)
                .expect("a session")
                .split_whitespace()
                .next()
                .expect("id")
                .to_owned();
            break (id, generation.parse::<u64>().expect("generation"));
        }
    };
    let guard = |said: &str| {
        let mut guard = oab_runtime()
            .arg("--config")
            .arg(&config)
            .args(["__run-guard", &id])
            .stdin(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("guard");
        guard
            .stdin
            .take()
            .expect("stdin")
            .write_all(said.as_bytes())
            .expect("write");
        let output = guard.wait_with_output().expect("guard");
        assert!(output.status.success(), "{said:?}: {output:?}");
    };
    guard(&format!("generation {}\n", generation + 1));
    assert_eq!(only_session_state(&config), "running", "another generation");
    guard(&format!("generation {generation}\ndone\n"));
    assert_eq!(only_session_state(&config), "running", "run said done");
    // The generation `run` attached is suspended (by `run`'s own guard) once `run` is killed:
    // `a_run_killed_by_sigkill_leaves_no_agent_running_in_any_mode`.
    let _ = Command::new("kill")
        .args(["-TERM", &run.id().to_string()])
        .status();
    let output = wait_for_end(run, "SIGTERM");
    assert_eq!(output.status.code(), Some(143), "{output:?}");
}
