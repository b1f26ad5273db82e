//! The front: accepts connections on 127.0.0.1, reads requests (several per connection when
//! the client keeps it alive), verifies them, and dispatches the three operations.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use crate::arn::{percent_decode, validate_session_id, RuntimeArn};
use crate::credentials::TestCredentials;
use crate::error::{ErrorKind, ServiceError};
use crate::faults::{FaultPlan, Operation, RequestLog, RequestRecord};
use crate::http::{self, Conn, Request};
use crate::iam;
use crate::proxy::{self, After};
use crate::sessions::{NoWorker, Session, Sessions, Ticket};
use crate::sigv4::{self, Expectation};
use crate::websocket::{Ended, WebSocketLimits};
use crate::worker::SessionKey;
use crate::{SESSION_HEADER, SESSION_QUERY_PARAM};

/// The qualifier a request without one addresses.
const DEFAULT_QUALIFIER: &str = "DEFAULT";

/// Everything the front and the lifecycle task share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) region: String,
    pub(crate) runtimes: Vec<RuntimeArn>,
    pub(crate) qualifiers: Vec<String>,
    pub(crate) credentials: TestCredentials,
    pub(crate) token_expired: AtomicBool,
    pub(crate) sessions: Sessions,
    pub(crate) faults: FaultPlan,
    pub(crate) log: RequestLog,
    pub(crate) shutdown: CancellationToken,
    pub(crate) quotas: Quotas,
    /// Recent `InvokeAgentRuntime` and WebSocket calls per endpoint, for the TPS quota.
    pub(crate) calls: Mutex<HashMap<(RuntimeArn, String), VecDeque<Instant>>>,
}

/// The service quotas and platform behaviours the front enforces (see [`EmulatorBuilder`]).
///
/// [`EmulatorBuilder`]: crate::EmulatorBuilder
#[derive(Debug, Clone, Copy)]
pub(crate) struct Quotas {
    pub(crate) websocket: WebSocketLimits,
    pub(crate) stream_bytes_are_activity: bool,
    pub(crate) invocations_per_second: usize,
    pub(crate) chunk_invocation_bodies: bool,
}

/// Accepts connections until shutdown.
pub(crate) async fn serve(shared: Arc<Shared>, listener: TcpListener) {
    loop {
        let accepted = tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, _)) => {
                let shared = Arc::clone(&shared);
                tokio::spawn(async move {
                    let shutdown = shared.shutdown.clone();
                    tokio::select! {
                        _ = shutdown.cancelled() => {}
                        _ = connection(shared, stream) => {}
                    }
                });
            }
            Err(error) => tracing::warn!(%error, "agentcore-emulator accept failed"),
        }
    }
}

/// Serves one client connection.
async fn connection(shared: Arc<Shared>, stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let mut conn = Conn::new(stream);
    loop {
        let request = match conn.read_request().await {
            Ok(Some(request)) => request,
            Ok(None) => return,
            Err(error) => {
                tracing::debug!(%error, "unreadable request");
                let refusal = ServiceError::new(ErrorKind::Validation, format!("malformed request: {error}"));
                let _ = answer_error(&mut conn.stream, &refusal, true).await;
                return;
            }
        };
        let close = request.wants_close();
        match handle(&shared, conn, request).await {
            Some(back) if !close => conn = back,
            _ => return,
        }
    }
}

/// A request id in the shape AWS uses.
fn request_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(1);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{:08x}-e000-4000-8000-{n:012x}", std::process::id())
}

async fn answer_error(stream: &mut TcpStream, error: &ServiceError, close: bool) -> std::io::Result<()> {
    let id = request_id();
    let headers = [
        ("content-type", "application/json"),
        ("x-amzn-errortype", error.kind.name()),
        ("x-amzn-requestid", id.as_str()),
    ];
    http::write_response(stream, error.kind.status(), &headers, &error.body(), close).await
}

