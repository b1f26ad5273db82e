//! [`IamPolicy`]: the identity-based policy attached to the emulator's credentials, evaluated
//! for every request as IAM would: an explicit `Deny` wins, else an `Allow` is needed, else the
//! request is denied.
//!
//! Only what AgentCore's data plane needs is modelled: statements with `Effect`, `Action` and
//! `Resource` (a string or a list, `*` and `?` wildcards, actions case-insensitive). Conditions,
//! `NotAction`, `NotResource` and principals are refused when the policy is parsed, so a test
//! never believes a policy passed that IAM would read differently.

use serde_json::Value;

use crate::arn::RuntimeArn;
use crate::error::{ErrorKind, ServiceError};
use crate::faults::Operation;

/// Why a policy document cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("IAM policy: {field}: {reason}")]
pub struct PolicyError {
    /// The JSON field at fault, e.g. `Statement[0].Action`.
    pub field: String,
    /// What is wrong with it.
    pub reason: String,
}

fn policy_error(field: impl Into<String>, reason: impl Into<String>) -> PolicyError {
    PolicyError {
        field: field.into(),
        reason: reason.into(),
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Statement {
    allow: bool,
    actions: Vec<String>,
    resources: Vec<String>,
}

/// An identity-based IAM policy (the `Statement`s of a policy document).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IamPolicy {
    statements: Vec<Statement>,
}

impl IamPolicy {
    /// A policy allowing every action on every resource (an administrator's).
    pub fn allow_all() -> Self {
        Self {
            statements: vec![Statement {
                allow: true,
                actions: vec!["*".into()],
                resources: vec!["*".into()],
            }],
        }
    }

    /// Parses a policy document: `{"Version": ..., "Statement": [...]}`, a single statement
    /// object, or a list of statements (the forms operators paste).
    ///
    /// # Errors
    /// [`PolicyError`] naming the field that is missing, of the wrong type, or uses a feature
    /// the emulator does not evaluate (`Condition`, `NotAction`, `NotResource`, `Principal`).
    pub fn from_json(document: &str) -> Result<Self, PolicyError> {
        let value: Value =
            serde_json::from_str(document).map_err(|e| policy_error("(document)", e.to_string()))?;
        let statements = match &value {
            Value::Array(list) => list.clone(),
            Value::Object(map) if map.contains_key("Statement") => match &map["Statement"] {
                Value::Array(list) => list.clone(),
                single @ Value::Object(_) => vec![single.clone()],
                _ => return Err(policy_error("Statement", "not a statement or a list of them")),
            },
            Value::Object(_) => vec![value.clone()],
            _ => return Err(policy_error("(document)", "not a policy document")),
        };
        let statements = statements
            .iter()
            .enumerate()
            .map(|(index, statement)| parse_statement(index, statement))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { statements })
    }

    /// Whether `action` on `resource` is allowed.
    pub fn allows(&self, action: &str, resource: &str) -> bool {
        let matching =
            |statement: &&Statement| {
                statement.actions.iter().any(|pattern| {
                    wildcard_match(&pattern.to_ascii_lowercase(), &action.to_ascii_lowercase())
                }) && statement
                    .resources
                    .iter()
                    .any(|pattern| wildcard_match(pattern, resource))
            };
        let mut matched = self.statements.iter().filter(matching).peekable();
        matched.peek().is_some() && matched.all(|statement| statement.allow)
    }
}

fn parse_statement(index: usize, statement: &Value) -> Result<Statement, PolicyError> {
    let field = |name: &str| format!("Statement[{index}].{name}");
    let Value::Object(map) = statement else {
        return Err(policy_error(format!("Statement[{index}]"), "not an object"));
    };
    for unsupported in [
        "Condition",
        "NotAction",
        "NotResource",
        "Principal",
        "NotPrincipal",
    ] {
        if map.contains_key(unsupported) {
            return Err(policy_error(field(unsupported), "not evaluated by the emulator"));
        }
    }
    let allow = match map.get("Effect").and_then(Value::as_str) {
        Some("Allow") => true,
        Some("Deny") => false,
        _ => return Err(policy_error(field("Effect"), "must be \"Allow\" or \"Deny\"")),
    };
    let strings = |name: &str| -> Result<Vec<String>, PolicyError> {
        match map.get(name) {
            Some(Value::String(one)) => Ok(vec![one.clone()]),
            Some(Value::Array(list)) => list
                .iter()
                .map(|item| {
                    item.as_str()
                        .map(str::to_owned)
                        .ok_or_else(|| policy_error(field(name), "a list of strings is needed"))
                })
                .collect(),
            _ => Err(policy_error(
                field(name),
                "a string or a list of strings is needed",
            )),
        }
    };
    Ok(Statement {
        allow,
        actions: strings("Action")?,
        resources: strings("Resource")?,
    })
}

