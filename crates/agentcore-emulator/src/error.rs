//! The errors the emulator answers on the wire ([`ErrorKind`], [`ServiceError`]) and the errors
//! its own API returns ([`EmulatorError`], [`WorkerError`]).

use std::fmt;
use std::io;

/// An error type AgentCore's data plane (or the AWS request-authentication front before it)
/// answers with: the value of the `x-amzn-errortype` header and the HTTP status that goes with it.
///
/// The names are the ones the real service sends, so the SDK's error mapping works: the modelled
/// ones become the operation's typed variants (`is_throttling_exception()` …), the others (the
/// authentication errors) arrive as unhandled errors whose `code()` is the name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// 400: a malformed request (bad session id, bad body).
    Validation,
    /// 403: the caller may not do this (an injected fault: the emulator has no IAM).
    AccessDenied,
    /// 404: unknown runtime, qualifier or (for `StopRuntimeSession`) session.
    ResourceNotFound,
    /// 429: too many requests.
    Throttling,
    /// 424: the agent in the session's worker failed or could not be reached.
    RuntimeClientError,
    /// 500: an internal error of the service.
    InternalServer,
    /// 503: the service is unavailable.
    ServiceUnavailable,
    /// 403: the request carries no authentication at all.
    MissingAuthenticationToken,
    /// 403: the access key id (or session token) is not known.
    UnrecognizedClient,
    /// 403: the signature does not match, or its date is too far from now.
    InvalidSignature,
    /// 403: the `Authorization` header or presigned query lacks a part SigV4 needs.
    IncompleteSignature,
    /// 403: the session token has expired.
    ExpiredToken,
    /// 401 `UnauthorizedException` (modelled for `StopRuntimeSession`): the caller is not
    /// authorized.
    Unauthorized,
    /// 402 `ServiceQuotaExceededException`: a quota, such as the active sessions (microVMs)
    /// per account, is used up.
    ServiceQuotaExceeded,
    /// 409 `RetryableConflictException`: the session is busy changing state (its microVM is
    /// still terminating after a stop); the same call succeeds later.
    RetryableConflict,
    /// 409 `ConflictException` (modelled for `StopRuntimeSession`).
    Conflict,
}

