//! Drives the agent in-process over `tokio::io::duplex`.

mod common;

use std::io;
use std::time::{Duration, Instant};

use acp_test_agent::{serve, AgentOptions, EXEC_METHOD};
use agent_client_protocol_schema::v1::{
    InitializeResponse, NewSessionResponse, PromptResponse, RequestPermissionRequest, SessionNotification,
    SessionUpdate, StopReason,
};
use common::{chunk_text, chunk_texts, Client, STEP};
use serde_json::{json, Value};
use tokio::task::JoinHandle;

/// Starts `serve` on a task, connected to a fresh client.
fn start(options: AgentOptions) -> (Client, JoinHandle<io::Result<()>>) {
    let (client_input, agent_input) = tokio::io::duplex(1 << 16);
    let (agent_output, client_output) = tokio::io::duplex(1 << 16);
    let server = tokio::spawn(serve(agent_input, agent_output, options));
    (Client::new(client_output, client_input), server)
}

fn stop_reason(response: &Value) -> StopReason {
    serde_json::from_value::<PromptResponse>(response["result"].clone())
        .unwrap_or_else(|err| panic!("not a prompt response {response}: {err}"))
        .stop_reason
}

fn error_code(response: &Value) -> i64 {
    response["error"]["code"]
        .as_i64()
        .unwrap_or_else(|| panic!("not an error response: {response}"))
}

#[tokio::test]
async fn initialize_reports_version_capabilities_and_name() {
    let options = AgentOptions {
        name: "tester".to_owned(),
        ..AgentOptions::default()
    };
    let (mut client, _server) = start(options);
    let (before, response) = client
        .call(
            "initialize",
            json!({"protocolVersion": 1, "clientCapabilities": {}}),
        )
        .await;
    assert!(before.is_empty());
    assert_eq!(response["id"], 1);
    let result = &response["result"];
    assert_eq!(result["protocolVersion"], 1);
    assert_eq!(result["agentCapabilities"]["loadSession"], true);
    assert_eq!(result["agentInfo"]["name"], "tester");
    assert_eq!(result["agentInfo"]["version"], env!("CARGO_PKG_VERSION"));
    let typed: InitializeResponse = serde_json::from_value(result.clone()).unwrap();
    assert!(typed.agent_capabilities.load_session);
}

#[tokio::test]
async fn prompt_streams_three_chunks_then_end_turn() {
    let (mut client, _server) = start(AgentOptions::default());
    let (_, created) = client
        .call("session/new", json!({"cwd": "/tmp", "mcpServers": []}))
        .await;
    let typed: NewSessionResponse = serde_json::from_value(created["result"].clone()).unwrap();
    let session = typed.session_id.0.to_string();
    assert!(!session.is_empty());

    let id = client.prompt(&session, "hello there").await;
    let (updates, response) = client.until_response(&id).await;
    assert_eq!(
        chunk_texts(&updates, &session),
        [
            "echo[0]: hello there",
            "echo[1]: hello there",
            "echo[2]: hello there"
        ]
    );
    for update in &updates {
        let typed: SessionNotification = serde_json::from_value(update["params"].clone()).unwrap();
        assert!(matches!(typed.update, SessionUpdate::AgentMessageChunk(_)));
    }
    assert_eq!(stop_reason(&response), StopReason::EndTurn);
    assert_eq!(response["result"]["stopReason"], "end_turn");
}

#[tokio::test]
async fn session_ids_are_unique() {
    let (mut client, _server) = start(AgentOptions::default());
    let first = client.new_session().await;
    let second = client.new_session().await;
    assert_ne!(first, second);
}

#[tokio::test]
async fn directives_set_chunks_size_and_concatenate_text_blocks() {
    let (mut client, _server) = start(AgentOptions {
        chunks: 1,
        ..AgentOptions::default()
    });
    let session = client.new_session().await;
    let id = client
        .request(
            "session/prompt",
            json!({"sessionId": session, "prompt": [
                {"type": "text", "text": "/chunks=2 /size=5 "},
                {"type": "resource_link", "uri": "file:///x", "name": "x"},
                {"type": "text", "text": "hi you"},
            ]}),
        )
        .await;
    let (updates, response) = client.until_response(&id).await;
    assert_eq!(
        chunk_texts(&updates, &session),
        ["echo[0]: hi youxxxxx", "echo[1]: hi youxxxxx"]
    );
    assert_eq!(stop_reason(&response), StopReason::EndTurn);

    // The option default applies without a directive; zero chunks is allowed.
    let id = client.prompt(&session, "solo").await;
    let (updates, _) = client.until_response(&id).await;
    assert_eq!(chunk_texts(&updates, &session), ["echo[0]: solo"]);
    let id = client.prompt(&session, "/chunks=0").await;
    let (updates, response) = client.until_response(&id).await;
    assert!(updates.is_empty());
    assert_eq!(stop_reason(&response), StopReason::EndTurn);

    // A malformed directive value is invalid params.
    let id = client.prompt(&session, "/chunks=many hi").await;
    let (updates, response) = client.until_response(&id).await;
    assert!(updates.is_empty());
    assert_eq!(error_code(&response), -32602);
}