/// What a request is, once routed and verified.
struct Routed {
    operation: Operation,
    key: SessionKey,
}

/// Handles one request; gives the connection back if it may carry another.
async fn handle(
    shared: &Arc<Shared>,
    mut conn: Conn<TcpStream>,
    request: Request,
) -> Option<Conn<TcpStream>> {
    let mut record = RequestRecord {
        operation: None,
        method: request.method.clone(),
        path: request.path().to_owned(),
        session_id: request
            .header(SESSION_HEADER)
            .map(str::to_owned)
            .or_else(|| request.query_param_ignoring_case(SESSION_QUERY_PARAM)),
        qualifier: request.query_param("qualifier"),
        sdk_request: request.header("amz-sdk-request").map(str::to_owned),
        status: 0,
        error_type: None,
    };
    let routed = route(shared, &request, &mut record);
    let routed = match routed {
        Ok(routed) => routed,
        Err(error) => {
            record.status = error.kind.status();
            record.error_type = Some(error.kind.name());
            shared.log.push(record);
            let upgrade = request.path().ends_with("/ws");
            let ok = answer_error(&mut conn.stream, &error, upgrade).await.is_ok();
            return (ok && !upgrade).then_some(conn);
        }
    };
    let session = shared.sessions.entry(&routed.key);
    session.touch();
    let session_id = routed.key.session_id().to_owned();
    match routed.operation {
        Operation::Stop => {
            let stopped = shared.sessions.stop(&session, "StopRuntimeSession", None).await;
            let outcome = match stopped {
                Ok(true) => Ok(()),
                Ok(false) => Err(ServiceError::new(
                    ErrorKind::ResourceNotFound,
                    format!("Runtime session '{session_id}' not found or not running"),
                )),
                Err(error) => Err(ServiceError::new(ErrorKind::InternalServer, error.to_string())),
            };
            match outcome {
                Ok(()) => {
                    record.status = 200;
                    shared.log.push(record);
                    let id = request_id();
                    let headers = [
                        ("content-type", "application/json"),
                        (SESSION_HEADER, session_id.as_str()),
                        ("x-amzn-requestid", id.as_str()),
                    ];
                    http::write_response(&mut conn.stream, 200, &headers, b"{}", false)
                        .await
                        .ok()
                        .map(|()| conn)
                }
                Err(error) => {
                    record.status = error.kind.status();
                    record.error_type = Some(error.kind.name());
                    shared.log.push(record);
                    answer_error(&mut conn.stream, &error, false)
                        .await
                        .ok()
                        .map(|()| conn)
                }
            }
        }
        Operation::Invoke => {
            let started = async {
                let ticket = worker_for(shared, &session).await?;
                let invocation = proxy::start_invocation(
                    ticket.addr,
                    &session_id,
                    &request,
                    &ticket.stopped,
                    shared.quotas.chunk_invocation_bodies,
                )
                .await?;
                Ok::<_, ServiceError>((ticket, invocation))
            };
            match started.await {
                Err(error) => {
                    record.status = error.kind.status();
                    record.error_type = Some(error.kind.name());
                    shared.log.push(record);
                    answer_error(&mut conn.stream, &error, false)
                        .await
                        .ok()
                        .map(|()| conn)
                }
                Ok((ticket, invocation)) => {
                    record.status = 200;
                    shared.log.push(record);
                    let id = request_id();
                    let after = proxy::stream_invocation(
                        invocation,
                        &mut conn.stream,
                        &session,
                        &session_id,
                        &id,
                        &ticket.stopped,
                        || shared.faults.chunk_delay(),
                    )
                    .await;
                    (after == After::KeepAlive).then_some(conn)
                }
            }
        }
        Operation::WebSocket => {
            let started = async {
                let ticket = worker_for(shared, &session).await?;
                let upgrade =
                    proxy::start_upgrade(ticket.addr, &session_id, &request, &ticket.stopped).await?;
                Ok::<_, ServiceError>((ticket, upgrade))
            };
            match started.await {
                Err(error) => {
                    record.status = error.kind.status();
                    record.error_type = Some(error.kind.name());
                    shared.log.push(record);
                    let _ = answer_error(&mut conn.stream, &error, true).await;
                    None
                }
                Ok((ticket, upgrade)) => {
                    record.status = upgrade.head.status;
                    shared.log.push(record);
                    if upgrade.head.status != 101 {
                        // The worker refused the upgrade: its answer goes to the client as it is.
                        let _ =
                            tokio::io::AsyncWriteExt::write_all(&mut conn.stream, &upgrade.head.raw).await;
                        return None;
                    }
                    // Cut by a stop of the worker, a dropped-WebSocket fault, or shutdown.
                    let cut = CancellationToken::new();
                    let watchers = [
                        ticket.stopped.clone(),
                        session.websocket_token(),
                        shared.shutdown.clone(),
                    ];
                    let relay_cut = cut.clone();
                    let watch = tokio::spawn(async move {
                        let [stopped, dropped, shutdown] = watchers;
                        tokio::select! {
                            _ = stopped.cancelled() => {}
                            _ = dropped.cancelled() => {}
                            _ = shutdown.cancelled() => {}
                            _ = relay_cut.cancelled() => {}
                        }
                        relay_cut.cancel();
                    });
                    let ended = proxy::splice(
                        upgrade,
                        conn,
                        &session,
                        &cut,
                        shared.quotas.websocket,
                        shared.quotas.stream_bytes_are_activity,
                    )
                    .await;
                    if let Ended::Quota(code, reason) = ended {
                        tracing::info!(code, %reason, session = %session_id, "a WebSocket broke a quota");
                    }
                    cut.cancel();
                    let _ = watch.await;
                    None
                }
            }
        }
    }
}

