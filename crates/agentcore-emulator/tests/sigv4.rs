//! SigV4: good signatures pass (SDK header auth, hand-signed and presigned WebSocket upgrades);
//! bad ones are refused with AWS's error types and texts, before any worker is involved.

mod common;

use std::time::{Duration, SystemTime};

use agentcore_emulator::{Operation, TestCredentials};
use aws_sdk_bedrockagentcore::error::ProvideErrorMetadata;
use aws_sdk_bedrockagentcore::primitives::Blob;
use common::*;
use futures_util::{SinkExt, StreamExt};
use serde_json::json;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

const SESSION: &str = "x-amzn-bedrock-agentcore-runtime-session-id";

/// The SDK's error for an invocation with `credentials`, as (code, message, status).
async fn refusal(
    emulator: &agentcore_emulator::Emulator,
    credentials: &TestCredentials,
) -> (Option<String>, Option<String>, u16) {
    let client = client_with(emulator, credentials, 1);
    let error = client
        .invoke_agent_runtime()
        .agent_runtime_arn(emulator.runtime_arn().to_string())
        .runtime_session_id(session_id("refused"))
        .payload(Blob::new("{}"))
        .send()
        .await
        .expect_err("refused");
    let status = error.raw_response().map_or(0, |r| r.status().as_u16());
    let service = error.into_service_error();
    (
        service.code().map(str::to_owned),
        service.message().map(str::to_owned),
        status,
    )
}

