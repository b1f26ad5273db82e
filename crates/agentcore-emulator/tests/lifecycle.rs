//! The platform's clock and storage rules: idle timeout (busy workers kept), maximum lifetime
//! (cuts streams), storage expiry, and a runtime version change resetting storage.

mod common;

use std::time::Duration;

use aws_sdk_bedrockagentcore::primitives::Blob;
use common::*;
use serde_json::json;

async fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + PATIENCE;
    while !condition() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn an_idle_session_is_stopped_but_a_busy_one_is_kept() {
    let root = tempfile::tempdir().expect("root");
    let emulator = emulator_on(root.path())
        .idle_timeout(Duration::from_secs(1))
        .start()
        .await
        .expect("emulator");
    let client = client(&emulator);
    let (idle, busy) = (session_id("idle"), session_id("busy"));
    invoke_json(&client, &emulator, &idle, json!({"op": "info"})).await;
    invoke_json(&client, &emulator, &busy, json!({"op": "busy", "on": true})).await;
    let started = std::time::Instant::now();
    wait_until("the idle session is stopped", || !emulator.is_running(&idle)).await;
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "not before the timeout"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(emulator.is_running(&busy), "HealthyBusy keeps the session");
    invoke_json(&client, &emulator, &busy, json!({"op": "busy", "on": false})).await;
    wait_until("the no longer busy session is stopped", || {
        !emulator.is_running(&busy)
    })
    .await;
    emulator.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn stream_traffic_counts_as_activity() {
    let root = tempfile::tempdir().expect("root");
    let emulator = emulator_on(root.path())
        .idle_timeout(Duration::from_secs(1))
        .start()
        .await
        .expect("emulator");
    let client = client(&emulator);
    let session = session_id("traffic");
    // 3 s of chunks every 300 ms: longer than the idle timeout, never idle for it.
    let (_, body) = invoke(
        &client,
        &emulator,
        &session,
        json!({"op": "stream", "chunks": 10, "gap_ms": 300}),
    )
    .await
    .expect("the stream is not cut by the idle timeout");
    assert_eq!(String::from_utf8_lossy(&body).matches("data:").count(), 10);
    emulator.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn the_maximum_lifetime_stops_the_worker_even_mid_stream() {
    let root = tempfile::tempdir().expect("root");
    let emulator = emulator_on(root.path())
        .max_lifetime(Duration::from_secs(2))
        .start()
        .await
        .expect("emulator");
    let client = client(&emulator);
    let session = session_id("lifetime");
    let started = std::time::Instant::now();
    let out = client
        .invoke_agent_runtime()
        .agent_runtime_arn(emulator.runtime_arn().to_string())
        .runtime_session_id(&session)
        .payload(Blob::new(
            json!({"op": "stream", "chunks": 1000, "gap_ms": 100}).to_string(),
        ))
        .send()
        .await
        .expect("invoke");
    let mut response = out.response;
    let mut broken = false;
    while let Some(chunk) = tokio::time::timeout(PATIENCE, response.next())
        .await
        .expect("not hung")
    {
        if chunk.is_err() {
            broken = true;
            break;
        }
    }
    assert!(broken, "the stream was cut, not finished");
    let lived = started.elapsed();
    assert!(
        lived >= Duration::from_millis(1800) && lived < Duration::from_secs(10),
        "{lived:?}"
    );
    assert!(!emulator.is_running(&session));
    emulator.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn unused_storage_expires_and_a_runtime_version_change_resets_all_storage() {
    let root = tempfile::tempdir().expect("root");
    let emulator = emulator_on(root.path())
        .idle_timeout(Duration::from_millis(500))
        .storage_expiry(Duration::from_secs(2))
        .start()
        .await
        .expect("emulator");
    let client = client(&emulator);
    let expiring = session_id("expiring");
    invoke_json(
        &client,
        &emulator,
        &expiring,
        json!({"op": "write", "name": "f", "content": "1"}),
    )
    .await;
    let storage = emulator.session_storage(&expiring).await.expect("storage");
    assert!(storage.join("f").exists());
    let deadline = std::time::Instant::now() + PATIENCE;
    while emulator.session_storage(&expiring).await.is_some() {
        assert!(std::time::Instant::now() < deadline, "storage never expired");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!storage.join("f").exists(), "the file went with its storage");
    let fresh = invoke_json(&client, &emulator, &expiring, json!({"op": "read", "name": "f"})).await;
    assert!(
        fresh["content"].is_null(),
        "a later session starts on empty storage"
    );
    emulator.shutdown().await.expect("shutdown");

    let root = tempfile::tempdir().expect("root");
    let emulator = emulator_on(root.path()).start().await.expect("emulator");
    let client = common::client(&emulator);
    let (a, b) = (session_id("version-a"), session_id("version-b"));
    for session in [&a, &b] {
        invoke_json(
            &client,
            &emulator,
            session,
            json!({"op": "write", "name": "f", "content": "v1"}),
        )
        .await;
    }
    emulator.stop_session(&b).await.expect("stop b");
    emulator.bump_runtime_version().await.expect("new version");
    assert!(!emulator.is_running(&a));
    for session in [&a, &b] {
        let read = invoke_json(&client, &emulator, session, json!({"op": "read", "name": "f"})).await;
        assert!(read["content"].is_null(), "storage reset for {session}: {read}");
    }
    emulator.shutdown().await.expect("shutdown");
}
