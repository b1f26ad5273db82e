//! AgentCore's failures as the backend meets them, injected by the emulator: errors at the
//! WebSocket upgrade and at `StopRuntimeSession`, sorted into the contract's kinds; retries only
//! where they are safe; dropped WebSockets resumed without loss.

mod common;

use std::time::{Duration, Instant};

use agentcore_emulator::{Fault, Operation, WorkerCommand};
use common::{attempts, created, within};
use session_runtime::{CloseReason, Error, SessionRuntime, SessionState, SuspendReason};
use tokio::io::{AsyncBufReadExt, BufReader};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_denied_at_the_upgrade_fails_the_attach_at_once_and_is_not_retryable() {
    let harness = common::start().await;
    let id = created(&harness, "denied").await;
    harness
        .emulator
        .fail_next(Operation::WebSocket, 1, Fault::AccessDenied);
    let started = Instant::now();
    let error = within("attach", harness.runtime.attach(&id))
        .await
        .expect_err("denied");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "not retried for the start timeout"
    );
    match &error {
        Error::Backend {
            retryable: false,
            message,
            ..
        } => assert!(message.contains("AccessDeniedException"), "{message}"),
        other => panic!("expected a backend error that is not retryable, got {other:?}"),
    }
    assert_eq!(
        attempts(&harness, Operation::WebSocket),
        [403],
        "one upgrade, no retry"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_credentials_at_the_upgrade_are_a_retryable_error() {
    let harness = common::start().await;
    let id = created(&harness, "expired").await;
    harness
        .emulator
        .fail_next(Operation::WebSocket, 1, Fault::ExpiredToken);
    let error = within("attach", harness.runtime.attach(&id))
        .await
        .expect_err("expired");
    assert!(
        matches!(&error, Error::Backend { retryable: true, message, .. } if message.contains("ExpiredTokenException")),
        "{error:?}"
    );
    // Once the credentials are good again, the same call succeeds.
    within("attach", harness.runtime.attach(&id))
        .await
        .expect("attach after the expiry");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttled_and_failing_upgrades_are_retried_within_the_start_timeout() {
    let harness = common::start().await;
    let id = created(&harness, "throttled").await;
    harness
        .emulator
        .fail_next(Operation::WebSocket, 2, Fault::Throttling);
    harness
        .emulator
        .fail_next(Operation::WebSocket, 1, Fault::ServiceUnavailable);
    within("attach", harness.runtime.attach(&id))
        .await
        .expect("attach after the retries");
    let statuses = attempts(&harness, Operation::WebSocket);
    assert_eq!(statuses.last(), Some(&101), "{statuses:?}");
    assert!(
        statuses.iter().filter(|s| **s == 429 || **s == 503).count() >= 2,
        "{statuses:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_is_retried_on_a_server_error_and_not_running_counts_as_stopped() {
    let harness = common::start_with(|mut setup| {
        setup.config.session_storage = false;
        setup
    })
    .await;
    let id = created(&harness, "stop-retry").await;
    let attachment = within("attach", harness.runtime.attach(&id))
        .await
        .expect("attach");
    harness
        .emulator
        .fail_next(Operation::Stop, 1, Fault::InternalServer);
    within("suspend", harness.runtime.suspend(&id, SuspendReason::Idle))
        .await
        .expect("suspend");
    let stops: Vec<_> = harness
        .emulator
        .requests()
        .into_iter()
        .filter(|r| r.operation == Some(Operation::Stop))
        .collect();
    assert_eq!(
        stops.iter().map(|r| r.status).collect::<Vec<_>>(),
        [500, 200],
        "{stops:?}"
    );
    assert_eq!(stops[1].attempt(), Some(2), "the SDK retried the idempotent stop");
    assert!(!harness.emulator.is_running(&harness.runtime_session(&id, 1)));
    drop(attachment);

    // Nothing runs any more: AgentCore answers ResourceNotFound, and the close succeeds.
    within("close", harness.runtime.close(&id, CloseReason::Ended))
        .await
        .expect("close");
    assert_eq!(attempts(&harness, Operation::Stop).last(), Some(&404));
    let status = harness.runtime.status(&id).await.expect("status");
    assert_eq!(status.state, SessionState::Closed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_that_keeps_failing_is_retryable_and_reconcile_finishes_it() {
    let harness = common::start().await;
    let id = created(&harness, "stop-fails").await;
    let _attachment = within("attach", harness.runtime.attach(&id))
        .await
        .expect("attach");
    harness.emulator.fail_next(Operation::Stop, 10, Fault::Throttling);
    let error = within("suspend", harness.runtime.suspend(&id, SuspendReason::Capacity))
        .await
        .expect_err("throttled");
    assert!(error.retryable(), "{error:?}");
    let status = harness.runtime.status(&id).await.expect("status");
    assert_eq!(
        status.state,
        SessionState::Suspended,
        "the suspend was recorded first"
    );
    assert!(harness.emulator.is_running(&harness.runtime_session(&id, 1)));

    harness.emulator.clear_faults();
    let report = within("reconcile", harness.runtime.reconcile())
        .await
        .expect("reconcile");
    assert!(
        report.killed_workers.iter().any(|(killed, _)| *killed == id),
        "{report:?}"
    );
    assert!(!harness.emulator.is_running(&harness.runtime_session(&id, 1)));
    let again = within("reconcile", harness.runtime.reconcile())
        .await
        .expect("reconcile");
    assert!(again.is_clean(), "a second pass finds nothing: {again:?}");
}

/// 1,000 lines through `cat` while the emulator cuts the session's WebSocket 50 times: every
/// line comes back once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_websockets_lose_and_duplicate_nothing() {
    let harness = common::start_with(|mut setup| {
        let (relay, _) = common::relay_and_agent();
        setup.worker = WorkerCommand::relay(relay, ["/bin/cat"]);
        setup
    })
    .await;
    let id = created(&harness, "drops").await;
    let mut attachment = within("attach", harness.runtime.attach(&id))
        .await
        .expect("attach");
    let rsid = harness.runtime_session(&id, 1);
    let input = attachment.input().clone();
    let writer = tokio::spawn(async move {
        for i in 0..1000 {
            input.write_line(format!("line {i}")).await.expect("write");
            if i % 20 == 0 {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    });
    let mut reader = BufReader::new(attachment.output());
    let mut dropped = 0;
    for i in 0..1000 {
        let mut line = String::new();
        within("read", reader.read_line(&mut line)).await.expect("read");
        assert_eq!(
            line.trim_end(),
            format!("line {i}"),
            "line {i} in order, exactly once"
        );
        if i % 20 == 10 {
            // Cut only a connection that is up: wait for the reconnect after the last cut.
            let upgrades = within("the reconnect", async {
                loop {
                    let upgrades = attempts(&harness, Operation::WebSocket);
                    if upgrades.iter().filter(|s| **s == 101).count() > dropped {
                        return upgrades.len();
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
            .await;
            assert!(
                harness.emulator.drop_websockets(&rsid),
                "an open WebSocket after {upgrades} upgrades"
            );
            dropped += 1;
        }
    }
    writer.await.expect("the writer");
    assert_eq!(dropped, 50);
    let reconnects = attempts(&harness, Operation::WebSocket)
        .iter()
        .filter(|s| **s == 101)
        .count();
    assert!(
        reconnects >= 50,
        "each cut was followed by a signed reconnect: {reconnects}"
    );
}
