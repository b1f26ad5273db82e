//! The AWS side: the SDK client for `StopRuntimeSession` and `InvokeAgentRuntime`, and the
//! credentials the WebSocket upgrade is signed with.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use aws_credential_types::provider::{ProvideCredentials, SharedCredentialsProvider};
use aws_credential_types::Credentials;
use aws_sdk_bedrockagentcore::config::retry::RetryConfig;
use aws_sdk_bedrockagentcore::config::{BehaviorVersion, Region, StalledStreamProtectionConfig};
use aws_sdk_bedrockagentcore::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_bedrockagentcore::primitives::Blob;
use aws_sdk_bedrockagentcore::Client;
use session_runtime::config::AgentCoreConfig;
use tokio::sync::Mutex;

use crate::errors::{Failure, Kind};
use crate::trust::TrustRoots;

/// How many attempts an idempotent control call gets.
const CONTROL_ATTEMPTS: u32 = 3;

/// How long a control call keeps retrying `409` conflicts (`RetryableConflictException`): a
/// stopped session's microVM takes up to 15 s to terminate, and the session answers conflicts
/// until it has; twice that leaves room. The SDK's own attempts (three, about three seconds)
/// cannot cover it.
const CONFLICT_PATIENCE: Duration = Duration::from_secs(30);
/// The first pause between conflict retries; it doubles up to [`CONFLICT_PAUSE_MAX`].
const CONFLICT_PAUSE: Duration = Duration::from_millis(250);
const CONFLICT_PAUSE_MAX: Duration = Duration::from_secs(2);

/// Refresh cached credentials this long before they expire.
const CREDENTIALS_MARGIN: Duration = Duration::from_secs(300);

/// Where the runtime's AWS calls go, and how they are authorized.
#[derive(Debug, Clone)]
pub(crate) struct Aws {
    client: Client,
    credentials: CachedCredentials,
    pub(crate) region: String,
    pub(crate) arn: String,
    pub(crate) qualifier: String,
    /// The configured `endpoint_url`, else the SDK's endpoint for the region (its partition,
    /// FIPS and dual-stack settings).
    pub(crate) endpoint: String,
}

/// The SDK's HTTPS client (hyper 1, rustls with aws-lc-rs: what its `default-https-client`
/// builds) trusting [`TrustRoots`] instead of loading the system's roots on its own, so that an
/// image without a CA bundle still reaches AWS. Also used by the credential providers the
/// loader builds (STS, SSO, container and instance metadata).
pub(crate) fn https_client() -> aws_smithy_runtime_api::client::http::SharedHttpClient {
    use aws_smithy_http_client::tls::{self, rustls_provider::CryptoMode, TlsContext};
    let context = TlsContext::builder()
        .with_trust_store(TrustRoots::get().sdk_trust_store())
        .build();
    let builder =
        aws_smithy_http_client::Builder::new().tls_provider(tls::Provider::Rustls(CryptoMode::AwsLc));
    match context {
        Ok(context) => builder.tls_context(context).build_https(),
        Err(error) => {
            // Building a context cannot fail in this version; if a later one can, keep the
            // SDK's own trust store rather than no client.
            tracing::warn!(%error, "the SDK's TLS context: falling back to its default trust store");
            builder.build_https()
        }
    }
}

/// The outcome of `StopRuntimeSession`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stopped {
    /// The session was running and is stopped.
    Stopped,
    /// No such session was running (stopped already, never started, or expired).
    NotRunning,
}

impl Aws {
    /// Loads the SDK configuration: `credentials` if given, else the standard provider chain
    /// (environment, profile files, web identity, container and instance metadata).
    pub(crate) async fn load(
        config: &AgentCoreConfig,
        credentials: Option<SharedCredentialsProvider>,
    ) -> Self {
        let region = config.effective_region().unwrap_or("us-east-1").to_owned();
        let mut loader = aws_config::defaults(BehaviorVersion::latest()).region(Region::new(region.clone()));
        if let Some(credentials) = credentials {
            loader = loader.credentials_provider(credentials);
        }
        loader = loader.http_client(https_client());
        let shared = loader.load().await;
        let endpoint = match &config.endpoint_url {
            Some(url) => url.trim_end_matches('/').to_owned(),
            None => {
                resolve_endpoint(
                    &region,
                    shared.use_fips().unwrap_or(false),
                    shared.use_dual_stack().unwrap_or(false),
                )
                .await
            }
        };
        // Control calls are idempotent (StopRuntimeSession carries a client token; the wipe
        // invocation is idempotent by design), so standard retries are safe. Nothing streams
        // through the SDK: the session's stream is the relay's WebSocket.
        let sdk = aws_sdk_bedrockagentcore::config::Builder::from(&shared)
            .retry_config(RetryConfig::standard().with_max_attempts(CONTROL_ATTEMPTS))
            .stalled_stream_protection(StalledStreamProtectionConfig::disabled())
            .endpoint_url(endpoint.clone())
            .build();
        Self {
            client: Client::from_conf(sdk),
            credentials: CachedCredentials::new(shared.credentials_provider()),
            region,
            arn: config.runtime_arn.clone(),
            qualifier: config.effective_qualifier().to_owned(),
            endpoint,
        }
    }