#[tokio::test]
async fn very_long_prompt_line_is_fine() {
    let (mut client, _server) = start(AgentOptions::default());
    let session = client.new_session().await;
    let message = "y".repeat(3 * 1024 * 1024);
    let id = client
        .prompt(&session, &format!("/chunks=1 /size=1000 {message}"))
        .await;
    let (updates, response) = client.until_response(&id).await;
    let texts = chunk_texts(&updates, &session);
    assert_eq!(texts.len(), 1);
    assert_eq!(texts[0].len(), "echo[0]: ".len() + message.len() + 1000);
    assert!(texts[0].ends_with(&format!("y{}", "x".repeat(1000))));
    assert_eq!(stop_reason(&response), StopReason::EndTurn);
}

#[tokio::test]
async fn bad_session_requests_are_rejected() {
    let (mut client, _server) = start(AgentOptions::default());
    let (_, relative) = client
        .call("session/new", json!({"cwd": "relative/dir", "mcpServers": []}))
        .await;
    assert_eq!(error_code(&relative), -32602);
    let (_, missing) = client.call("session/new", json!({"mcpServers": []})).await;
    assert_eq!(error_code(&missing), -32602);

    let id = client.prompt("no-such-session", "hi").await;
    let (updates, unknown) = client.until_response(&id).await;
    assert!(updates.is_empty());
    assert_eq!(error_code(&unknown), -32002);
    assert!(unknown["error"]["message"]
        .as_str()
        .unwrap()
        .contains("unknown session"));
}

#[tokio::test]
async fn cancel_stops_a_streaming_turn_promptly() {
    let (mut client, _server) = start(AgentOptions::default());
    let session = client.new_session().await;
    let id = client.prompt(&session, "/delay_ms=200 /chunks=50 slow").await;
    let first = client.recv().await;
    assert_eq!(chunk_text(&first, &session), "echo[0]: slow");

    let cancelled_at = Instant::now();
    client
        .notify("session/cancel", json!({"sessionId": session}))
        .await;
    let (updates, response) = client.until_response(&id).await;
    let elapsed = cancelled_at.elapsed();
    assert_eq!(stop_reason(&response), StopReason::Cancelled);
    assert_eq!(response["result"]["stopReason"], "cancelled");
    assert!(updates.len() + 1 < 50, "{} chunks", updates.len() + 1);
    // The 200 ms sleep is interrupted rather than waited out.
    assert!(elapsed < Duration::from_millis(150), "took {elapsed:?}");

    // The session still works afterwards, and a cancel without a turn in
    // progress is ignored.
    client
        .notify("session/cancel", json!({"sessionId": session}))
        .await;
    let id = client.prompt(&session, "/chunks=1 again").await;
    let (updates, response) = client.until_response(&id).await;
    assert_eq!(chunk_texts(&updates, &session), ["echo[0]: again"]);
    assert_eq!(stop_reason(&response), StopReason::EndTurn);
}

#[tokio::test]
async fn cancel_only_affects_its_own_session() {
    let (mut client, _server) = start(AgentOptions::default());
    let one = client.new_session().await;
    let two = client.new_session().await;
    let first = client.prompt(&one, "/delay_ms=100 /chunks=3 a").await;
    let second = client.prompt(&two, "/delay_ms=100 /chunks=3 b").await;
    client.notify("session/cancel", json!({"sessionId": one})).await;
    let mut stops = Vec::new();
    let mut chunks_two = 0;
    while stops.len() < 2 {
        let message = client.recv().await;
        if message.get("method").is_some() {
            if message["params"]["sessionId"] == two.as_str() {
                chunks_two += 1;
            }
            continue;
        }
        stops.push((message["id"].clone(), stop_reason(&message)));
    }
    assert!(stops.contains(&(first, StopReason::Cancelled)), "{stops:?}");
    assert!(stops.contains(&(second, StopReason::EndTurn)), "{stops:?}");
    assert_eq!(chunks_two, 3);
}

