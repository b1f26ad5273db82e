//! The real SDK against the emulator: invocations stream, stops cut, sessions get their own
//! workers and storage, and errors map as the SDK maps AgentCore's.

mod common;

use std::time::Duration;

use agentcore_emulator::{IsolationLevel, Operation};
use aws_sdk_bedrockagentcore::primitives::Blob;
use common::*;
use serde_json::json;

#[tokio::test]
async fn an_invocation_streams_the_workers_answer_with_its_content_type() {
    let (emulator, _root) = emulator().await;
    let client = client(&emulator);
    let session = session_id("stream");
    let out = client
        .invoke_agent_runtime()
        .agent_runtime_arn(emulator.runtime_arn().to_string())
        .qualifier("DEFAULT")
        .runtime_session_id(&session)
        .payload(Blob::new(
            json!({"op": "stream", "chunks": 3, "gap_ms": 300}).to_string(),
        ))
        .send()
        .await
        .expect("invoke");
    assert_eq!(out.content_type, "text/event-stream");
    assert_eq!(out.runtime_session_id.as_deref(), Some(session.as_str()));
    let mut response = out.response;
    let mut chunks = Vec::new();
    let start = std::time::Instant::now();
    while let Some(chunk) = response.next().await {
        chunks.push((start.elapsed(), chunk.expect("chunk").to_vec()));
    }
    let text: Vec<u8> = chunks.iter().flat_map(|(_, c)| c.clone()).collect();
    assert_eq!(
        String::from_utf8_lossy(&text),
        "data: 0\n\ndata: 1\n\ndata: 2\n\n"
    );
    // Incremental: the first event arrived well before the last was written.
    assert!(chunks.len() >= 2, "{chunks:?}");
    assert!(chunks[0].0 + Duration::from_millis(300) <= chunks[chunks.len() - 1].0);

    // The worker saw the payload's content type and the session header, as AgentCore passes them.
    let info = invoke_json(&client, &emulator, &session, json!({"op": "info"})).await;
    assert_eq!(info["session"], session.as_str());
    assert_eq!(info["content_type"], "application/json");
    let log = emulator.requests();
    assert_eq!(log.len(), 2);
    assert!(log
        .iter()
        .all(|r| r.operation == Some(Operation::Invoke) && r.status == 200));
    assert_eq!(log[0].qualifier.as_deref(), Some("DEFAULT"));
    assert_eq!(log[0].attempt(), Some(1));
    emulator.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn each_session_id_gets_its_own_worker_and_storage_and_the_sandbox_is_reported() {
    let (emulator, _root) = emulator().await;
    let client = client(&emulator);
    let (a, b) = (session_id("iso-a"), session_id("iso-b"));
    let info_a = invoke_json(&client, &emulator, &a, json!({"op": "info"})).await;
    let info_b = invoke_json(&client, &emulator, &b, json!({"op": "info"})).await;
    assert_ne!(info_a["boot"], info_b["boot"]);
    let (storage_a, storage_b) = (
        emulator.session_storage(&a).await.expect("storage a"),
        emulator.session_storage(&b).await.expect("storage b"),
    );
    assert_ne!(storage_a, storage_b);
    invoke_json(
        &client,
        &emulator,
        &a,
        json!({"op": "write", "name": "note", "content": "A's"}),
    )
    .await;
    assert_eq!(
        std::fs::read_to_string(storage_a.join("note")).expect("A's file"),
        "A's"
    );
    let read_b = invoke_json(&client, &emulator, &b, json!({"op": "read", "name": "note"})).await;
    assert!(read_b["content"].is_null(), "B sees no note of A's: {read_b}");
    let sandbox = emulator.sandbox();
    if sandbox.isolation == IsolationLevel::Namespaces {
        // Under bubblewrap the working directory is the sandbox's own path for the storage.
        assert_eq!(info_a["cwd"], "/workspace", "{sandbox}");
    } else {
        assert_eq!(info_a["cwd"], storage_a.display().to_string(), "{sandbox}");
    }
    emulator.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn stop_ends_the_worker_keeps_storage_and_the_next_request_resumes_on_it() {
    let (emulator, _root) = emulator().await;
    let client = client(&emulator);
    let session = session_id("stop");
    let first = invoke_json(&client, &emulator, &session, json!({"op": "info"})).await;
    invoke_json(
        &client,
        &emulator,
        &session,
        json!({"op": "write", "name": "kept", "content": "yes"}),
    )
    .await;
    let stopped = client
        .stop_runtime_session()
        .agent_runtime_arn(emulator.runtime_arn().to_string())
        .qualifier("DEFAULT")
        .runtime_session_id(&session)
        .send()
        .await
        .expect("stop");
    assert_eq!(stopped.runtime_session_id.as_deref(), Some(session.as_str()));
    assert_eq!(stopped.status_code, Some(200));
    assert!(!emulator.is_running(&session));

    // A second stop finds nothing running: the documented choice is ResourceNotFoundException.
    let again = client
        .stop_runtime_session()
        .agent_runtime_arn(emulator.runtime_arn().to_string())
        .runtime_session_id(&session)
        .send()
        .await
        .expect_err("nothing to stop");
    assert!(again.into_service_error().is_resource_not_found_exception());

    let resumed = invoke_json(&client, &emulator, &session, json!({"op": "info"})).await;
    assert_ne!(first["boot"], resumed["boot"], "a new worker");
    let read = invoke_json(
        &client,
        &emulator,
        &session,
        json!({"op": "read", "name": "kept"}),
    )
    .await;
    assert_eq!(read["content"], "yes", "on the same storage");
    emulator.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn stop_cuts_an_in_flight_stream_at_once_and_the_sdk_does_not_retry_it() {
    let (emulator, _root) = emulator().await;
    let client = client_with(&emulator, emulator.credentials(), 3);
    let session = session_id("cut");
    let out = client
        .invoke_agent_runtime()
        .agent_runtime_arn(emulator.runtime_arn().to_string())
        .runtime_session_id(&session)
        .payload(Blob::new(
            json!({"op": "stream", "chunks": 100, "gap_ms": 200}).to_string(),
        ))
        .send()
        .await
        .expect("invoke");
    let mut response = out.response;
    response.next().await.expect("a first chunk").expect("chunk");
    let stop = tokio::spawn({
        let client = client.clone();
        let arn = emulator.runtime_arn().to_string();
        let session = session.clone();
        async move {
            client
                .stop_runtime_session()
                .agent_runtime_arn(arn)
                .runtime_session_id(session)
                .send()
                .await
        }
    });
    let ended = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match response.next().await {
                Some(Ok(_)) => continue,
                Some(Err(_)) => return true,
                None => return false,
            }
        }
    })
    .await
    .expect("the stream ends within seconds, not after 100 chunks");
    assert!(ended, "the cut stream ends with an error, not a clean end");
    stop.await.expect("join").expect("stop succeeds");
    let invokes: Vec<_> = emulator
        .requests()
        .into_iter()
        .filter(|r| r.operation == Some(Operation::Invoke))
        .collect();
    assert_eq!(
        invokes.len(),
        1,
        "the streamed invocation was sent once: {invokes:?}"
    );
    emulator.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn bad_session_ids_unknown_runtimes_and_qualifiers_are_refused_as_agentcore_refuses_them() {
    let (emulator, _root) = emulator().await;
    let client = client(&emulator);
    let short = client
        .invoke_agent_runtime()
        .agent_runtime_arn(emulator.runtime_arn().to_string())
        .runtime_session_id("too-short")
        .payload(Blob::new("{}"))
        .send()
        .await
        .expect_err("a 9-character session id");
    let short = short.into_service_error();
    assert!(short.is_validation_exception(), "{short:?}");

    let unknown = client
        .invoke_agent_runtime()
        .agent_runtime_arn("arn:aws:bedrock-agentcore:us-east-1:123456789012:runtime/other-ZZZZZZZZZZ")
        .runtime_session_id(session_id("unknown"))
        .payload(Blob::new("{}"))
        .send()
        .await
        .expect_err("an unknown runtime");
    assert!(unknown.into_service_error().is_resource_not_found_exception());

    let qualifier = client
        .invoke_agent_runtime()
        .agent_runtime_arn(emulator.runtime_arn().to_string())
        .qualifier("nope")
        .runtime_session_id(session_id("qualifier"))
        .payload(Blob::new("{}"))
        .send()
        .await
        .expect_err("an unknown qualifier");
    assert!(qualifier.into_service_error().is_resource_not_found_exception());

    // A worker answering an error is the agent's failure: RuntimeClientError.
    let failed = client
        .invoke_agent_runtime()
        .agent_runtime_arn(emulator.runtime_arn().to_string())
        .runtime_session_id(session_id("fail"))
        .payload(Blob::new(json!({"op": "fail"}).to_string()))
        .send()
        .await
        .expect_err("the worker answers 500");
    assert!(failed.into_service_error().is_runtime_client_error());
    emulator.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn several_requests_are_answered_on_one_kept_alive_connection() {
    let (emulator, _root) = emulator().await;
    let session = session_id("keepalive");
    let host = emulator.local_addr().to_string();
    let arn = emulator
        .runtime_arn()
        .to_string()
        .replace(':', "%3A")
        .replace('/', "%2F");
    let target = format!("/runtimes/{arn}/invocations?qualifier=DEFAULT");
    let mut stream = tokio::net::TcpStream::connect(emulator.local_addr())
        .await
        .expect("connect");
    for _ in 0..2 {
        let body = json!({"op": "info"}).to_string();
        let length = body.len().to_string();
        let (signed_target, mut headers) = sign_raw(
            "POST",
            &host,
            &target,
            &[
                ("content-type", "application/json"),
                ("content-length", &length),
                ("x-amzn-bedrock-agentcore-runtime-session-id", &session),
            ],
            body.as_bytes(),
            emulator.credentials(),
            emulator.region(),
            std::time::SystemTime::now(),
            false,
        );
        headers.push(("host".into(), host.clone()));
        send_raw(&mut stream, "POST", &signed_target, &headers, body.as_bytes()).await;
    }
    let answers = read_until(&mut stream, |seen| seen.matches("\r\n0\r\n\r\n").count() >= 2).await;
    assert_eq!(answers.matches("HTTP/1.1 200 OK").count(), 2, "{answers}");
    assert!(!answers.contains("connection: close"), "{answers}");
    emulator.shutdown().await.expect("shutdown");
}
