//! JSON-RPC 2.0 envelope handling: classifying incoming lines and building
//! outgoing messages.

use agent_client_protocol_schema::v1::Error as RpcError;
use serde::Serialize;
use serde_json::{json, Map, Value};

/// JSON-RPC "Parse error".
pub(crate) const PARSE_ERROR: i32 = -32700;
/// JSON-RPC "Invalid Request".
pub(crate) const INVALID_REQUEST: i32 = -32600;
/// JSON-RPC "Method not found".
pub(crate) const METHOD_NOT_FOUND: i32 = -32601;
/// JSON-RPC "Invalid params".
pub(crate) const INVALID_PARAMS: i32 = -32602;
/// JSON-RPC "Internal error".
pub(crate) const INTERNAL_ERROR: i32 = -32603;
/// ACP "Resource not found".
pub(crate) const RESOURCE_NOT_FOUND: i32 = -32002;

/// One classified incoming message.
#[derive(Debug)]
pub(crate) enum Incoming {
    /// A request: it carries an id and must be answered.
    Request {
        /// The request id, echoed in the answer.
        id: Value,
        /// The method name.
        method: String,
        /// The parameters (`{}` when absent).
        params: Value,
    },
    /// A notification: no id, never answered.
    Notification {
        /// The method name.
        method: String,
        /// The parameters (`{}` when absent).
        params: Value,
    },
    /// A response from the client to a request the agent sent.
    Response {
        /// The id of the agent's request.
        id: Value,
        /// `Ok(result)` or `Err(error object)`.
        outcome: Result<Value, Value>,
    },
    /// Something that must be answered with an error (id may be null).
    Invalid {
        /// The id to answer with (`null` when it could not be determined).
        id: Value,
        /// The error to send.
        error: RpcError,
    },
}

/// Whether `id` is an acceptable JSON-RPC id (string, number or null).
fn valid_id(id: &Value) -> bool {
    matches!(id, Value::String(_) | Value::Number(_) | Value::Null)
}

/// Classifies one line of input (already stripped of its newline).
pub(crate) fn classify(line: &[u8]) -> Incoming {
    let value: Value = match serde_json::from_slice(line) {
        Ok(value) => value,
        Err(err) => {
            return Incoming::Invalid {
                id: Value::Null,
                error: RpcError::new(PARSE_ERROR, format!("Parse error: {err}")),
            }
        }
    };
    let Value::Object(mut object) = value else {
        return Incoming::Invalid {
            id: Value::Null,
            error: RpcError::new(INVALID_REQUEST, "Invalid request: not a JSON object"),
        };
    };
    let id = object.remove("id");
    if let Some(id) = &id {
        if !valid_id(id) {
            return Incoming::Invalid {
                id: Value::Null,
                error: RpcError::new(INVALID_REQUEST, "Invalid request: bad id type"),
            };
        }
    }
    let reply_id = id.clone().unwrap_or(Value::Null);
    if object.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Incoming::Invalid {
            id: reply_id,
            error: RpcError::new(INVALID_REQUEST, "Invalid request: jsonrpc must be \"2.0\""),
        };
    }
    match object.remove("method") {
        Some(Value::String(method)) => {
            let params = match object.remove("params") {
                None | Some(Value::Null) => Value::Object(Map::new()),
                Some(params @ (Value::Object(_) | Value::Array(_))) => params,
                Some(_) => {
                    return Incoming::Invalid {
                        id: reply_id,
                        error: RpcError::new(
                            INVALID_REQUEST,
                            "Invalid request: params must be an object or array",
                        ),
                    }
                }
            };
            match id {
                Some(id) => Incoming::Request { id, method, params },
                None => Incoming::Notification { method, params },
            }
        }
        Some(_) => Incoming::Invalid {
            id: reply_id,
            error: RpcError::new(INVALID_REQUEST, "Invalid request: method must be a string"),
        },
        None => {
            let result = object.remove("result");
            let error = object.remove("error");
            match (id, result, error) {
                (Some(id), Some(result), None) => Incoming::Response {
                    id,
                    outcome: Ok(result),
                },
                (Some(id), None, Some(error)) => Incoming::Response {
                    id,
                    outcome: Err(error),
                },
                _ => Incoming::Invalid {
                    id: reply_id,
                    error: RpcError::new(
                        INVALID_REQUEST,
                        "Invalid request: missing method (and not a response)",
                    ),
                },
            }
        }
    }
}

/// Serializes a payload type into a JSON value. The schema types always
/// serialize; a failure here would be a programming error, reported as null.
pub(crate) fn to_value<T: Serialize>(payload: &T) -> Value {
    serde_json::to_value(payload).unwrap_or(Value::Null)
}

/// One line (with trailing newline) carrying a successful response.
pub(crate) fn result_line(id: &Value, result: Value) -> String {
    line(&json!({"jsonrpc": "2.0", "id": id, "result": result}))
}

/// One line (with trailing newline) carrying an error response.
pub(crate) fn error_line(id: &Value, error: &RpcError) -> String {
    line(&json!({"jsonrpc": "2.0", "id": id, "error": to_value(error)}))
}

/// One line (with trailing newline) carrying a notification.
pub(crate) fn notification_line(method: &str, params: Value) -> String {
    line(&json!({"jsonrpc": "2.0", "method": method, "params": params}))
}

/// One line (with trailing newline) carrying a request from the agent.
pub(crate) fn request_line(id: &str, method: &str, params: Value) -> String {
    line(&json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}))
}

fn line(value: &Value) -> String {
    let mut text = value.to_string();
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_messages() {
        assert!(matches!(
            classify(br#"{"jsonrpc":"2.0","id":1,"method":"x"}"#),
            Incoming::Request { .. }
        ));
        assert!(matches!(
            classify(br#"{"jsonrpc":"2.0","method":"x","params":{}}"#),
            Incoming::Notification { .. }
        ));
        assert!(matches!(
            classify(br#"{"jsonrpc":"2.0","id":"a","result":null}"#),
            Incoming::Response {
                outcome: Ok(Value::Null),
                ..
            }
        ));
        assert!(matches!(
            classify(br#"{"jsonrpc":"2.0","id":"a","error":{"code":1,"message":"m"}}"#),
            Incoming::Response { outcome: Err(_), .. }
        ));
        let code = |line: &[u8]| match classify(line) {
            Incoming::Invalid { error, .. } => i32::from(error.code),
            other => panic!("expected invalid, got {other:?}"),
        };
        assert_eq!(code(b"{nope"), PARSE_ERROR);
        assert_eq!(code(b"[1,2]"), INVALID_REQUEST);
        assert_eq!(code(br#"{"jsonrpc":"1.0","id":1,"method":"x"}"#), INVALID_REQUEST);
        assert_eq!(
            code(br#"{"jsonrpc":"2.0","id":{},"method":"x"}"#),
            INVALID_REQUEST
        );
        assert_eq!(code(br#"{"jsonrpc":"2.0","id":1,"method":7}"#), INVALID_REQUEST);
        assert_eq!(code(br#"{"jsonrpc":"2.0","id":1}"#), INVALID_REQUEST);
        assert_eq!(
            code(br#"{"jsonrpc":"2.0","id":1,"method":"x","params":3}"#),
            INVALID_REQUEST
        );
    }
}
