//! Runtime ARNs (`arn:aws:bedrock-agentcore:<region>:<account>:runtime/<id>`), the path label
//! that carries them, and runtime session ids.

use std::fmt;

use crate::error::{ErrorKind, ServiceError};

/// The ARN of one emulated agent runtime.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RuntimeArn {
    region: String,
    account: String,
    runtime_id: String,
}

impl RuntimeArn {
    /// The ARN of runtime `runtime_id` (e.g. `emulated-AbCdEf1234`) in `region` of `account`.
    pub(crate) fn new(region: &str, account: &str, runtime_id: &str) -> Self {
        Self {
            region: region.to_owned(),
            account: account.to_owned(),
            runtime_id: runtime_id.to_owned(),
        }
    }

    /// The region part.
    pub fn region(&self) -> &str {
        &self.region
    }

    /// The 12-digit account part.
    pub fn account(&self) -> &str {
        &self.account
    }

    /// The runtime id (the part after `runtime/`).
    pub fn runtime_id(&self) -> &str {
        &self.runtime_id
    }
}

impl fmt::Display for RuntimeArn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "arn:aws:bedrock-agentcore:{}:{}:runtime/{}",
            self.region, self.account, self.runtime_id
        )
    }
}

/// Checks a runtime id as the control plane would have accepted it: a name of letters, digits
/// and `_`, a `-`, then ten letters or digits.
pub(crate) fn valid_runtime_id(id: &str) -> bool {
    let Some((name, suffix)) = id.rsplit_once('-') else {
        return false;
    };
    !name.is_empty()
        && name.len() <= 48
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && name.starts_with(|c: char| c.is_ascii_alphabetic())
        && suffix.len() == 10
        && suffix.chars().all(|c| c.is_ascii_alphanumeric())
}

/// The shortest runtime session id AgentCore accepts.
pub const MIN_SESSION_ID_LEN: usize = 33;
/// The longest runtime session id AgentCore accepts.
pub const MAX_SESSION_ID_LEN: usize = 256;

/// Validates a runtime session id as the service does on input: 33 to 256 characters.
///
/// Control characters cannot travel in a header anyway; they are refused here too so the id can be
/// used as a local session's thread name.
pub(crate) fn validate_session_id(id: Option<&str>) -> Result<String, ServiceError> {
    let Some(id) = id else {
        return Err(ServiceError::new(
            ErrorKind::Validation,
            "1 validation error detected: Value null at 'runtimeSessionId' failed to satisfy constraint: \
             Member must not be null",
        ));
    };
    let chars = id.chars().count();
    if !(MIN_SESSION_ID_LEN..=MAX_SESSION_ID_LEN).contains(&chars) || id.chars().any(char::is_control) {
        return Err(ServiceError::new(
            ErrorKind::Validation,
            format!(
                "1 validation error detected: Value at 'runtimeSessionId' failed to satisfy constraint: \
                 Member must have length between {MIN_SESSION_ID_LEN} and {MAX_SESSION_ID_LEN} \
                 (it has {chars})"
            ),
        ));
    }
    Ok(id.to_owned())
}

/// Decodes `%XX` escapes (and nothing else: a `+` stays a `+`, as in a path).
pub(crate) fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3)?;
            let hex = std::str::from_utf8(hex).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Decodes a query component: `+` is a space, then `%XX` escapes.
pub(crate) fn query_decode(text: &str) -> Option<String> {
    percent_decode(&text.replace('+', " "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arns_print_as_the_service_spells_them() {
        let arn = RuntimeArn::new("us-east-1", "123456789012", "emulated-AbCdEf1234");
        assert_eq!(
            arn.to_string(),
            "arn:aws:bedrock-agentcore:us-east-1:123456789012:runtime/emulated-AbCdEf1234"
        );
        assert!(valid_runtime_id("emulated-AbCdEf1234"));
        assert!(!valid_runtime_id("emulated"));
        assert!(!valid_runtime_id("bad/name-AbCdEf1234"));
    }

    #[test]
    fn session_ids_are_bounded_like_the_service_bounds_them() {
        assert!(validate_session_id(Some(&"a".repeat(32))).is_err());
        assert!(validate_session_id(Some(&"a".repeat(33))).is_ok());
        assert!(validate_session_id(Some(&"a".repeat(256))).is_ok());
        assert!(validate_session_id(Some(&"a".repeat(257))).is_err());
        assert!(validate_session_id(None).is_err());
    }

    #[test]
    fn percent_decoding_undoes_the_sdk_label_encoding() {
        assert_eq!(
            percent_decode("arn%3Aaws%3Abedrock-agentcore%3Aus-east-1%3A1%3Aruntime%2Fx").as_deref(),
            Some("arn:aws:bedrock-agentcore:us-east-1:1:runtime/x")
        );
        assert_eq!(percent_decode("%zz"), None);
        assert_eq!(query_decode("a+b%2B").as_deref(), Some("a b+"));
    }
}