/// Starts a `/permission` turn and returns (prompt id, permission request).
async fn permission_turn(client: &mut Client, session: &str) -> (Value, Value) {
    let id = client.prompt(session, "/permission /chunks=2 guarded").await;
    let request = client.recv().await;
    assert_eq!(request["method"], "session/request_permission", "{request}");
    assert!(request["id"].is_string(), "{request}");
    let typed: RequestPermissionRequest = serde_json::from_value(request["params"].clone()).unwrap();
    assert_eq!(&*typed.session_id.0, session);
    let options: Vec<_> = typed
        .options
        .iter()
        .map(|option| {
            (
                option.option_id.0.to_string(),
                serde_json::to_value(option.kind).unwrap(),
            )
        })
        .collect();
    assert_eq!(
        options,
        [
            ("allow".to_owned(), json!("allow_once")),
            ("reject".to_owned(), json!("reject_once"))
        ]
    );
    (id, request)
}

#[tokio::test]
async fn permission_allow_streams_with_prefix() {
    let (mut client, _server) = start(AgentOptions::default());
    let session = client.new_session().await;
    let (id, request) = permission_turn(&mut client, &session).await;
    client
        .send(json!({"jsonrpc": "2.0", "id": request["id"],
            "result": {"outcome": {"outcome": "selected", "optionId": "allow"}}}))
        .await;
    let (updates, response) = client.until_response(&id).await;
    assert_eq!(
        chunk_texts(&updates, &session),
        ["permission: allow; echo[0]: guarded", "echo[1]: guarded"]
    );
    assert_eq!(stop_reason(&response), StopReason::EndTurn);
}

#[tokio::test]
async fn permission_reject_and_cancelled_outcomes() {
    let (mut client, _server) = start(AgentOptions::default());
    let session = client.new_session().await;

    let (id, request) = permission_turn(&mut client, &session).await;
    client
        .send(json!({"jsonrpc": "2.0", "id": request["id"],
            "result": {"outcome": {"outcome": "selected", "optionId": "reject"}}}))
        .await;
    let (updates, response) = client.until_response(&id).await;
    assert_eq!(chunk_texts(&updates, &session), ["permission: reject"]);
    assert_eq!(stop_reason(&response), StopReason::EndTurn);

    let (id, request) = permission_turn(&mut client, &session).await;
    client
        .send(json!({"jsonrpc": "2.0", "id": request["id"],
            "result": {"outcome": {"outcome": "cancelled"}}}))
        .await;
    let (updates, response) = client.until_response(&id).await;
    assert_eq!(chunk_texts(&updates, &session), ["permission: cancelled"]);
    assert_eq!(stop_reason(&response), StopReason::EndTurn);

    // Fresh ids per request.
    let (id, second) = permission_turn(&mut client, &session).await;
    assert_ne!(second["id"], request["id"]);
    client
        .send(json!({"jsonrpc": "2.0", "id": second["id"],
            "error": {"code": -32603, "message": "client failed"}}))
        .await;
    let (updates, _) = client.until_response(&id).await;
    assert_eq!(chunk_texts(&updates, &session), ["permission: cancelled"]);
}

#[tokio::test]
async fn cancel_while_waiting_for_permission() {
    let (mut client, _server) = start(AgentOptions::default());
    let session = client.new_session().await;
    let (id, request) = permission_turn(&mut client, &session).await;
    client
        .notify("session/cancel", json!({"sessionId": session}))
        .await;
    let (updates, response) = client.until_response(&id).await;
    assert!(updates.is_empty(), "{updates:?}");
    assert_eq!(stop_reason(&response), StopReason::Cancelled);
    // The late answer a client sends after cancelling is ignored.
    client
        .send(json!({"jsonrpc": "2.0", "id": request["id"],
            "result": {"outcome": {"outcome": "cancelled"}}}))
        .await;
    let (before, init) = client.call("initialize", json!({"protocolVersion": 1})).await;
    assert!(before.is_empty(), "{before:?}");
    assert_eq!(init["result"]["protocolVersion"], 1);
}