    /// Stops the runtime session `runtime_session_id`: its microVM ends at once, cutting every
    /// stream to it. A session that is not running counts as stopped.
    ///
    /// # Errors
    /// The call's [`Failure`] once the SDK's retries (and, for `409` conflicts, up to
    /// [`CONFLICT_PATIENCE`] of this function's own) are spent.
    ///
    /// # Idempotency
    /// `StopRuntimeSession` is; repeating it is safe.
    ///
    /// # Cancellation
    /// Dropping the future abandons the call; the session may or may not be stopped.
    pub(crate) async fn stop(&self, runtime_session_id: &str) -> Result<Stopped, Failure> {
        let sent = retry_conflicts(|| async {
            self.client
                .stop_runtime_session()
                .agent_runtime_arn(&self.arn)
                .qualifier(&self.qualifier)
                .runtime_session_id(runtime_session_id)
                .send()
                .await
                .map(|_| ())
                .map_err(|error| failure("StopRuntimeSession", &error))
        })
        .await;
        match sent {
            Ok(()) => Ok(Stopped::Stopped),
            Err(failure) if failure.kind() == Kind::NotFound => Ok(Stopped::NotRunning),
            Err(failure) => Err(failure),
        }
    }

    /// Sends `payload` to the container's `/invocations` in `runtime_session_id`'s microVM
    /// (starting one if none runs) and returns the answer's body.
    ///
    /// # Errors
    /// The call's [`Failure`] once the SDK's retries (and, for `409` conflicts such as the
    /// termination window after a stop, up to [`CONFLICT_PATIENCE`] of this function's own) are
    /// spent.
    ///
    /// # Idempotency
    /// Only for payloads whose effect is idempotent (the wipe request is): a retried call
    /// delivers the payload again.
    ///
    /// # Cancellation
    /// Dropping the future abandons the call; the container may have received the payload.
    pub(crate) async fn invoke(
        &self,
        runtime_session_id: &str,
        payload: Vec<u8>,
    ) -> Result<Vec<u8>, Failure> {
        retry_conflicts(|| async {
            let output = self
                .client
                .invoke_agent_runtime()
                .agent_runtime_arn(&self.arn)
                .qualifier(&self.qualifier)
                .runtime_session_id(runtime_session_id)
                .content_type("text/plain")
                .accept("application/json")
                .payload(Blob::new(payload.clone()))
                .send()
                .await
                .map_err(|error| failure("InvokeAgentRuntime", &error))?;
            let body = output.response.collect().await.map_err(|error| Failure {
                operation: "InvokeAgentRuntime",
                code: None,
                status: None,
                message: format!("reading the answer: {error}"),
            })?;
            Ok(body.into_bytes().to_vec())
        })
        .await
    }

    /// Credentials for signing the WebSocket upgrade.
    pub(crate) async fn credentials(&self) -> Result<Credentials, Failure> {
        self.credentials.get().await
    }
}

/// AgentCore's data-plane endpoint for `region`, as the SDK's own rules resolve it: the
/// partition's domain (`amazonaws.com`, `amazonaws.com.cn`, ...) and the FIPS or dual-stack
/// variant the SDK configuration asks for (`AWS_USE_FIPS_ENDPOINT`, `use_fips_endpoint` in a
/// profile). The WebSocket goes to the same host as the SDK's calls.
///
/// A region the rules cannot place (the configuration already checked its shape) falls back on
/// the commercial partition's name, with a warning.
async fn resolve_endpoint(region: &str, fips: bool, dual_stack: bool) -> String {
    use aws_sdk_bedrockagentcore::config::endpoint::{DefaultResolver, Params, ResolveEndpoint};
    let fallback = || format!("https://bedrock-agentcore.{region}.amazonaws.com");
    let params = match Params::builder()
        .region(region)
        .use_fips(fips)
        .use_dual_stack(dual_stack)
        .build()
    {
        Ok(params) => params,
        Err(error) => {
            tracing::warn!(%error, region, "no endpoint rules for the region; using the commercial domain");
            return fallback();
        }
    };
    match DefaultResolver::new().resolve_endpoint(&params).await {
        Ok(endpoint) => endpoint.url().trim_end_matches('/').to_owned(),
        Err(error) => {
            tracing::warn!(%error, region, "no endpoint rules for the region; using the commercial domain");
            fallback()
        }
    }
}

