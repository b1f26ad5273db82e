//! Fault injection and the request log.
//!
//! Faults are armed per [`Operation`]: the next `count` calls of it answer the chosen [`Fault`]
//! after their signature was verified (a fault never hides an authentication error) and before
//! any worker is started or reached. Several arming calls queue up in order.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::time::Duration;

use parking_lot::Mutex;

use crate::error::{ErrorKind, ServiceError};

/// An operation of the emulated data plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Operation {
    /// `InvokeAgentRuntime`: `POST /runtimes/{arn}/invocations`.
    Invoke,
    /// `StopRuntimeSession`: `POST /runtimes/{arn}/stopruntimesession`.
    Stop,
    /// The WebSocket upgrade: `GET /runtimes/{arn}/ws`.
    WebSocket,
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Operation::Invoke => "InvokeAgentRuntime",
            Operation::Stop => "StopRuntimeSession",
            Operation::WebSocket => "WebSocket",
        })
    }
}

/// An error answer a call can be made to give.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// 500 `InternalServerException` (the SDK retries it).
    InternalServer,
    /// 429 `ThrottlingException` (the SDK retries it).
    Throttling,
    /// 403 `ExpiredTokenException`.
    ExpiredToken,
    /// 403 `AccessDeniedException`.
    AccessDenied,
    /// 424 `RuntimeClientError`.
    RuntimeClientError,
    /// 503 `ServiceUnavailableException` (the SDK retries it).
    ServiceUnavailable,
    /// 401 `UnauthorizedException`.
    Unauthorized,
    /// 402 `ServiceQuotaExceededException`.
    ServiceQuotaExceeded,
    /// 409 `RetryableConflictException` (the SDK retries it).
    RetryableConflict,
    /// 409 `ConflictException`.
    Conflict,
}

impl Fault {
    /// The error this fault answers.
    pub fn error(self) -> ServiceError {
        let kind = match self {
            Fault::InternalServer => ErrorKind::InternalServer,
            Fault::Throttling => ErrorKind::Throttling,
            Fault::ExpiredToken => ErrorKind::ExpiredToken,
            Fault::AccessDenied => ErrorKind::AccessDenied,
            Fault::RuntimeClientError => ErrorKind::RuntimeClientError,
            Fault::ServiceUnavailable => ErrorKind::ServiceUnavailable,
            Fault::Unauthorized => ErrorKind::Unauthorized,
            Fault::ServiceQuotaExceeded => ErrorKind::ServiceQuotaExceeded,
            Fault::RetryableConflict => ErrorKind::RetryableConflict,
            Fault::Conflict => ErrorKind::Conflict,
        };
        ServiceError::of(kind)
    }
}

/// The armed faults and the slow-stream delay.
#[derive(Debug, Default)]
pub(crate) struct FaultPlan {
    pending: Mutex<HashMap<Operation, VecDeque<Fault>>>,
    chunk_delay: Mutex<Option<Duration>>,
}

impl FaultPlan {
    pub(crate) fn arm(&self, operation: Operation, count: usize, fault: Fault) {
        let mut pending = self.pending.lock();
        let queue = pending.entry(operation).or_default();
        queue.extend(std::iter::repeat_n(fault, count));
    }

    /// The fault the next call of `operation` answers, if one is armed (consumed).
    pub(crate) fn take(&self, operation: Operation) -> Option<Fault> {
        self.pending.lock().get_mut(&operation)?.pop_front()
    }

    pub(crate) fn clear(&self) {
        self.pending.lock().clear();
        *self.chunk_delay.lock() = None;
    }

    pub(crate) fn set_chunk_delay(&self, delay: Option<Duration>) {
        *self.chunk_delay.lock() = delay;
    }

    pub(crate) fn chunk_delay(&self) -> Option<Duration> {
        *self.chunk_delay.lock()
    }
}

/// One request as the emulator answered it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RequestRecord {
    /// The operation, when the path named one.
    pub operation: Option<Operation>,
    /// The HTTP method and encoded path, as sent.
    pub method: String,
    /// The encoded path (without the query).
    pub path: String,
    /// The runtime session id the request carried (header or presigned query), if any.
    pub session_id: Option<String>,
    /// The `qualifier` query parameter, if any.
    pub qualifier: Option<String>,
    /// The SDK's `amz-sdk-request` header (`attempt=1; max=3`), if any.
    pub sdk_request: Option<String>,
    /// The status answered (101 for an accepted WebSocket upgrade).
    pub status: u16,
    /// The `x-amzn-errortype` answered, for errors.
    pub error_type: Option<&'static str>,
}

impl RequestRecord {
    /// The attempt number from `amz-sdk-request` (`attempt=2; max=3` is 2).
    pub fn attempt(&self) -> Option<u32> {
        self.sdk_request.as_deref()?.split(';').find_map(|part| {
            part.trim()
                .strip_prefix("attempt=")
                .and_then(|n| n.trim().parse().ok())
        })
    }
}

/// Everything answered so far, in order.
#[derive(Debug, Default)]
pub(crate) struct RequestLog {
    records: Mutex<Vec<RequestRecord>>,
}

impl RequestLog {
    pub(crate) fn push(&self, record: RequestRecord) {
        tracing::debug!(?record, "agentcore-emulator answered");
        self.records.lock().push(record);
    }

    pub(crate) fn snapshot(&self) -> Vec<RequestRecord> {
        self.records.lock().clone()
    }

    pub(crate) fn clear(&self) {
        self.records.lock().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn armed_faults_are_consumed_in_order_per_operation() {
        let plan = FaultPlan::default();
        plan.arm(Operation::Invoke, 2, Fault::Throttling);
        plan.arm(Operation::Invoke, 1, Fault::InternalServer);
        assert_eq!(plan.take(Operation::Stop), None);
        assert_eq!(plan.take(Operation::Invoke), Some(Fault::Throttling));
        assert_eq!(plan.take(Operation::Invoke), Some(Fault::Throttling));
        assert_eq!(plan.take(Operation::Invoke), Some(Fault::InternalServer));
        assert_eq!(plan.take(Operation::Invoke), None);
    }

    #[test]
    fn the_attempt_number_is_read_from_the_sdk_header() {
        let record = RequestRecord {
            operation: Some(Operation::Invoke),
            method: "POST".into(),
            path: "/".into(),
            session_id: None,
            qualifier: None,
            sdk_request: Some("attempt=2; max=3".into()),
            status: 200,
            error_type: None,
        };
        assert_eq!(record.attempt(), Some(2));
    }
}
