//! API errors in the contract's terms: what a retry can fix and what it cannot.

use session_runtime::Error;

use crate::RUNTIME;

/// Whether `error` is the API server's answer with HTTP status `code`.
pub(crate) fn is_status(error: &kube::Error, code: u16) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == code)
}

/// An API failure as [`Error::Backend`]: retryable for throttling, timeouts, conflicts, server
/// errors and broken connections; not retryable for refusals (RBAC, validation, admission), which
/// need an operator.
pub(crate) fn api_error(what: &str, error: kube::Error) -> Error {
    let retryable = match &error {
        kube::Error::Api(status) => matches!(status.code, 409 | 429 | 500..=599),
        kube::Error::HyperError(_) | kube::Error::Service(_) => true,
        _ => false,
    };
    let hint = match &error {
        kube::Error::Api(status) if status.code == 403 => {
            " (the broker's identity lacks this permission: see deploy/kubernetes/broker-rbac.yaml)"
        }
        _ => "",
    };
    Error::backend(RUNTIME, retryable, format!("{what}{hint}"), error)
}

/// Deletes `object` only if it is still the version that was read (UID and resourceVersion
/// preconditions): `true` when it was deleted, `false` when it is gone or changed since, which
/// leaves the decision to the next look at it.
pub(crate) async fn delete_if_unchanged<K>(api: &kube::Api<K>, object: &K, what: &str) -> Result<bool, Error>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Sync,
{
    use kube::ResourceExt;
    let params = kube::api::DeleteParams {
        preconditions: Some(kube::api::Preconditions {
            uid: object.uid(),
            resource_version: object.resource_version(),
        }),
        ..kube::api::DeleteParams::default()
    };
    match api.delete(&object.name_any(), &params).await {
        Ok(_) => Ok(true),
        Err(error) if is_status(&error, 404) || is_status(&error, 409) => Ok(false),
        Err(error) => Err(api_error(what, error)),
    }
}

/// Follows the objects of `api` that `config` selects, on a task of its own that retries with
/// kube's default backoff, handing `apply` each event and each error. Aborting the handle stops
/// it.
pub(crate) fn spawn_watch<K>(
    api: kube::Api<K>,
    config: kube::runtime::watcher::Config,
    mut apply: impl FnMut(kube::runtime::watcher::Result<kube::runtime::watcher::Event<K>>) + Send + 'static,
) -> tokio::task::AbortHandle
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    use futures_util::StreamExt;
    use kube::runtime::WatchStreamExt;
    let stream = kube::runtime::watcher::watcher(api, config).default_backoff();
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            apply(event);
        }
    })
    .abort_handle()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: u16) -> kube::Error {
        kube::Error::Api(Box::new(
            kube::core::Status::failure("said", "Reason").with_code(code),
        ))
    }

    #[test]
    fn refusals_need_an_operator_and_transients_a_retry() {
        for code in [409, 429, 500, 503] {
            assert!(api_error("x", status(code)).retryable(), "{code}");
        }
        for code in [400, 403, 404, 422] {
            assert!(!api_error("x", status(code)).retryable(), "{code}");
        }
        assert!(api_error("reading", status(403))
            .to_string()
            .contains("broker-rbac"));
        assert!(is_status(&status(409), 409) && !is_status(&status(409), 404));
    }
}