#[tokio::test]
async fn exec_reports_output_and_exit_code() {
    let dir = tempfile::tempdir().unwrap();
    let (mut client, _server) = start(AgentOptions {
        exec_dir: Some(dir.path().to_owned()),
        ..AgentOptions::default()
    });
    let (_, response) = client
        .call(
            EXEC_METHOD,
            json!({"command": "echo out; echo err >&2; pwd; exit 3"}),
        )
        .await;
    let result = &response["result"];
    let expected_dir = dir.path().canonicalize().unwrap();
    assert_eq!(
        result["stdout"],
        format!("out\n{}\n", expected_dir.display()),
        "{response}"
    );
    assert_eq!(result["stderr"], "err\n");
    assert_eq!(result["exitCode"], 3);
    assert_eq!(result["signal"], Value::Null);
    assert_eq!(result["timedOut"], false);

    let (_, response) = client
        .call(EXEC_METHOD, json!({"command": "pwd", "cwd": "/"}))
        .await;
    assert_eq!(response["result"]["stdout"], "/\n");
    assert_eq!(response["result"]["exitCode"], 0);

    let (_, response) = client
        .call(EXEC_METHOD, json!({"command": "pwd", "cwd": "rel"}))
        .await;
    assert_eq!(error_code(&response), -32602);
    let (_, response) = client.call(EXEC_METHOD, json!({"cwd": "/"})).await;
    assert_eq!(error_code(&response), -32602);
}

#[tokio::test]
async fn exec_timeout_kills_the_command() {
    let (mut client, _server) = start(AgentOptions::default());
    let started = Instant::now();
    let (_, response) = client
        .call(
            EXEC_METHOD,
            json!({"command": "echo started; exec sleep 30", "timeout_ms": 200}),
        )
        .await;
    assert!(started.elapsed() < Duration::from_secs(3));
    let result = &response["result"];
    assert_eq!(result["timedOut"], true, "{response}");
    assert_eq!(result["exitCode"], Value::Null);
    assert_eq!(result["signal"], 9);
    assert_eq!(result["stdout"], "started\n");
}

#[tokio::test]
async fn exec_runs_concurrently_with_prompts() {
    let (mut client, _server) = start(AgentOptions::default());
    let session = client.new_session().await;
    let exec = client
        .request(EXEC_METHOD, json!({"command": "sleep 0.3; echo done"}))
        .await;
    let prompt = client.prompt(&session, "/chunks=1 quick").await;
    // The prompt finishes while the exec is still sleeping.
    let (_, response) = client.until_response(&prompt).await;
    assert_eq!(stop_reason(&response), StopReason::EndTurn);
    let (_, response) = client.until_response(&exec).await;
    assert_eq!(response["result"]["stdout"], "done\n");
}

