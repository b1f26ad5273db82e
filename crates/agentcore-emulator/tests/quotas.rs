//! AgentCore's documented limits as the emulator enforces them: IAM per credential, the
//! WebSocket frame size and rate, the qualifier's pattern, the termination window after a stop,
//! the active-session cap, the invocation rate, and WebSocket frames as activity only behind a
//! flag.

mod common;

use std::time::{Duration, SystemTime};

use agentcore_emulator::{Emulator, IamPolicy, TestCredentials, WebSocketLimits};
use aws_sdk_bedrockagentcore::error::ProvideErrorMetadata;
use aws_sdk_bedrockagentcore::primitives::Blob;
use common::*;
use futures_util::{SinkExt, StreamExt};
use serde_json::json;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::Message;

type Socket = tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>;

/// Opens a signed `/ws` of `session` with `credentials`.
async fn open_ws(
    emulator: &Emulator,
    session: &str,
    credentials: &TestCredentials,
) -> Result<Socket, tokio_tungstenite::tungstenite::Error> {
    let (host, path) = ws_target(emulator);
    let (target, headers) = sign_get(
        &host,
        &format!("{path}?qualifier=DEFAULT"),
        &[("x-amzn-bedrock-agentcore-runtime-session-id", session)],
        credentials,
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
    tokio_tungstenite::client_async(request, stream)
        .await
        .map(|(ws, _)| ws)
}

/// The close code the front ends `ws` with, reading past other messages; `None` if the
/// connection ended without a close frame.
async fn close_code(ws: &mut Socket) -> Option<CloseCode> {
    let read = async {
        while let Some(message) = ws.next().await {
            match message {
                Ok(Message::Close(frame)) => return frame.map(|f| f.code),
                Ok(_) => {}
                Err(_) => return None,
            }
        }
        None
    };
    tokio::time::timeout(PATIENCE, read)
        .await
        .expect("the front ends the connection")
}

#[tokio::test]
async fn a_frame_above_32_kb_closes_the_connection_one_at_the_limit_passes() {
    let (emulator, _root) = emulator().await;
    let session = session_id("frame-size");
    let mut ws = open_ws(&emulator, &session, emulator.credentials())
        .await
        .expect("upgrade");
    ws.next().await.expect("hello").expect("a frame");
    let limit = WebSocketLimits::DEFAULT_MAX_FRAME_BYTES;
    // The worker echoes text with `echo ` in front: its answer is exactly at the limit.
    let at_limit = "x".repeat(limit - "echo ".len());
    ws.send(Message::text(at_limit)).await.expect("send");
    match ws.next().await.expect("an echo").expect("a frame") {
        Message::Text(echo) => assert_eq!(echo.len(), limit),
        other => panic!("expected the echo, got {other:?}"),
    }
    ws.send(Message::text("x".repeat(limit + 1))).await.expect("send");
    assert_eq!(close_code(&mut ws).await, Some(CloseCode::Size));
    emulator.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn more_than_250_frames_a_second_close_the_connection() {
    let (emulator, _root) = emulator().await;
    let session = session_id("frame-rate");
    let mut ws = open_ws(&emulator, &session, emulator.credentials())
        .await
        .expect("upgrade");
    ws.next().await.expect("hello").expect("a frame");
    for n in 0..300u32 {
        if ws
            .feed(Message::Binary(n.to_be_bytes().to_vec().into()))
            .await
            .is_err()
        {
            break;
        }
    }
    let _ = ws.flush().await;
    assert_eq!(close_code(&mut ws).await, Some(CloseCode::Policy));
    emulator.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn the_websocket_upgrade_needs_its_own_iam_action() {
    let root = tempfile::tempdir().expect("root");
    let runtime_arn = format!(
        "arn:aws:bedrock-agentcore:{}:{}:runtime/{}",
        agentcore_emulator::DEFAULT_REGION,
        agentcore_emulator::DEFAULT_ACCOUNT,
        agentcore_emulator::DEFAULT_RUNTIME_ID
    );
    let policy = IamPolicy::from_json(
        &json!({"Statement": [{
            "Effect": "Allow",
            "Action": ["bedrock-agentcore:InvokeAgentRuntime", "bedrock-agentcore:StopRuntimeSession"],
            "Resource": [runtime_arn.clone(), format!("{runtime_arn}/runtime-endpoint/*")]
        }]})
        .to_string(),
    )
    .expect("a policy");
    let credentials = TestCredentials::default().with_policy(policy);
    let emulator = emulator_on(root.path())
        .credentials(credentials.clone())
        .start()
        .await
        .expect("emulator starts");
    let session = session_id("iam");
    match open_ws(&emulator, &session, &credentials).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            assert_eq!(response.status().as_u16(), 403);
            assert_eq!(
                response
                    .headers()
                    .get("x-amzn-errortype")
                    .and_then(|v| v.to_str().ok()),
                Some("AccessDeniedException")
            );
        }
        other => panic!("expected AccessDenied, got {:?}", other.map(|_| "an open socket")),
    }
    let client = client_with(&emulator, &credentials, 1);
    invoke(&client, &emulator, &session, json!({"op": "info"}))
        .await
        .expect("InvokeAgentRuntime is allowed");
    emulator.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn a_qualifier_outside_the_services_pattern_is_a_validation_error() {
    let (emulator, _root) = emulator().await;
    let error = client(&emulator)
        .invoke_agent_runtime()
        .agent_runtime_arn(emulator.runtime_arn().to_string())
        .qualifier("my-endpoint")
        .runtime_session_id(session_id("qualifier"))
        .payload(Blob::new("{}"))
        .send()
        .await
        .expect_err("refused")
        .into_service_error();
    assert!(error.is_validation_exception(), "{error:?}");
    emulator.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn calls_during_the_termination_window_conflict_and_pass_after_it() {
    let root = tempfile::tempdir().expect("root");
    let emulator = emulator_on(root.path())
        .stop_latency(Duration::from_millis(500))
        .start()
        .await
        .expect("emulator starts");
    let client = client(&emulator);
    let session = session_id("window");
    invoke_json(&client, &emulator, &session, json!({"op": "info"})).await;
    client
        .stop_runtime_session()
        .agent_runtime_arn(emulator.runtime_arn().to_string())
        .runtime_session_id(&session)
        .send()
        .await
        .expect("stop");
    let error = invoke(&client, &emulator, &session, json!({"op": "info"}))
        .await
        .expect_err("the microVM is still terminating");
    assert!(error.contains("RetryableConflictException"), "{error}");
    tokio::time::sleep(Duration::from_millis(600)).await;
    invoke(&client, &emulator, &session, json!({"op": "info"}))
        .await
        .expect("a new microVM after the window");
    emulator.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn the_active_session_cap_refuses_one_more_microvm() {
    let root = tempfile::tempdir().expect("root");
    let emulator = emulator_on(root.path())
        .max_active_sessions(1)
        .start()
        .await
        .expect("emulator starts");
    let client = client(&emulator);
    let (first, second) = (session_id("cap-a"), session_id("cap-b"));
    invoke_json(&client, &emulator, &first, json!({"op": "info"})).await;
    let error = client
        .invoke_agent_runtime()
        .agent_runtime_arn(emulator.runtime_arn().to_string())
        .runtime_session_id(&second)
        .payload(Blob::new("{}"))
        .send()
        .await
        .expect_err("over the cap");
    assert_eq!(error.raw_response().map(|r| r.status().as_u16()), Some(402));
    assert!(error.into_service_error().is_service_quota_exceeded_exception());
    assert!(emulator.stop_session(&first).await.expect("stop"));
    invoke_json(&client, &emulator, &second, json!({"op": "info"})).await;
    emulator.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn the_invocation_rate_is_capped_per_endpoint() {
    let root = tempfile::tempdir().expect("root");
    let emulator = emulator_on(root.path())
        .invocations_per_second(2)
        .start()
        .await
        .expect("emulator starts");
    let client = client(&emulator);
    let mut codes = Vec::new();
    for n in 0..3 {
        let sent = client
            .invoke_agent_runtime()
            .agent_runtime_arn(emulator.runtime_arn().to_string())
            .runtime_session_id(session_id(&format!("rate-{n}")))
            .payload(Blob::new(json!({"op": "info"}).to_string()))
            .send()
            .await;
        codes.push(
            sent.err()
                .and_then(|e| e.into_service_error().code().map(str::to_owned)),
        );
    }
    assert_eq!(codes, [None, None, Some("ThrottlingException".to_owned())]);
    emulator.shutdown().await.expect("shutdown");
}

/// With the default model, frames on an open WebSocket do not keep a `Healthy` session; with
/// the flag they do.
#[tokio::test]
async fn websocket_frames_are_activity_only_behind_the_flag() {
    for counted in [false, true] {
        let root = tempfile::tempdir().expect("root");
        let emulator = emulator_on(root.path())
            .idle_timeout(Duration::from_millis(600))
            .stream_bytes_are_activity(counted)
            .start()
            .await
            .expect("emulator starts");
        let session = session_id("frames-activity");
        let mut ws = open_ws(&emulator, &session, emulator.credentials())
            .await
            .expect("upgrade");
        ws.next().await.expect("hello").expect("a frame");
        // Three idle timeouts of steady traffic.
        for _ in 0..18 {
            if ws.send(Message::Binary(vec![1u8].into())).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(
            emulator.is_running(&session),
            counted,
            "frames counted as activity: {counted}"
        );
        emulator.shutdown().await.expect("shutdown");
    }
}

/// A `Healthy` worker whose `time_of_last_update` keeps changing is kept (each change restarts
/// the idle clock); once it stops changing, the session idles out.
#[tokio::test]
async fn a_changing_time_of_last_update_restarts_the_idle_clock() {
    let root = tempfile::tempdir().expect("root");
    let idle = Duration::from_millis(600);
    let emulator = emulator_on(root.path())
        .idle_timeout(idle)
        .start()
        .await
        .expect("emulator starts");
    let client = client(&emulator);
    let session = session_id("ticking");
    invoke_json(&client, &emulator, &session, json!({"op": "ticking", "on": true})).await;
    tokio::time::sleep(idle * 4).await;
    assert!(
        emulator.is_running(&session),
        "a changing update time keeps the session"
    );
    invoke_json(
        &client,
        &emulator,
        &session,
        json!({"op": "ticking", "on": false}),
    )
    .await;
    let stopped = tokio::time::timeout(PATIENCE, async {
        while emulator.is_running(&session) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(
        stopped.is_ok(),
        "an unchanging update time lets the session idle out"
    );
    emulator.shutdown().await.expect("shutdown");
}
