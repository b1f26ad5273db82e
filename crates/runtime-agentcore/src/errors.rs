//! AgentCore's error codes, sorted once into what the broker can act on. Both the SDK's control
//! calls and the WebSocket upgrade (which the SDK does not cover) go through [`Failure`].

use session_runtime::Error;
use worker_relay::Refusal;

use crate::RUNTIME;

/// What kind of failure an AgentCore error code (`x-amzn-errortype`) or HTTP status is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `ResourceNotFoundException`: no such runtime, endpoint or session.
    NotFound,
    /// Throttling or a quota: the same call succeeds later.
    Throttled,
    /// The credentials expired: the same call succeeds once they are refreshed.
    Expired,
    /// Access denied, an unknown key or a bad signature: a configuration or IAM problem.
    Denied,
    /// The request is invalid (`ValidationException`): retrying cannot help.
    Invalid,
    /// A conflicting operation is in progress.
    Conflict,
    /// The service or the container failed (5xx, `RuntimeClientError`).
    Service,
}

impl Kind {
    /// Sorts an error code, falling back on the HTTP status.
    pub(crate) fn of(code: Option<&str>, status: Option<u16>) -> Kind {
        match code.map(|c| c.split(':').next().unwrap_or(c)) {
            Some("ResourceNotFoundException") => Kind::NotFound,
            Some("ThrottlingException" | "ServiceQuotaExceededException" | "TooManyRequestsException") => {
                Kind::Throttled
            }
            Some("ExpiredTokenException" | "ExpiredToken" | "RequestExpired") => Kind::Expired,
            Some(
                "AccessDeniedException"
                | "UnrecognizedClientException"
                | "InvalidSignatureException"
                | "UnauthorizedException"
                | "MissingAuthenticationTokenException"
                | "IncompleteSignatureException",
            ) => Kind::Denied,
            Some("ValidationException") => Kind::Invalid,
            Some("ConflictException" | "RetryableConflictException") => Kind::Conflict,
            Some(
                "InternalServerException"
                | "ServiceUnavailableException"
                | "RuntimeClientError"
                | "ServiceException",
            ) => Kind::Service,
            _ => match status {
                Some(404) => Kind::NotFound,
                Some(429 | 402) => Kind::Throttled,
                Some(401 | 403) => Kind::Denied,
                Some(409) => Kind::Conflict,
                Some(400..=499) => Kind::Invalid,
                _ => Kind::Service,
            },
        }
    }

    /// Whether the same call may succeed if repeated later.
    pub(crate) fn retryable(self) -> bool {
        matches!(
            self,
            Kind::Throttled | Kind::Expired | Kind::Conflict | Kind::Service
        )
    }

    /// What an operator should look at, appended to the service's own words.
    fn hint(self) -> &'static str {
        match self {
            Kind::Denied => {
                "; check the broker's AWS credentials and that its role may call this operation on the runtime (docs/agentcore.md lists the permissions)"
            }
            Kind::Expired => "; the AWS credentials expired and were not refreshed",
            Kind::NotFound => "; check session_runtime.agentcore.runtime_arn and qualifier",
            Kind::Throttled => "; AgentCore is throttling this account: retry later",
            Kind::Invalid | Kind::Conflict | Kind::Service => "",
        }
    }
}

/// One failed AgentCore call: what was done, the service's error code, status and message.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    pub(crate) operation: &'static str,
    pub(crate) code: Option<String>,
    pub(crate) status: Option<u16>,
    pub(crate) message: String,
}

impl Failure {
    pub(crate) fn kind(&self) -> Kind {
        Kind::of(self.code.as_deref(), self.status)
    }

    fn describe(&self) -> String {
        let code = self.code.as_deref().unwrap_or("error");
        let status = self.status.map(|s| format!(" (HTTP {s})")).unwrap_or_default();
        format!(
            "{} failed: {code}{status}: {}{}",
            self.operation,
            self.message,
            self.kind().hint()
        )
    }

    /// The contract's error: [`Error::Backend`], retryable as the kind says.
    pub(crate) fn into_error(self) -> Error {
        let retryable = self.kind().retryable();
        Error::Backend {
            runtime: RUNTIME,
            retryable,
            message: self.describe(),
            source: None,
        }
    }

    /// For the WebSocket connector: throttling and service failures are retried by the relay
    /// client within its budget; everything else ends the attach at once.
    pub(crate) fn into_io(self) -> std::io::Error {
        let kind = self.kind();
        match kind {
            Kind::Throttled | Kind::Service | Kind::Conflict => std::io::Error::other(self.describe()),
            Kind::NotFound | Kind::Expired | Kind::Denied | Kind::Invalid => {
                Refusal::new(kind.retryable(), self.describe()).into_io()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_statuses_sort_into_kinds() {
        let cases = [
            (Some("ThrottlingException"), Some(429), Kind::Throttled, true),
            (
                Some("ServiceQuotaExceededException"),
                Some(402),
                Kind::Throttled,
                true,
            ),
            (Some("ExpiredTokenException"), Some(403), Kind::Expired, true),
            (Some("AccessDeniedException"), Some(403), Kind::Denied, false),
            (Some("InvalidSignatureException"), Some(403), Kind::Denied, false),
            (
                Some("UnrecognizedClientException"),
                Some(403),
                Kind::Denied,
                false,
            ),
            (Some("ValidationException"), Some(400), Kind::Invalid, false),
            (
                Some("ResourceNotFoundException"),
                Some(404),
                Kind::NotFound,
                false,
            ),
            (Some("InternalServerException"), Some(500), Kind::Service, true),
            (Some("RuntimeClientError"), Some(424), Kind::Service, true),
            (
                Some("ConflictException:http://internal.amazon.com/"),
                Some(409),
                Kind::Conflict,
                true,
            ),
            (None, Some(503), Kind::Service, true),
            (None, Some(403), Kind::Denied, false),
            (None, Some(404), Kind::NotFound, false),
            (None, None, Kind::Service, true),
        ];
        for (code, status, kind, retryable) in cases {
            assert_eq!(Kind::of(code, status), kind, "{code:?} {status:?}");
            assert_eq!(kind.retryable(), retryable, "{kind:?}");
        }
    }

    #[test]
    fn connect_failures_are_retried_only_when_they_may_pass() {
        let failure = |code: &str| Failure {
            operation: "opening the session's WebSocket",
            code: Some(code.into()),
            status: None,
            message: "no".into(),
        };
        let denied = failure("AccessDeniedException").into_io();
        let refusal = Refusal::from_io(&denied).expect("denied is a refusal");
        assert!(!refusal.retryable());
        assert!(
            refusal.message().contains("AccessDeniedException"),
            "{}",
            refusal.message()
        );
        let expired = failure("ExpiredTokenException").into_io();
        assert!(Refusal::from_io(&expired).expect("a refusal").retryable());
        assert!(Refusal::from_io(&failure("ThrottlingException").into_io()).is_none());
        assert!(Refusal::from_io(&failure("InternalServerException").into_io()).is_none());
    }
}
