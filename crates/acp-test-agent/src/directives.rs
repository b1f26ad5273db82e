//! Parsing of the `/name=value` directives at the start of a prompt.

use std::time::Duration;

/// What a prompt turn should do, after directives were applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TurnPlan {
    /// Number of `agent_message_chunk` updates to stream.
    pub(crate) chunks: usize,
    /// Pause between two consecutive chunks.
    pub(crate) delay: Duration,
    /// Bytes of `x` filler appended to each chunk.
    pub(crate) size: usize,
    /// Whether to ask the client for permission before streaming.
    pub(crate) permission: bool,
    /// The prompt text with the directives removed.
    pub(crate) message: String,
}

/// Parses directives from the start of `text`. Tokens are whitespace
/// separated; parsing stops at the first token that is not a known directive,
/// and everything from there on (leading whitespace trimmed) is the message.
/// A known directive with a malformed value is an error.
pub(crate) fn parse(text: &str, chunks: usize, delay: Duration) -> Result<TurnPlan, String> {
    let mut plan = TurnPlan {
        chunks,
        delay,
        size: 0,
        permission: false,
        message: String::new(),
    };
    let mut rest = text.trim_start();
    loop {
        let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
        let token = &rest[..end];
        let consumed = match token.split_once('=') {
            _ if token == "/permission" => {
                plan.permission = true;
                true
            }
            Some(("/chunks", value)) => {
                plan.chunks = number(token, value)?;
                true
            }
            Some(("/delay_ms", value)) => {
                plan.delay = Duration::from_millis(number(token, value)? as u64);
                true
            }
            Some(("/size", value)) => {
                plan.size = number(token, value)?;
                true
            }
            _ => false,
        };
        if !consumed {
            break;
        }
        rest = rest[end..].trim_start();
    }
    plan.message = rest.to_owned();
    Ok(plan)
}

fn number(token: &str, value: &str) -> Result<usize, String> {
    value
        .parse::<usize>()
        .map_err(|_| format!("invalid directive {token:?}: expected a non-negative integer"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_directives() {
        let plan = parse("  hello world ", 3, Duration::ZERO).unwrap();
        assert_eq!(plan.chunks, 3);
        assert_eq!(plan.message, "hello world ");
        assert!(!plan.permission);
    }

    #[test]
    fn all_directives() {
        let plan = parse(
            "/chunks=5 /delay_ms=20\n/size=7 /permission hi /chunks=9",
            3,
            Duration::ZERO,
        )
        .unwrap();
        assert_eq!(plan.chunks, 5);
        assert_eq!(plan.delay, Duration::from_millis(20));
        assert_eq!(plan.size, 7);
        assert!(plan.permission);
        assert_eq!(plan.message, "hi /chunks=9");
    }

    #[test]
    fn only_directives_and_unknown_slash_words() {
        let plan = parse("/chunks=0", 3, Duration::ZERO).unwrap();
        assert_eq!(plan.chunks, 0);
        assert_eq!(plan.message, "");
        let plan = parse("/tmp/x is a path", 3, Duration::ZERO).unwrap();
        assert_eq!(plan.message, "/tmp/x is a path");
    }

    #[test]
    fn malformed_value_is_an_error() {
        assert!(parse("/chunks=lots hi", 3, Duration::ZERO).is_err());
        assert!(parse("/delay_ms=-1 hi", 3, Duration::ZERO).is_err());
    }
}
