//! `deploy/worker/Dockerfile` and the test cluster's builder (`e2e/images/build agent-worker`)
//! make the same image: the builder reads the Dockerfile's `WORKER_PACKAGES` and `AGENT_NPM` and
//! installs with the same `deploy/worker/install-agent`, and this test compares the result, read
//! from the builder's archive, with the Dockerfile's final stage: its user, environment, working
//! directory and entrypoint, its user and directories, its Debian packages, the agent package at
//! the pinned version with its command linked, and the relay alone in a layer of its own.
//! (No Docker engine runs here, so the Dockerfile itself is never built: see docs/kubernetes.md.)
//!
//! Run: `e2e/images/build agent-worker` (scripts/cluster up runs it) then `cargo test -p
//! runtime-kubernetes --test worker_image -- --ignored`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The builder's archive (built, or found in its cache).
fn archive() -> PathBuf {
    let output = Command::new(repo().join("e2e/images/build"))
        .arg("agent-worker")
        .output()
        .expect("run e2e/images/build");
    assert!(
        output.status.success(),
        "e2e/images/build agent-worker: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    PathBuf::from(stdout.lines().last().expect("the archive's path").trim())
}

/// One member of a tar file.
fn member(tar: &Path, name: &str) -> Vec<u8> {
    let output = Command::new("tar")
        .arg("-xOf")
        .arg(tar)
        .arg(format!("./{name}"))
        .output()
        .expect("tar");
    assert!(output.status.success(), "{name} in {}", tar.display());
    output.stdout
}

/// A layer of the archive, copied out once into a temporary file (removed when dropped).
struct Layer(PathBuf);

impl Layer {
    fn of(archive: &Path, name: &str) -> Layer {
        let path = std::env::temp_dir().join(format!(
            "oab-worker-image-{}-{}.tar",
            std::process::id(),
            name.replace('/', "-")
        ));
        std::fs::write(&path, member(archive, name)).expect("write the layer");
        Layer(path)
    }

    fn read(&self, name: &str) -> Vec<u8> {
        member(&self.0, name)
    }

    /// Its entries without the leading `./`, a symbolic link as `path -> target`.
    fn entries(&self) -> BTreeSet<String> {
        let listed = Command::new("tar")
            .arg("-tvf")
            .arg(&self.0)
            .output()
            .expect("tar");
        assert!(listed.status.success());
        String::from_utf8_lossy(&listed.stdout)
            .lines()
            // mode owner size date time ./path [-> target]
            .filter_map(|line| Some(line.split_once(" ./")?.1.trim_end_matches('/').to_owned()))
            .filter(|entry| !entry.is_empty())
            .collect()
    }
}

impl Drop for Layer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The Dockerfile's final stage: its instructions after the last `FROM`, continuation lines
/// joined, comments dropped.
fn final_stage(dockerfile: &str) -> Vec<(String, String)> {
    let joined = dockerfile.replace("\\\n", " ");
    let lines: Vec<&str> = joined
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .collect();
    let start = lines
        .iter()
        .rposition(|line| line.starts_with("FROM "))
        .expect("a FROM");
    lines[start..]
        .iter()
        .filter_map(|line| line.split_once(' '))
        .map(|(instruction, rest)| (instruction.to_owned(), rest.trim().to_owned()))
        .collect()
}

/// The default of `ARG name=...` anywhere in the Dockerfile.
fn arg_default(dockerfile: &str, name: &str) -> String {
    dockerfile
        .lines()
        .find_map(|line| line.strip_prefix(&format!("ARG {name}=")))
        .unwrap_or_else(|| panic!("no ARG {name}"))
        .trim_matches('"')
        .to_owned()
}

#[test]
#[ignore = "needs the agent worker image: e2e/images/build agent-worker (mmdebstrap, the npm \
            registry and PyPI), which scripts/cluster up builds; then cargo test -- --ignored"]
