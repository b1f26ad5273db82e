//! [`TestCredentials`]: the one static key pair the emulator accepts.

use std::fmt;

use crate::iam::IamPolicy;

/// The static credentials the emulator verifies SigV4 signatures against: an access key id, its
/// secret and, optionally, a session token (as temporary credentials have).
///
/// Every request they sign is authorized against their [`IamPolicy`] (default: allow all, as
/// an administrator's; [`with_policy`](Self::with_policy) gives them the broker role's).
///
/// `Debug` redacts the secret and the token.
#[derive(Clone, PartialEq, Eq)]
pub struct TestCredentials {
    access_key_id: String,
    secret_access_key: String,
    session_token: Option<String>,
    policy: IamPolicy,
}

impl TestCredentials {
    /// The access key id of [`TestCredentials::default`].
    pub const DEFAULT_ACCESS_KEY_ID: &'static str = "AKIDAGENTCOREEMULATOR";
    /// The secret of [`TestCredentials::default`].
    pub const DEFAULT_SECRET_ACCESS_KEY: &'static str = "agentcore-emulator-test-secret-not-a-real-key";

    /// Long-term credentials (no session token).
    pub fn new(access_key_id: impl Into<String>, secret_access_key: impl Into<String>) -> Self {
        Self {
            access_key_id: access_key_id.into(),
            secret_access_key: secret_access_key.into(),
            session_token: None,
            policy: IamPolicy::allow_all(),
        }
    }

    /// The same credentials with `policy` as their identity-based policy: a request it does not
    /// allow is `403 AccessDeniedException`.
    pub fn with_policy(mut self, policy: IamPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Their policy.
    pub fn policy(&self) -> &IamPolicy {
        &self.policy
    }

    /// The same credentials with a session token, which every request must then carry
    /// (`x-amz-security-token`, or `X-Amz-Security-Token` in a presigned URL).
    pub fn with_session_token(mut self, token: impl Into<String>) -> Self {
        self.session_token = Some(token.into());
        self
    }

    /// The access key id.
    pub fn access_key_id(&self) -> &str {
        &self.access_key_id
    }

    /// The secret access key.
    pub fn secret_access_key(&self) -> &str {
        &self.secret_access_key
    }

    /// The session token, if any.
    pub fn session_token(&self) -> Option<&str> {
        self.session_token.as_deref()
    }

    /// These credentials as `aws-credential-types` credentials (for `aws-sigv4` and the SDK's
    /// `credentials_provider`).
    pub fn to_aws(&self) -> aws_credential_types::Credentials {
        aws_credential_types::Credentials::new(
            &self.access_key_id,
            &self.secret_access_key,
            self.session_token.clone(),
            None,
            "agentcore-emulator",
        )
    }
}

impl Default for TestCredentials {
    fn default() -> Self {
        Self::new(Self::DEFAULT_ACCESS_KEY_ID, Self::DEFAULT_SECRET_ACCESS_KEY)
    }
}

impl fmt::Debug for TestCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestCredentials")
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<redacted>")
            .field(
                "session_token",
                &self.session_token.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}