impl ErrorKind {
    /// The `x-amzn-errortype` value, e.g. `ThrottlingException`.
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::Validation => "ValidationException",
            ErrorKind::AccessDenied => "AccessDeniedException",
            ErrorKind::ResourceNotFound => "ResourceNotFoundException",
            ErrorKind::Throttling => "ThrottlingException",
            ErrorKind::RuntimeClientError => "RuntimeClientError",
            ErrorKind::InternalServer => "InternalServerException",
            ErrorKind::ServiceUnavailable => "ServiceUnavailableException",
            ErrorKind::MissingAuthenticationToken => "MissingAuthenticationTokenException",
            ErrorKind::UnrecognizedClient => "UnrecognizedClientException",
            ErrorKind::InvalidSignature => "InvalidSignatureException",
            ErrorKind::IncompleteSignature => "IncompleteSignatureException",
            ErrorKind::ExpiredToken => "ExpiredTokenException",
            ErrorKind::Unauthorized => "UnauthorizedException",
            ErrorKind::ServiceQuotaExceeded => "ServiceQuotaExceededException",
            ErrorKind::RetryableConflict => "RetryableConflictException",
            ErrorKind::Conflict => "ConflictException",
        }
    }

    /// The HTTP status that goes with it.
    pub fn status(self) -> u16 {
        match self {
            ErrorKind::Validation => 400,
            ErrorKind::AccessDenied
            | ErrorKind::MissingAuthenticationToken
            | ErrorKind::UnrecognizedClient
            | ErrorKind::InvalidSignature
            | ErrorKind::IncompleteSignature
            | ErrorKind::ExpiredToken => 403,
            ErrorKind::ResourceNotFound => 404,
            ErrorKind::Unauthorized => 401,
            ErrorKind::ServiceQuotaExceeded => 402,
            ErrorKind::RetryableConflict | ErrorKind::Conflict => 409,
            ErrorKind::Throttling => 429,
            ErrorKind::RuntimeClientError => 424,
            ErrorKind::InternalServer => 500,
            ErrorKind::ServiceUnavailable => 503,
        }
    }

    /// The message AWS sends with this error when nothing more specific applies.
    pub fn default_message(self) -> &'static str {
        match self {
            ErrorKind::Validation => "1 validation error detected",
            ErrorKind::AccessDenied => "User is not authorized to perform this action",
            ErrorKind::ResourceNotFound => "The requested resource was not found",
            ErrorKind::Throttling => "Rate exceeded",
            ErrorKind::RuntimeClientError => {
                "Received error from runtime. Please check your CloudWatch logs for more information."
            }
            ErrorKind::InternalServer => "An internal error occurred. Try again later.",
            ErrorKind::ServiceUnavailable => "Service unavailable. Try again later.",
            ErrorKind::MissingAuthenticationToken => "Missing Authentication Token",
            ErrorKind::UnrecognizedClient => "The security token included in the request is invalid.",
            ErrorKind::InvalidSignature => INVALID_SIGNATURE_MESSAGE,
            ErrorKind::IncompleteSignature => "The request signature does not conform to AWS standards.",
            ErrorKind::ExpiredToken => "The security token included in the request is expired",
            ErrorKind::Unauthorized => "Unauthorized",
            ErrorKind::ServiceQuotaExceeded => "Service quota exceeded",
            ErrorKind::RetryableConflict => "The session is being terminated. Retry later.",
            ErrorKind::Conflict => "A conflicting operation is in progress",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// AWS's text for a signature that does not match.
pub(crate) const INVALID_SIGNATURE_MESSAGE: &str = "The request signature we calculated does not match the \
     signature you provided. Check your AWS Secret Access Key and signing method. Consult the service \
     documentation for details.";

/// One error answer: `x-amzn-errortype: <kind>`, the kind's status, and `{"message": …}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceError {
    /// Which error.
    pub kind: ErrorKind,
    /// The `message` field of the JSON body.
    pub message: String,
}

impl ServiceError {
    /// An error of `kind` with `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// An error of `kind` with AWS's usual message for it.
    pub fn of(kind: ErrorKind) -> Self {
        Self::new(kind, kind.default_message())
    }

    /// The JSON body: `{"message": "..."}`.
    pub(crate) fn body(&self) -> Vec<u8> {
        serde_json::json!({ "message": self.message })
            .to_string()
            .into_bytes()
    }
}

impl fmt::Display for ServiceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.kind, self.kind.status(), self.message)
    }
}

impl std::error::Error for ServiceError {}

/// Why a session's worker could not be started, stopped or reset.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// The worker process (or the local runtime under it) could not be started.
    #[error("the worker could not start: {0}")]
    Start(String),
    /// The worker started but did not announce its port in time, or announced something else.
    #[error("the worker did not announce its address: {0}")]
    Announce(String),
    /// Stopping the worker or resetting its storage failed.
    #[error("the worker could not be stopped or its storage reset: {0}")]
    Stop(String),
    /// A local I/O error.
    #[error("worker I/O: {0}")]
    Io(#[from] io::Error),
}

/// An error of the emulator's own API (building, starting, shutting down).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EmulatorError {
    /// A builder setting is not valid.
    #[error("invalid emulator setting {key}: {reason}")]
    InvalidConfig {
        /// The builder method whose value is wrong.
        key: &'static str,
        /// Why.
        reason: String,
    },
    /// The listener could not be bound on 127.0.0.1.
    #[error("cannot listen on 127.0.0.1: {0}")]
    Bind(#[source] io::Error),
    /// A worker operation failed.
    #[error(transparent)]
    Worker(#[from] WorkerError),
}