fn the_builder_makes_the_dockerfiles_image() {
    let dockerfile =
        std::fs::read_to_string(repo().join("deploy/worker/Dockerfile")).expect("the Dockerfile");
    let stage = final_stage(&dockerfile);
    let instruction = |name: &str| -> Vec<&str> {
        stage
            .iter()
            .filter(|(i, _)| i == name)
            .map(|(_, rest)| rest.as_str())
            .collect()
    };
    let archive = archive();

    // The image configuration against USER, ENV, WORKDIR, ENTRYPOINT (and no CMD).
    let manifest: Value = serde_json::from_slice(&member(&archive, "manifest.json")).expect("manifest.json");
    let image = manifest
        .as_array()
        .expect("a list")
        .iter()
        .find(|image| image["RepoTags"][0] == "openab.dev/agent-worker:test")
        .expect("the agent worker's tag");
    let config: Value =
        serde_json::from_slice(&member(&archive, image["Config"].as_str().expect("its config")))
            .expect("the image config");
    let config = &config["config"];
    assert_eq!(config["User"], instruction("USER")[0]);
    assert_eq!(config["WorkingDir"], instruction("WORKDIR")[0]);
    let entrypoint: Value = serde_json::from_str(instruction("ENTRYPOINT")[0]).expect("exec form");
    assert_eq!(config["Entrypoint"], entrypoint);
    assert!(instruction("CMD").is_empty() && config.get("Cmd").is_none_or(Value::is_null));
    let env: BTreeSet<&str> = instruction("ENV")
        .iter()
        .flat_map(|line| line.split_whitespace())
        .collect();
    let built_env: BTreeSet<&str> = config["Env"]
        .as_array()
        .expect("Env")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(built_env, env);

    let layers: Vec<&str> = image["Layers"]
        .as_array()
        .expect("layers")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(layers.len(), 2, "the root with the agent, then the relay");

    // The relay, copied last as the Dockerfile's `COPY --from=relay`, alone in its layer.
    let relay: Vec<String> = Layer::of(&archive, layers[1])
        .entries()
        .into_iter()
        .filter(|entry| !["usr", "usr/local", "usr/local/bin"].contains(&entry.as_str()))
        .collect();
    assert_eq!(relay, ["usr/local/bin/oab-relay"]);

    // The root: the Dockerfile's packages, user and directories, and the agent at its pin.
    let root = Layer::of(&archive, layers[0]);
    let status = String::from_utf8(root.read("var/lib/dpkg/status")).expect("UTF-8");
    for package in arg_default(&dockerfile, "WORKER_PACKAGES").split_whitespace() {
        assert!(
            status.contains(&format!("Package: {package}\nStatus: install ok installed")),
            "{package} is installed"
        );
    }
    let passwd = String::from_utf8(root.read("etc/passwd")).expect("UTF-8");
    let useradd = instruction("RUN")
        .into_iter()
        .find(|run| run.contains("useradd"))
        .expect("a useradd");
    let flag = |name: &str| {
        let after = useradd.split(name).nth(1).expect(name);
        after.split_whitespace().next().expect(name).to_owned()
    };
    let user = format!(
        "agent:x:{}:{}::{}:{}",
        flag("--uid"),
        flag("--gid"),
        flag("--home-dir"),
        flag("--shell")
    );
    assert!(passwd.lines().any(|line| line == user), "{user} in {passwd}");
    let files = root.entries();
    for directory in ["workspace", "home/agent"] {
        assert!(files.contains(directory), "the Dockerfile's {directory}");
    }
    let npm = arg_default(&dockerfile, "AGENT_NPM");
    let (package, version) = npm.rsplit_once('@').expect("PACKAGE@VERSION");
    let manifest = root.read(&format!("usr/local/lib/node_modules/{package}/package.json"));
    let manifest: Value = serde_json::from_slice(&manifest).expect("package.json");
    assert_eq!(manifest["version"], version, "{package} at the Dockerfile's pin");
    let bins = manifest["bin"].as_object().expect("the package's commands");
    for (name, target) in bins {
        let target = target.as_str().expect("a path").trim_start_matches("./");
        let link = format!("usr/local/bin/{name} -> ../lib/node_modules/{package}/{target}");
        assert!(files.contains(&link), "{link}");
    }
}
