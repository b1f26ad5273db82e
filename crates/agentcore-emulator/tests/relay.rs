//! The default worker for real: `oab-relay serve --http 127.0.0.1:0 --agentcore -- acp-test-agent`
//! under the local sandbox, reached through the emulator by the SDK and a signed WebSocket.

mod common;

use std::time::SystemTime;

use agentcore_emulator::{Emulator, Operation, WorkerCommand};
use aws_sdk_bedrockagentcore::primitives::Blob;
use common::*;
use worker_relay::agentcore::RuntimeSessionId;
use worker_relay::BrokerKey;

/// A runtime session id in the relay's `oab1` scheme.
fn oab1_session(session: &str) -> String {
    let key = BrokerKey::new(b"agentcore-emulator-tests-key-32b".to_vec());
    let token = key.token(session, 1);
    RuntimeSessionId::new(session, 1, &token)
        .expect("valid session")
        .to_string()
}

#[tokio::test]
#[ignore = "needs the relay and the ACP test agent built: cargo build -p worker-relay --bin oab-relay -p acp-test-agent, \
            then cargo test -p agentcore-emulator --test relay -- --ignored"]
async fn the_relay_serves_invocations_and_the_signed_websocket_through_the_emulator() {
    let (relay, agent) = relay_and_agent();
    let root = tempfile::tempdir().expect("root");
    let launcher = agentcore_emulator::LocalLauncher::builder(WorkerCommand::relay(
        relay.display().to_string(),
        [agent.display().to_string()],
    ))
    .root(root.path())
    .build()
    .expect("launcher");
    let emulator = Emulator::builder()
        .launcher(launcher)
        .start()
        .await
        .expect("emulator");
    eprintln!("sandbox: {}", emulator.sandbox());
    let session = oab1_session("abcdefghijklmnopqrst");
    let client = client(&emulator);
    let out = client
        .invoke_agent_runtime()
        .agent_runtime_arn(emulator.runtime_arn().to_string())
        .runtime_session_id(&session)
        .content_type("application/json")
        .payload(Blob::new("{}"))
        .send()
        .await
        .expect("the relay answers /invocations");
    let body = out.response.collect().await.expect("body").into_bytes();
    assert!(!body.is_empty());
    assert!(emulator.is_running(&session));
    assert!(
        emulator.session_storage(&session).await.is_some(),
        "the session has storage"
    );

    let (host, path) = ws_target(&emulator);
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
    let (ws, response) = tokio_tungstenite::client_async(request, stream)
        .await
        .expect("the relay accepts the upgrade with the session header the emulator passes on");
    assert_eq!(response.status(), 101);
    drop(ws);
    let upgrades: Vec<_> = emulator
        .requests()
        .into_iter()
        .filter(|r| r.operation == Some(Operation::WebSocket))
        .map(|r| r.status)
        .collect();
    assert_eq!(upgrades, [101]);
    assert!(emulator.stop_session(&session).await.expect("stop"));
    emulator.shutdown().await.expect("shutdown");
}
