//! A minimal line-oriented JSON-RPC client used by the integration tests.

#![allow(dead_code)]

use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader, Lines};

/// How long any single expected message may take to arrive.
pub(crate) const STEP: Duration = Duration::from_secs(5);

type Reader = Box<dyn AsyncRead + Unpin + Send>;
type Writer = Box<dyn AsyncWrite + Unpin + Send>;

/// The client side of a connection to the agent.
pub(crate) struct Client {
    lines: Lines<BufReader<Reader>>,
    writer: Option<Writer>,
    next_id: u64,
}

impl Client {
    /// Wraps the agent's output (`reader`) and input (`writer`).
    pub(crate) fn new(
        reader: impl AsyncRead + Unpin + Send + 'static,
        writer: impl AsyncWrite + Unpin + Send + 'static,
    ) -> Self {
        Self {
            lines: BufReader::new(Box::new(reader) as Reader).lines(),
            writer: Some(Box::new(writer)),
            next_id: 0,
        }
    }

    /// Writes `text` plus a newline to the agent.
    pub(crate) async fn send_raw(&mut self, text: &str) {
        let writer = self.writer.as_mut().expect("input already closed");
        writer.write_all(text.as_bytes()).await.unwrap();
        writer.write_all(b"\n").await.unwrap();
        writer.flush().await.unwrap();
    }

    /// Sends one JSON message.
    pub(crate) async fn send(&mut self, message: Value) {
        self.send_raw(&message.to_string()).await;
    }

    /// Sends a notification.
    pub(crate) async fn notify(&mut self, method: &str, params: Value) {
        self.send(json!({"jsonrpc": "2.0", "method": method, "params": params}))
            .await;
    }

    /// Sends a request and returns its id.
    pub(crate) async fn request(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = json!(self.next_id);
        self.send(json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}))
            .await;
        id
    }

    /// Closes the agent's input (EOF).
    pub(crate) async fn close_input(&mut self) {
        if let Some(mut writer) = self.writer.take() {
            let _ = writer.shutdown().await;
        }
    }

    /// The next output line, or `None` at EOF. Panics after [`STEP`].
    pub(crate) async fn next_line(&mut self) -> Option<String> {
        tokio::time::timeout(STEP, self.lines.next_line())
            .await
            .expect("timed out waiting for the agent")
            .unwrap()
    }

    /// The next output message; panics on EOF or non-JSON output.
    pub(crate) async fn recv(&mut self) -> Value {
        let line = self.next_line().await.expect("agent output ended");
        let value: Value = serde_json::from_str(&line)
            .unwrap_or_else(|err| panic!("agent wrote a non-JSON line {line:?}: {err}"));
        assert_eq!(value["jsonrpc"], "2.0", "bad envelope: {value}");
        value
    }

    /// Receives messages until the response to `id`; returns the messages
    /// seen before it and the response.
    pub(crate) async fn until_response(&mut self, id: &Value) -> (Vec<Value>, Value) {
        let mut before = Vec::new();
        loop {
            let message = self.recv().await;
            if message.get("method").is_none() && message.get("id") == Some(id) {
                return (before, message);
            }
            before.push(message);
        }
    }

    /// Sends a request and waits for its response.
    pub(crate) async fn call(&mut self, method: &str, params: Value) -> (Vec<Value>, Value) {
        let id = self.request(method, params).await;
        self.until_response(&id).await
    }

    /// `initialize` and `session/new` (cwd `/`); returns the session id.
    pub(crate) async fn new_session(&mut self) -> String {
        let (_, init) = self.call("initialize", json!({"protocolVersion": 1})).await;
        assert!(init.get("result").is_some(), "initialize failed: {init}");
        let (_, created) = self
            .call("session/new", json!({"cwd": "/", "mcpServers": []}))
            .await;
        created["result"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session id in {created}"))
            .to_owned()
    }

    /// Sends `session/prompt` with one text block and returns the request id.
    pub(crate) async fn prompt(&mut self, session: &str, text: &str) -> Value {
        self.request(
            "session/prompt",
            json!({"sessionId": session, "prompt": [{"type": "text", "text": text}]}),
        )
        .await
    }
}

/// The text of an `agent_message_chunk` notification for `session`; panics
/// on anything else.
pub(crate) fn chunk_text(message: &Value, session: &str) -> String {
    assert_eq!(message["method"], "session/update", "not an update: {message}");
    assert_eq!(message["params"]["sessionId"], session, "{message}");
    let update = &message["params"]["update"];
    assert_eq!(update["sessionUpdate"], "agent_message_chunk", "{message}");
    assert_eq!(update["content"]["type"], "text", "{message}");
    update["content"]["text"].as_str().unwrap().to_owned()
}

/// The texts of all the chunk notifications in `messages`.
pub(crate) fn chunk_texts(messages: &[Value], session: &str) -> Vec<String> {
    messages.iter().map(|m| chunk_text(m, session)).collect()
}
