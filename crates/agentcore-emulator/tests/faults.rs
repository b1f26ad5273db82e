//! Fault injection: armed error answers (mapped by the SDK, retried by it only where it retries),
//! dropped WebSockets, slow streams, and the request log.

mod common;

use std::time::{Duration, Instant, SystemTime};

use agentcore_emulator::{Fault, Operation};
use aws_sdk_bedrockagentcore::error::ProvideErrorMetadata;
use aws_sdk_bedrockagentcore::primitives::Blob;
use common::*;
use futures_util::StreamExt;
use serde_json::json;

#[tokio::test]
async fn each_fault_answers_its_error_type_and_status_and_never_reaches_a_worker() {
    let (emulator, _root) = emulator().await;
    let client = client(&emulator);
    let session = session_id("faults");
    let cases = [
        (Fault::InternalServer, "InternalServerException", 500),
        (Fault::Throttling, "ThrottlingException", 429),
        (Fault::ExpiredToken, "ExpiredTokenException", 403),
        (Fault::AccessDenied, "AccessDeniedException", 403),
        (Fault::RuntimeClientError, "RuntimeClientError", 424),
        (Fault::ServiceUnavailable, "ServiceUnavailableException", 503),
        (Fault::ServiceQuotaExceeded, "ServiceQuotaExceededException", 402),
        (Fault::RetryableConflict, "RetryableConflictException", 409),
    ];
    for (fault, code, status) in cases {
        emulator.fail_next(Operation::Invoke, 1, fault);
        let error = client
            .invoke_agent_runtime()
            .agent_runtime_arn(emulator.runtime_arn().to_string())
            .runtime_session_id(&session)
            .payload(Blob::new("{}"))
            .send()
            .await
            .expect_err("faulted");
        assert_eq!(
            error.raw_response().map(|r| r.status().as_u16()),
            Some(status),
            "{fault:?}"
        );
        let error = error.into_service_error();
        assert_eq!(error.code(), Some(code), "{fault:?}");
        match fault {
            Fault::Throttling => assert!(error.is_throttling_exception()),
            Fault::InternalServer => assert!(error.is_internal_server_exception()),
            Fault::AccessDenied => assert!(error.is_access_denied_exception()),
            Fault::RuntimeClientError => assert!(error.is_runtime_client_error()),
            Fault::ServiceQuotaExceeded => assert!(error.is_service_quota_exceeded_exception()),
            Fault::RetryableConflict => assert!(error.is_retryable_conflict_exception()),
            _ => {}
        }
    }
    assert!(!emulator.is_running(&session), "no faulted call started a worker");

    emulator.fail_next(Operation::Stop, 1, Fault::AccessDenied);
    let stop = client
        .stop_runtime_session()
        .agent_runtime_arn(emulator.runtime_arn().to_string())
        .runtime_session_id(&session)
        .send()
        .await
        .expect_err("faulted stop");
    assert!(stop.into_service_error().is_access_denied_exception());
    for (fault, check) in [
        (
            Fault::Unauthorized,
            (|e: &aws_sdk_bedrockagentcore::operation::stop_runtime_session::StopRuntimeSessionError| {
                e.is_unauthorized_exception()
            }) as fn(&_) -> bool,
        ),
        (Fault::Conflict, |e| e.is_conflict_exception()),
        (Fault::RetryableConflict, |e| e.is_retryable_conflict_exception()),
    ] {
        emulator.fail_next(Operation::Stop, 1, fault);
        let stop = client
            .stop_runtime_session()
            .agent_runtime_arn(emulator.runtime_arn().to_string())
            .runtime_session_id(&session)
            .send()
            .await
            .expect_err("faulted stop");
        assert!(check(&stop.into_service_error()), "{fault:?}");
    }
    emulator.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn the_sdk_retries_throttling_and_the_log_shows_every_attempt() {
    let (emulator, _root) = emulator().await;
    let client = client_with(&emulator, emulator.credentials(), 3);
    let session = session_id("retry");
    emulator.fail_next(Operation::Invoke, 2, Fault::Throttling);
    invoke(&client, &emulator, &session, json!({"op": "info"}))
        .await
        .expect("the third attempt succeeds");
    let log = emulator.requests();
    let attempts: Vec<_> = log
        .iter()
        .map(|r| (r.attempt(), r.status, r.error_type))
        .collect();
    assert_eq!(
        attempts,
        [
            (Some(1), 429, Some("ThrottlingException")),
            (Some(2), 429, Some("ThrottlingException")),
            (Some(3), 200, None),
        ]
    );
    assert!(log
        .iter()
        .all(|r| r.session_id.as_deref() == Some(session.as_str())));
    emulator.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn a_slow_stream_delays_every_chunk() {
    let (emulator, _root) = emulator().await;
    let client = client(&emulator);
    let session = session_id("slow");
    emulator.slow_stream(Some(Duration::from_millis(400)));
    let started = Instant::now();
    let (_, body) = invoke(&client, &emulator, &session, json!({"op": "stream", "chunks": 4}))
        .await
        .expect("slow but whole");
    assert_eq!(String::from_utf8_lossy(&body).matches("data:").count(), 4);
    assert!(
        started.elapsed() >= Duration::from_millis(1200),
        "{:?}",
        started.elapsed()
    );
    emulator.slow_stream(None);
    emulator.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn dropping_a_sessions_websockets_cuts_them_and_a_faulted_upgrade_is_refused() {
    let (emulator, _root) = emulator().await;
    let (host, path) = ws_target(&emulator);
    let session = session_id("drop");
    let open = || async {
        let (target, headers) = sign_get(
            &host,
            &format!("{path}?qualifier=DEFAULT"),
            &[("x-amzn-bedrock-agentcore-runtime-session-id", &session)],
            emulator.credentials(),
            emulator.region(),
            SystemTime::now(),
            false,
        );
        let url = format!("ws://{host}{target}");
        let mut request = tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(url)
            .expect("request");
        for (name, value) in headers.iter().filter(|(name, _)| name != "host") {
            request.headers_mut().insert(
                http::HeaderName::from_bytes(name.as_bytes()).expect("name"),
                http::HeaderValue::from_str(value).expect("value"),
            );
        }
        let stream = tokio::net::TcpStream::connect(emulator.local_addr())
            .await
            .expect("connect");
        tokio_tungstenite::client_async(request, stream)
            .await
            .map(|(ws, _)| ws)
    };
    let mut ws = open().await.expect("upgrade");
    ws.next().await.expect("hello").expect("frame");
    assert!(emulator.drop_websockets(&session));
    let ended = tokio::time::timeout(Duration::from_secs(5), ws.next())
        .await
        .expect("cut at once");
    assert!(
        !matches!(ended, Some(Ok(tokio_tungstenite::tungstenite::Message::Text(_)))),
        "{ended:?}"
    );
    assert!(
        emulator.is_running(&session),
        "the worker survives a dropped WebSocket"
    );
    let mut again = open().await.expect("a new WebSocket after the drop");
    again.next().await.expect("hello").expect("frame");

    emulator.fail_next(Operation::WebSocket, 1, Fault::Throttling);
    match open().await {
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => assert_eq!(response.status(), 429),
        other => panic!("expected 429, got {:?}", other.map(|_| "an open WebSocket")),
    }
    emulator.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn stop_runtime_session_cuts_open_websockets_too() {
    let (emulator, _root) = emulator().await;
    let client = client(&emulator);
    let (host, path) = ws_target(&emulator);
    let session = session_id("ws-stop");
    let (target, headers) = sign_get(
        &host,
        &format!("{path}?qualifier=DEFAULT"),
        &[("x-amzn-bedrock-agentcore-runtime-session-id", &session)],
        emulator.credentials(),
        emulator.region(),
        SystemTime::now(),
        false,
    );
    let url = format!("ws://{host}{target}");
    let mut request =
        tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(url).expect("request");
    for (name, value) in headers.iter().filter(|(name, _)| name != "host") {
        request.headers_mut().insert(
            http::HeaderName::from_bytes(name.as_bytes()).expect("name"),
            http::HeaderValue::from_str(value).expect("value"),
        );
    }
    let stream = tokio::net::TcpStream::connect(emulator.local_addr())
        .await
        .expect("connect");
    let (mut ws, _) = tokio_tungstenite::client_async(request, stream)
        .await
        .expect("upgrade");
    ws.next().await.expect("hello").expect("frame");
    client
        .stop_runtime_session()
        .agent_runtime_arn(emulator.runtime_arn().to_string())
        .runtime_session_id(&session)
        .send()
        .await
        .expect("stop");
    let ended = tokio::time::timeout(Duration::from_secs(5), ws.next())
        .await
        .expect("cut at once");
    assert!(
        !matches!(ended, Some(Ok(tokio_tungstenite::tungstenite::Message::Text(_)))),
        "{ended:?}"
    );
    emulator.shutdown().await.expect("shutdown");
}