/// The session's running worker, started if none runs: refused with 409 while a stop is still
/// terminating its microVM, and with 402 when starting one would exceed the active session quota.
async fn worker_for(shared: &Shared, session: &Session) -> Result<Ticket, ServiceError> {
    if session.is_terminating() {
        return Err(ServiceError::new(
            ErrorKind::RetryableConflict,
            format!(
                "Runtime session '{}' is being terminated. Retry after it has stopped.",
                session.key.session_id()
            ),
        ));
    }
    shared
        .sessions
        .ensure_worker(session)
        .await
        .map_err(|error| match error {
            NoWorker::AtCapacity(quota) => ServiceError::new(
                ErrorKind::ServiceQuotaExceeded,
                format!("The account has reached its quota of {quota} active runtime sessions"),
            ),
            NoWorker::Failed(error) => ServiceError::new(ErrorKind::RuntimeClientError, error.to_string()),
        })
}

/// Counts a call on an endpoint against the invocations-per-second quota; `false` if it is over.
fn admit_call(shared: &Shared, runtime: &RuntimeArn, qualifier: &str) -> bool {
    let now = Instant::now();
    let mut calls = shared.calls.lock();
    let recent = calls.entry((runtime.clone(), qualifier.to_owned())).or_default();
    while recent
        .front()
        .is_some_and(|&at| now.duration_since(at) >= Duration::from_secs(1))
    {
        recent.pop_front();
    }
    if recent.len() >= shared.quotas.invocations_per_second {
        return false;
    }
    recent.push_back(now);
    true
}

