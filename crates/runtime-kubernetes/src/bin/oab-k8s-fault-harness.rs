//! `oab-k8s-fault-harness`: a stand-in broker process for the Kubernetes runtime's fault test
//! (`tests/faults.rs`), which kills it with SIGKILL in the middle of an operation. Built only with
//! the `testing` feature; not meant to be installed.
//!
//! ```text
//! oab-k8s-fault-harness NAMESPACE PROFILE INSTALLATION PHASE SEED
//! ```
//!
//! It builds a runtime with the client from `KUBECONFIG` (exec reach; retention: `Ended` retains for
//! 2 s, `Reset` deletes) and loops over threads `t0` to `t2`, chosen by an xorshift generator seeded
//! with `SEED`: create; then attach, suspend or close (`Reset` or `Ended`). One line per step:
//!
//! ```text
//! <op> start <thread>      op: create | attach | suspend | close
//! <op> done <thread>
//! failed <op> <thread> <error>
//! ```
//!
//! Before each operation named `PHASE` it waits for one byte on stdin after its `start` line, so
//! the test can time the kill from the moment the operation begins. It exits when stdin ends.

use std::io::{Read, Write};
use std::process::ExitCode;

use runtime_kubernetes::kube;
use runtime_kubernetes::KubernetesRuntime;
use session_runtime::config::{KubernetesConfig, Reach};
use session_runtime::{
    CloseReason, CreateOptions, Retention, RetentionPolicy, SessionIdentity, SessionRuntime, SuspendReason,
};

const THREADS: u64 = 3;

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

async fn go_ahead() -> bool {
    tokio::task::spawn_blocking(|| {
        let mut byte = [0u8; 1];
        matches!(std::io::stdin().lock().read(&mut byte), Ok(1))
    })
    .await
    .unwrap_or(false)
}

/// xorshift64: reproducible from the seed, no dependency.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [namespace, profile, installation, phase, seed] = args.as_slice() else {
        eprintln!("usage: oab-k8s-fault-harness NAMESPACE PROFILE INSTALLATION PHASE SEED");
        return ExitCode::from(64);
    };
    let Ok(seed) = seed.parse::<u64>() else {
        eprintln!("oab-k8s-fault-harness: SEED must be a number");
        return ExitCode::from(64);
    };
    let client = match kube::Client::try_default().await {
        Ok(client) => client,
        Err(error) => {
            eprintln!("oab-k8s-fault-harness: no client: {error}");
            return ExitCode::FAILURE;
        }
    };
    let mut retention = RetentionPolicy::default();
    retention.ended = Retention::Retain;
    // Short, so the test's last passes expire what the harness retained.
    retention.retain_for = Some(std::time::Duration::from_secs(2));
    let mut config = KubernetesConfig::new(namespace.as_str(), profile.as_str());
    config.reach = Reach::Exec;
    let runtime = match KubernetesRuntime::builder(client, config)
        .installation(installation.as_str())
        .retention(retention)
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("oab-k8s-fault-harness: {error}");
            return ExitCode::FAILURE;
        }
    };
    let mut state = seed.max(1);
    let mut attachments = Vec::new();
    loop {
        let thread = next(&mut state) % THREADS;
        let identity =
            match SessionIdentity::new(installation.as_str(), "agent", "faults", format!("t{thread}")) {
                Ok(identity) => identity,
                Err(error) => {
                    eprintln!("oab-k8s-fault-harness: {error}");
                    return ExitCode::FAILURE;
                }
            };
        let id = identity.id();
        let op = match next(&mut state) % 10 {
            0..=2 => "create",
            3..=4 => "attach",
            5 => "suspend",
            _ => "close",
        };
        say(&format!("{op} start t{thread}"));
        if op == phase && !go_ahead().await {
            return ExitCode::SUCCESS;
        }
        // Every operation but create needs the session: make it first, unannounced.
        if op != "create" {
            if let Err(error) = runtime.create(&identity, &CreateOptions::new()).await {
                say(&format!("failed create t{thread} {error}"));
                return ExitCode::from(2);
            }
        }
        let result = match op {
            "create" => runtime.create(&identity, &CreateOptions::new()).await.map(drop),
            "attach" => runtime
                .attach(&id)
                .await
                .map(|attachment| attachments.push(attachment)),
            "suspend" => runtime.suspend(&id, SuspendReason::Idle).await,
            _ => {
                let reason = if next(&mut state).is_multiple_of(2) {
                    CloseReason::Reset
                } else {
                    CloseReason::Ended
                };
                runtime.close(&id, reason).await
            }
        };
        match result {
            Ok(()) => say(&format!("{op} done t{thread}")),
            // Attaching a closed session, suspending one never attached: the contract's refusals.
            Err(session_runtime::Error::InvalidState { .. }) => say(&format!("{op} refused t{thread}")),
            Err(error) => {
                say(&format!("failed {op} t{thread} {error}"));
                return ExitCode::from(2);
            }
        }
    }
}