#[tokio::test]
async fn malformed_input_is_answered_and_survived() {
    let (mut client, _server) = start(AgentOptions::default());

    client.send_raw("{this is not json").await;
    let reply = client.recv().await;
    assert_eq!(error_code(&reply), -32700);
    assert_eq!(reply["id"], Value::Null);

    client.send_raw("[1, 2, 3]").await;
    let reply = client.recv().await;
    assert_eq!(error_code(&reply), -32600);
    assert_eq!(reply["id"], Value::Null);

    client.send_raw(r#"{"jsonrpc":"2.0","id":41}"#).await;
    let reply = client.recv().await;
    assert_eq!(error_code(&reply), -32600);
    assert_eq!(reply["id"], 41);

    client
        .send_raw(r#"{"jsonrpc":"1.0","id":42,"method":"initialize","params":{}}"#)
        .await;
    let reply = client.recv().await;
    assert_eq!(error_code(&reply), -32600);
    assert_eq!(reply["id"], 42);

    client
        .send_raw(r#"{"jsonrpc":"2.0","id":"m","method":"no/such_method","params":{}}"#)
        .await;
    let reply = client.recv().await;
    assert_eq!(error_code(&reply), -32601);
    assert_eq!(reply["id"], "m");

    client
        .send_raw(r#"{"jsonrpc":"2.0","id":43,"method":"initialize","params":{"protocolVersion":"one"}}"#)
        .await;
    let reply = client.recv().await;
    assert_eq!(error_code(&reply), -32602);

    // Ignored silently: unknown notifications, blank lines, responses with
    // unknown ids, an unparsable cancel.
    client.notify("no/such_notification", json!({})).await;
    client.send_raw("").await;
    client.send_raw("   \t ").await;
    client
        .send_raw(r#"{"jsonrpc":"2.0","id":"agent-999","result":{}}"#)
        .await;
    client.notify("session/cancel", json!({"bogus": true})).await;

    let (before, response) = client.call("initialize", json!({"protocolVersion": 1})).await;
    assert!(before.is_empty(), "unexpected output: {before:?}");
    assert_eq!(response["result"]["protocolVersion"], 1);
    let session = client.new_session().await;
    let id = client.prompt(&session, "/chunks=1 alive").await;
    let (updates, _) = client.until_response(&id).await;
    assert_eq!(chunk_texts(&updates, &session), ["echo[0]: alive"]);
}

#[tokio::test]
async fn session_load_after_restart_via_state_dir() {
    let state = tempfile::tempdir().unwrap();
    let options = AgentOptions {
        state_dir: Some(state.path().join("nested")),
        ..AgentOptions::default()
    };

    let (mut client, server) = start(options.clone());
    let session = client.new_session().await;
    client.close_input().await;
    tokio::time::timeout(STEP, server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(state.path().join("nested").join(&session).is_file());

    let (mut client, _server) = start(options);
    let (updates, response) = client
        .call(
            "session/load",
            json!({"sessionId": session, "cwd": "/", "mcpServers": []}),
        )
        .await;
    assert_eq!(response["result"], Value::Null, "{response}");
    assert!(response.get("error").is_none());
    assert_eq!(chunk_texts(&updates, &session), [format!("loaded {session}")]);
    let id = client.prompt(&session, "/chunks=1 back").await;
    let (updates, response) = client.until_response(&id).await;
    assert_eq!(chunk_texts(&updates, &session), ["echo[0]: back"]);
    assert_eq!(stop_reason(&response), StopReason::EndTurn);

    for unknown in ["never-created", "../nested", ""] {
        let (updates, response) = client
            .call(
                "session/load",
                json!({"sessionId": unknown, "cwd": "/", "mcpServers": []}),
            )
            .await;
        assert!(updates.is_empty());
        assert_eq!(error_code(&response), -32002, "{response}");
        assert!(response["error"]["message"]
            .as_str()
            .unwrap()
            .contains("unknown session"));
    }
}

#[tokio::test]
async fn without_state_dir_sessions_do_not_survive() {
    let (mut client, server) = start(AgentOptions::default());
    let session = client.new_session().await;
    // Within one instance, load works from memory.
    let (_, response) = client
        .call(
            "session/load",
            json!({"sessionId": session, "cwd": "/", "mcpServers": []}),
        )
        .await;
    assert_eq!(response["result"], Value::Null);
    client.close_input().await;
    server.await.unwrap().unwrap();

    let (mut client, _server) = start(AgentOptions::default());
    let (_, response) = client
        .call(
            "session/load",
            json!({"sessionId": session, "cwd": "/", "mcpServers": []}),
        )
        .await;
    assert_eq!(error_code(&response), -32002);
}

#[tokio::test]
async fn eof_ends_serve_after_finishing_in_flight_turns() {
    let (mut client, server) = start(AgentOptions::default());
    let session = client.new_session().await;
    let id = client.prompt(&session, "/chunks=3 /delay_ms=30 last words").await;
    client.close_input().await;
    let (updates, response) = client.until_response(&id).await;
    assert_eq!(updates.len(), 3);
    assert_eq!(stop_reason(&response), StopReason::EndTurn);
    // Output ends and serve returns Ok.
    assert_eq!(client.next_line().await, None);
    tokio::time::timeout(STEP, server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn eof_resolves_a_pending_permission_as_cancelled() {
    let (mut client, server) = start(AgentOptions::default());
    let session = client.new_session().await;
    let (id, _request) = permission_turn(&mut client, &session).await;
    client.close_input().await;
    let (updates, response) = client.until_response(&id).await;
    assert_eq!(chunk_texts(&updates, &session), ["permission: cancelled"]);
    assert_eq!(stop_reason(&response), StopReason::EndTurn);
    tokio::time::timeout(STEP, server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn ignore_stdin_eof_keeps_serving_in_flight_work() {
    let (mut client, mut server) = start(AgentOptions {
        ignore_stdin_eof: true,
        ..AgentOptions::default()
    });
    let session = client.new_session().await;
    let id = client.prompt(&session, "/chunks=2 /delay_ms=50 tail").await;
    client.close_input().await;
    let (updates, response) = client.until_response(&id).await;
    assert_eq!(
        chunk_texts(&updates, &session),
        ["echo[0]: tail", "echo[1]: tail"]
    );
    assert_eq!(stop_reason(&response), StopReason::EndTurn);
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut server)
            .await
            .is_err(),
        "serve returned although ignore_stdin_eof is set"
    );
    server.abort();
}