#[tokio::test]
async fn the_sdks_signed_requests_pass_and_wrong_secrets_or_keys_are_refused_as_aws_refuses_them() {
    let (emulator, _root) = emulator().await;
    let good = client(&emulator);
    invoke_json(&good, &emulator, &session_id("good"), json!({"op": "info"})).await;

    let wrong_secret = TestCredentials::new(emulator.credentials().access_key_id(), "not-the-secret");
    let (code, message, status) = refusal(&emulator, &wrong_secret).await;
    assert_eq!(code.as_deref(), Some("InvalidSignatureException"));
    assert_eq!(status, 403);
    assert!(
        message
            .as_deref()
            .unwrap_or_default()
            .starts_with("The request signature we calculated does not match"),
        "{message:?}"
    );

    let (code, _, status) = refusal(&emulator, &TestCredentials::new("AKIDUNKNOWN", "whatever")).await;
    assert_eq!(
        (code.as_deref(), status),
        (Some("UnrecognizedClientException"), 403)
    );
    // No refused request reached a worker.
    assert_eq!(emulator.requests().iter().filter(|r| r.status == 200).count(), 1);
    emulator.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn session_tokens_must_match_and_an_expired_one_is_refused() {
    let root = tempfile::tempdir().expect("root");
    let credentials = TestCredentials::new("ASIAEMULATED", "temporary-secret").with_session_token("token-1");
    let emulator = emulator_on(root.path())
        .credentials(credentials.clone())
        .start()
        .await
        .expect("emulator");
    invoke_json(
        &client(&emulator),
        &emulator,
        &session_id("token"),
        json!({"op": "info"}),
    )
    .await;

    let other = TestCredentials::new("ASIAEMULATED", "temporary-secret").with_session_token("token-2");
    let (code, _, _) = refusal(&emulator, &other).await;
    assert_eq!(code.as_deref(), Some("UnrecognizedClientException"));

    emulator.expire_session_token(true);
    let (code, message, status) = refusal(&emulator, &credentials).await;
    assert_eq!(
        (code.as_deref(), status),
        (Some("ExpiredTokenException"), 403),
        "{message:?}"
    );
    emulator.expire_session_token(false);
    invoke_json(
        &client(&emulator),
        &emulator,
        &session_id("token"),
        json!({"op": "info"}),
    )
    .await;
    emulator.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn unsigned_and_stale_or_future_requests_are_refused() {
    let (emulator, _root) = emulator().await;
    let host = emulator.local_addr().to_string();
    let arn = emulator
        .runtime_arn()
        .to_string()
        .replace(':', "%3A")
        .replace('/', "%2F");
    let target = format!("/runtimes/{arn}/invocations?qualifier=DEFAULT");
    let session = session_id("dates");

    let mut stream = tokio::net::TcpStream::connect(emulator.local_addr())
        .await
        .expect("connect");
    let headers = vec![
        ("host".to_owned(), host.clone()),
        (SESSION.to_owned(), session.clone()),
        ("content-length".to_owned(), "2".to_owned()),
    ];
    send_raw(&mut stream, "POST", &target, &headers, b"{}").await;
    let answer = read_until(&mut stream, |seen| seen.contains("}")).await;
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    assert!(
        answer.contains("x-amzn-errortype: MissingAuthenticationTokenException"),
        "{answer}"
    );

    for (offset, expected) in [(-1, "Signature expired"), (1, "Signature not yet current")] {
        let when = if offset < 0 {
            SystemTime::now() - Duration::from_secs(600)
        } else {
            SystemTime::now() + Duration::from_secs(600)
        };
        let (signed, mut headers) = sign_raw(
            "POST",
            &host,
            &target,
            &[("content-length", "2"), (SESSION, &session)],
            b"{}",
            emulator.credentials(),
            emulator.region(),
            when,
            false,
        );
        headers.push(("host".into(), host.clone()));
        let mut stream = tokio::net::TcpStream::connect(emulator.local_addr())
            .await
            .expect("connect");
        send_raw(&mut stream, "POST", &signed, &headers, b"{}").await;
        let answer = read_until(&mut stream, |seen| seen.contains("}")).await;
        assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
        assert!(
            answer.contains("x-amzn-errortype: InvalidSignatureException"),
            "{answer}"
        );
        assert!(answer.contains(expected), "{answer}");
    }
    assert!(
        !emulator.is_running(&session),
        "no refused request started a worker"
    );
    emulator.shutdown().await.expect("shutdown");
}

/// Opens a WebSocket with `target` and `headers` (already signed) over plain TCP.
async fn open_ws(
    emulator: &agentcore_emulator::Emulator,
    target: &str,
    headers: &[(String, String)],
) -> Result<tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>, tokio_tungstenite::tungstenite::Error>
{
    let url = format!("ws://{}{target}", emulator.local_addr());
    let mut request = url.into_client_request().expect("ws request");
    for (name, value) in headers {
        if name == "host" {
            continue;
        }
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
}

#[tokio::test]
async fn header_signed_and_presigned_websocket_upgrades_are_accepted_and_reach_the_worker_with_the_session() {
    let (emulator, _root) = emulator().await;
    let (host, path) = ws_target(&emulator);
    let session = session_id("ws");

    // Header-signed, the session header among the signed headers (as openab's bridge signs).
    let (target, headers) = sign_get(
        &host,
        &format!("{path}?qualifier=DEFAULT"),
        &[(SESSION, &session)],
        emulator.credentials(),
        emulator.region(),
        SystemTime::now(),
        false,
    );
    let mut ws = open_ws(&emulator, &target, &headers)
        .await
        .expect("header-signed upgrade");
    let hello = ws.next().await.expect("hello").expect("frame");
    assert_eq!(
        hello.into_text().expect("text").as_str(),
        format!("hello {session}")
    );
    ws.send(Message::text("ping")).await.expect("send");
    let echo = ws.next().await.expect("echo").expect("frame");
    assert_eq!(echo.into_text().expect("text").as_str(), "echo ping");
    drop(ws);

    // Presigned, the session id as a query parameter signed into the URL (as the Python helper does).
    let query = format!("{path}?qualifier=DEFAULT&X-Amzn-Bedrock-AgentCore-Runtime-Session-Id={session}");
    let (target, headers) = sign_get(
        &host,
        &query,
        &[],
        emulator.credentials(),
        emulator.region(),
        SystemTime::now(),
        true,
    );
    assert!(target.contains("X-Amz-Signature="), "{target}");
    let mut ws = open_ws(&emulator, &target, &headers)
        .await
        .expect("presigned upgrade");
    let hello = ws.next().await.expect("hello").expect("frame");
    assert_eq!(
        hello.into_text().expect("text").as_str(),
        format!("hello {session}")
    );
    let upgrades: Vec<_> = emulator
        .requests()
        .into_iter()
        .filter(|r| r.operation == Some(Operation::WebSocket))
        .map(|r| r.status)
        .collect();
    assert_eq!(upgrades, [101, 101]);
    emulator.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn tampered_websocket_upgrades_are_refused_with_403_before_any_upgrade() {
    let (emulator, _root) = emulator().await;
    let (host, path) = ws_target(&emulator);
    let session = session_id("tamper");
    let other = session_id("tamper-other");

    // Signed for one session, sent for another.
    let (target, mut headers) = sign_get(
        &host,
        &format!("{path}?qualifier=DEFAULT"),
        &[(SESSION, &session)],
        emulator.credentials(),
        emulator.region(),
        SystemTime::now(),
        false,
    );
    for (name, value) in &mut headers {
        if name == SESSION {
            *value = other.clone();
        }
    }
    match open_ws(&emulator, &target, &headers).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            assert_eq!(response.status(), 403);
            assert_eq!(
                response
                    .headers()
                    .get("x-amzn-errortype")
                    .and_then(|v| v.to_str().ok()),
                Some("InvalidSignatureException")
            );
        }
        other => panic!("expected a 403, got {:?}", other.map(|_| "an open WebSocket")),
    }

    // A presigned URL with one character of its signature changed.
    let query = format!("{path}?qualifier=DEFAULT&X-Amzn-Bedrock-AgentCore-Runtime-Session-Id={session}");
    let (target, headers) = sign_get(
        &host,
        &query,
        &[],
        emulator.credentials(),
        emulator.region(),
        SystemTime::now(),
        true,
    );
    let at = target.find("X-Amz-Signature=").expect("signature") + "X-Amz-Signature=".len();
    let mut tampered = target.clone();
    let flipped = if &target[at..at + 1] == "0" { "1" } else { "0" };
    tampered.replace_range(at..at + 1, flipped);
    match open_ws(&emulator, &tampered, &headers).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => assert_eq!(response.status(), 403),
        other => panic!("expected a 403, got {:?}", other.map(|_| "an open WebSocket")),
    }
    assert!(
        !emulator.is_running(&session) && !emulator.is_running(&other),
        "no worker was started"
    );
    emulator.shutdown().await.expect("shutdown");
}
