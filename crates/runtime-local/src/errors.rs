//! Errors of this runtime that carry an OS cause.

/// A backend error caused by `source` (an OS error, mostly): its text is kept in the message, so
/// that whoever shows only the message still sees the cause (`ENOTDIR`, `EROFS`, `ENOSPC`), and
/// the error itself stays in the chain (`std::error::Error::source`).
pub(crate) fn backend_error<E>(
    retryable: bool,
    what: impl std::fmt::Display,
    source: E,
) -> session_runtime::Error
where
    E: std::error::Error + Send + Sync + 'static,
{
    session_runtime::Error::Backend {
        runtime: crate::RUNTIME,
        retryable,
        message: format!("{what}: {source}"),
        source: Some(Box::new(source)),
    }
}
