//! The static build of `oab-relay` documented in the crate docs: it must need nothing from the
//! image (no dynamic loader, no libc), so it runs in a `FROM scratch` container.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use common::within;
use session_runtime::{Fence, WorkerExit};
use tokio::io::AsyncReadExt;
use worker_relay::{ClientConfig, RelayClient, TcpConnector};

const TARGET: &str = "x86_64-unknown-linux-gnu";

/// Whether an ELF file asks for a program interpreter (a dynamic loader): `PT_INTERP`.
fn has_interpreter(elf: &[u8]) -> bool {
    assert_eq!(&elf[..4], b"\x7fELF", "not an ELF file");
    assert_eq!(elf[4], 2, "not a 64-bit ELF file");
    let u16_at = |at: usize| u16::from_le_bytes([elf[at], elf[at + 1]]) as usize;
    let u64_at = |at: usize| {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&elf[at..at + 8]);
        u64::from_le_bytes(bytes) as usize
    };
    let (offset, size, count) = (u64_at(0x20), u16_at(0x36), u16_at(0x38));
    (0..count).any(|i| {
        let header = offset + i * size;
        u32::from_le_bytes([elf[header], elf[header + 1], elf[header + 2], elf[header + 3]]) == 3
    })
}

fn build_static() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let workspace = manifest.parent().and_then(Path::parent).expect("workspace root");
    // Where the other builds go (a relative CARGO_TARGET_DIR is relative to the workspace).
    let target_dir = workspace.join(std::env::var_os("CARGO_TARGET_DIR").unwrap_or_else(|| "target".into()));
    let status = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
        .current_dir(workspace)
        .env("RUSTFLAGS", "-C target-feature=+crt-static")
        .args([
            "build",
            "--release",
            "-p",
            "worker-relay",
            "--bin",
            "oab-relay",
            "--target",
            TARGET,
        ])
        .arg("--target-dir")
        .arg(&target_dir)
        .status()
        .expect("run cargo");
    assert!(status.success(), "the static build failed");
    target_dir.join(TARGET).join("release").join("oab-relay")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "builds a release binary (about a minute); ./scripts/test runs it: `cargo test -p worker-relay --test static_build -- --ignored`"]
async fn the_static_relay_needs_nothing_from_the_image() {
    let binary = build_static();
    let elf = std::fs::read(&binary).expect("read the binary");
    assert!(
        !has_interpreter(&elf),
        "{} asks for a dynamic loader",
        binary.display()
    );
    if Command::new("bwrap").arg("--version").output().is_err() {
        eprintln!("bwrap not installed: skipping the empty-root run");
        return;
    }
    // An empty root holding only the binary, like a `FROM scratch` image; the relay serves a
    // session whose agent is the relay binary itself printing its version.
    let root = tempfile::tempdir().expect("tempdir");
    std::fs::copy(&binary, root.path().join("oab-relay")).expect("copy");
    let session = common::session("static");
    let mut relay = tokio::process::Command::new("bwrap")
        .arg("--bind")
        .arg(root.path())
        .args(["/", "--proc", "/proc", "--dev", "/dev", "--chdir", "/", "--"])
        .args([
            "/oab-relay",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--",
            "/oab-relay",
            "--version",
        ])
        .env("OAB_RELAY_SESSION", session.as_str())
        .env("OAB_RELAY_GENERATION", "1")
        .env(
            "OAB_RELAY_TOKEN_SHA256",
            common::key().token(session.as_str(), 1).hash().to_hex(),
        )
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start bwrap");
    let mut stdout = tokio::io::BufReader::new(relay.stdout.take().expect("stdout"));
    let mut line = String::new();
    within(
        "listening line",
        tokio::io::AsyncBufReadExt::read_line(&mut stdout, &mut line),
    )
    .await
    .expect("read");
    let addr = line.trim().rsplit(' ').next().expect("address").to_owned();
    let (fence, _trigger) = Fence::new(session, 1);
    let config = ClientConfig::with_key(session, 1, 1, &common::key());
    let mut attachment = RelayClient::new(config, Arc::new(TcpConnector::new(addr)))
        .attach(fence)
        .await
        .expect("attach");
    let mut output = String::new();
    within("agent output", attachment.output().read_to_string(&mut output))
        .await
        .expect("read");
    assert!(output.starts_with("oab-relay "), "{output:?}");
    assert_eq!(
        within("wait", attachment.control().wait()).await.expect("wait"),
        WorkerExit::Code(0)
    );
}