/// Finds the operation, verifies the signature, the runtime, the qualifier and the session id,
/// the caller's IAM policy, and applies an armed fault, in the order AWS's front does.
fn route(shared: &Shared, request: &Request, record: &mut RequestRecord) -> Result<Routed, ServiceError> {
    let segments: Vec<&str> = request.path().split('/').collect();
    let (label, operation) = match segments.as_slice() {
        ["", "runtimes", label, "invocations"] if request.method == "POST" => (*label, Operation::Invoke),
        ["", "runtimes", label, "stopruntimesession"] if request.method == "POST" => {
            (*label, Operation::Stop)
        }
        ["", "runtimes", label, "ws"] if request.method == "GET" => (*label, Operation::WebSocket),
        _ => {
            return Err(ServiceError::new(
                ErrorKind::ResourceNotFound,
                format!(
                    "No operation {} {} in the emulated AgentCore data plane",
                    request.method,
                    request.path()
                ),
            ))
        }
    };
    record.operation = Some(operation);

    sigv4::verify(
        request,
        Expectation {
            credentials: &shared.credentials,
            region: &shared.region,
            token_expired: shared.token_expired.load(Ordering::Relaxed),
            now: SystemTime::now(),
        },
    )?;

    let runtime = find_runtime(shared, label, request)?;
    let qualifier = request
        .query_param("qualifier")
        .unwrap_or_else(|| DEFAULT_QUALIFIER.to_owned());
    if !valid_qualifier(&qualifier) {
        return Err(ServiceError::new(
            ErrorKind::Validation,
            format!(
                "1 validation error detected: Value '{qualifier}' at 'qualifier' failed to satisfy constraint: Member must satisfy regular expression pattern: [a-zA-Z][a-zA-Z0-9_]{{0,47}}"
            ),
        ));
    }
    if !shared.qualifiers.contains(&qualifier) {
        return Err(ServiceError::new(
            ErrorKind::ResourceNotFound,
            format!("No endpoint or agent found with qualifier '{qualifier}' for agent '{runtime}'"),
        ));
    }
    iam::authorize(
        shared.credentials.policy(),
        shared.credentials.access_key_id(),
        operation,
        &runtime,
        &qualifier,
    )?;
    let session_id = validate_session_id(record.session_id.as_deref())?;
    if operation == Operation::WebSocket {
        let upgrade = request
            .header("upgrade")
            .is_some_and(|value| value.eq_ignore_ascii_case("websocket"));
        if !upgrade || request.header("sec-websocket-key").is_none() {
            return Err(ServiceError::new(
                ErrorKind::Validation,
                "A WebSocket upgrade (Upgrade: websocket, Sec-WebSocket-Key) is required",
            ));
        }
    }
    if operation != Operation::Stop && !admit_call(shared, &runtime, &qualifier) {
        return Err(ServiceError::new(
            ErrorKind::Throttling,
            format!(
                "Rate exceeded: more than {} invocations per second on this endpoint",
                shared.quotas.invocations_per_second
            ),
        ));
    }
    if let Some(fault) = shared.faults.take(operation) {
        return Err(fault.error());
    }
    Ok(Routed {
        operation,
        key: SessionKey::new(runtime, session_id),
    })
}

/// Whether `qualifier` fits the service's pattern for endpoint names, `[a-zA-Z][a-zA-Z0-9_]{0,47}`.
pub(crate) fn valid_qualifier(qualifier: &str) -> bool {
    let mut chars = qualifier.chars();
    chars.next().is_some_and(|first| first.is_ascii_alphabetic())
        && qualifier.len() <= 48
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The runtime a path label names: a percent-encoded ARN, or a bare runtime id with the
/// `accountId` query parameter.
fn find_runtime(shared: &Shared, label: &str, request: &Request) -> Result<RuntimeArn, ServiceError> {
    let decoded = percent_decode(label).unwrap_or_else(|| label.to_owned());
    let found = if decoded.starts_with("arn:") {
        shared.runtimes.iter().find(|arn| arn.to_string() == decoded)
    } else {
        let account = request.query_param("accountId");
        shared
            .runtimes
            .iter()
            .find(|arn| arn.runtime_id() == decoded && account.as_deref() == Some(arn.account()))
    };
    found.cloned().ok_or_else(|| {
        ServiceError::new(
            ErrorKind::ResourceNotFound,
            format!("No agent runtime found for '{decoded}'"),
        )
    })
}