/// IAM's wildcard match: `*` any run of characters, `?` any one.
fn wildcard_match(pattern: &str, text: &str) -> bool {
    let (pattern, text): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    let (mut p, mut t) = (0, 0);
    let mut backtrack: Option<(usize, usize)> = None;
    while t < text.len() {
        match pattern.get(p) {
            Some('*') => {
                backtrack = Some((p, t));
                p += 1;
            }
            Some(&c) if c == '?' || c == text[t] => {
                p += 1;
                t += 1;
            }
            _ => match backtrack {
                Some((star, at)) => {
                    p = star + 1;
                    t = at + 1;
                    backtrack = Some((star, at + 1));
                }
                None => return false,
            },
        }
    }
    pattern[p..].iter().all(|&c| c == '*')
}

/// The IAM action an operation needs.
pub(crate) fn action(operation: Operation) -> &'static str {
    match operation {
        Operation::Invoke => "bedrock-agentcore:InvokeAgentRuntime",
        Operation::Stop => "bedrock-agentcore:StopRuntimeSession",
        Operation::WebSocket => "bedrock-agentcore:InvokeAgentRuntimeWithWebSocketStream",
    }
}

/// Checks that `policy` allows `operation` on the runtime and on its endpoint `qualifier` (AWS
/// authorizes both resources of a data-plane call); the refusal is IAM's `AccessDeniedException`.
pub(crate) fn authorize(
    policy: &IamPolicy,
    access_key_id: &str,
    operation: Operation,
    runtime: &RuntimeArn,
    qualifier: &str,
) -> Result<(), ServiceError> {
    let action = action(operation);
    let endpoint = format!("{runtime}/runtime-endpoint/{qualifier}");
    for resource in [runtime.to_string(), endpoint] {
        if !policy.allows(action, &resource) {
            return Err(ServiceError::new(
                ErrorKind::AccessDenied,
                format!(
                    "User: arn:aws:iam::{}:user/{access_key_id} is not authorized to perform: {action} on resource: {resource} because no identity-based policy allows the {action} action",
                    runtime.account()
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcards_match_as_iam_does() {
        assert!(wildcard_match("*", ""));
        assert!(wildcard_match(
            "bedrock-agentcore:*",
            "bedrock-agentcore:InvokeAgentRuntime"
        ));
        assert!(wildcard_match("a?c*", "abcdef"));
        assert!(wildcard_match(
            "arn:*:runtime/x/runtime-endpoint/*",
            "arn:aws:runtime/x/runtime-endpoint/DEFAULT"
        ));
        assert!(!wildcard_match(
            "arn:*:runtime/x",
            "arn:aws:runtime/x/runtime-endpoint/DEFAULT"
        ));
        assert!(!wildcard_match(
            "InvokeAgentRuntime",
            "InvokeAgentRuntimeWithWebSocketStream"
        ));
    }

    #[test]
    fn an_explicit_deny_wins_and_nothing_is_allowed_by_default() {
        let policy = IamPolicy::from_json(
            r#"{"Version":"2012-10-17","Statement":[
                {"Effect":"Allow","Action":"bedrock-agentcore:*","Resource":"*"},
                {"Effect":"Deny","Action":["bedrock-agentcore:StopRuntimeSession"],"Resource":"*"}]}"#,
        )
        .expect("a policy");
        assert!(policy.allows("bedrock-agentcore:InvokeAgentRuntime", "arn:x"));
        assert!(!policy.allows("bedrock-agentcore:StopRuntimeSession", "arn:x"));
        assert!(!policy.allows("s3:GetObject", "arn:x"));
    }

    #[test]
    fn unsupported_or_malformed_statements_name_their_field() {
        let error = IamPolicy::from_json(r#"{"Effect":"Allow","Action":"*","Resource":"*","Condition":{}}"#)
            .expect_err("conditions are not evaluated");
        assert_eq!(error.field, "Statement[0].Condition");
        let error = IamPolicy::from_json(r#"{"Statement":[{"Effect":"Allow","Resource":"*"}]}"#)
            .expect_err("no action");
        assert_eq!(error.field, "Statement[0].Action");
    }
}