/// Runs `call` again while it fails with a conflict ([`Kind::Conflict`]: the session is
/// changing state, e.g. its microVM is still terminating), pausing between attempts, for up to
/// [`CONFLICT_PATIENCE`]; any other outcome is returned at once.
async fn retry_conflicts<T, F, Fut>(mut call: F) -> Result<T, Failure>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, Failure>>,
{
    let deadline = tokio::time::Instant::now() + CONFLICT_PATIENCE;
    let mut pause = CONFLICT_PAUSE;
    loop {
        match call().await {
            Err(failure)
                if failure.kind() == Kind::Conflict && tokio::time::Instant::now() + pause < deadline =>
            {
                tracing::debug!(
                    operation = failure.operation,
                    "a conflict: the session is changing state, retrying"
                );
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(CONFLICT_PAUSE_MAX);
            }
            outcome => return outcome,
        }
    }
}

fn failure<E, R>(operation: &'static str, error: &SdkError<E, R>) -> Failure
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
    R: std::fmt::Debug + HasStatus,
{
    let (code, message) = match error {
        SdkError::ServiceError(service) => (
            service.err().code().map(str::to_owned),
            service
                .err()
                .message()
                .map_or_else(|| DisplayErrorContext(error).to_string(), str::to_owned),
        ),
        _ => (None, DisplayErrorContext(error).to_string()),
    };
    let status = error.raw_response().map(HasStatus::status);
    // A request that never got an answer (no credentials, no connection) has no status; one that
    // could not even be built is a configuration problem, not a service failure.
    let code = code
        .or_else(|| matches!(error, SdkError::ConstructionFailure(_)).then(|| "ValidationException".into()));
    Failure {
        operation,
        code,
        status,
        message,
    }
}

/// The HTTP status of a raw response.
pub(crate) trait HasStatus {
    fn status(&self) -> u16;
}

impl HasStatus for aws_smithy_runtime_api::http::Response {
    fn status(&self) -> u16 {
        self.status().as_u16()
    }
}

/// The provider chain's credentials, kept until shortly before they expire (the SDK caches its
/// own; the WebSocket signer must not walk the chain, perhaps over the network, per connection).
#[derive(Debug, Clone)]
struct CachedCredentials {
    provider: Option<SharedCredentialsProvider>,
    cached: Arc<Mutex<Option<Credentials>>>,
}

impl CachedCredentials {
    fn new(provider: Option<SharedCredentialsProvider>) -> Self {
        Self {
            provider,
            cached: Arc::new(Mutex::new(None)),
        }
    }

    async fn get(&self) -> Result<Credentials, Failure> {
        let mut cached = self.cached.lock().await;
        if let Some(credentials) = cached.as_ref() {
            let fresh = credentials
                .expiry()
                .is_none_or(|expiry| SystemTime::now() + CREDENTIALS_MARGIN < expiry);
            if fresh {
                return Ok(credentials.clone());
            }
        }
        let Some(provider) = &self.provider else {
            return Err(Failure {
                operation: "loading AWS credentials",
                code: Some("UnrecognizedClientException".into()),
                status: None,
                message: "no credentials provider is configured".into(),
            });
        };
        let credentials = provider.provide_credentials().await.map_err(|error| Failure {
            operation: "loading AWS credentials",
            // The chain found nothing or could not refresh: a later attempt may succeed.
            code: Some("ExpiredTokenException".into()),
            status: None,
            message: DisplayErrorContext(&error).to_string(),
        })?;
        *cached = Some(credentials.clone());
        Ok(credentials)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(arn: &str) -> AgentCoreConfig {
        AgentCoreConfig::new(arn)
    }

    /// The endpoint follows the runtime's partition (`amazonaws.com.cn` in China), never a
    /// hard-coded domain.
    #[tokio::test]
    async fn the_default_endpoint_follows_the_partition() {
        let cases = [
            (
                "arn:aws:bedrock-agentcore:us-east-1:123456789012:runtime/a-AbCdEf1234",
                "https://bedrock-agentcore.us-east-1.amazonaws.com",
            ),
            (
                "arn:aws-cn:bedrock-agentcore:cn-north-1:123456789012:runtime/a-AbCdEf1234",
                "https://bedrock-agentcore.cn-north-1.amazonaws.com.cn",
            ),
        ];
        for (arn, expected) in cases {
            let aws = Aws::load(&config(arn), None).await;
            assert_eq!(aws.endpoint, expected, "{arn}");
        }
    }

    /// A configured endpoint (a VPC endpoint, an emulator) wins over the resolved one.
    #[tokio::test]
    async fn a_configured_endpoint_wins() {
        let mut config = config("arn:aws:bedrock-agentcore:us-east-1:123456789012:runtime/a-AbCdEf1234");
        config.endpoint_url = Some("http://127.0.0.1:4566/".into());
        assert_eq!(Aws::load(&config, None).await.endpoint, "http://127.0.0.1:4566");
    }
}
