//! The value syntaxes of `[session_runtime]`: durations, byte sizes and read-only mounts, with
//! their serde adapters.
//!
//! Parsers return a reason string; the caller turns it into [`Error::InvalidConfig`] with the key
//! it belongs to (serde does this through [`serde::de::Error::custom`]).
//!
//! [`Error::InvalidConfig`]: crate::Error::InvalidConfig

use std::fmt;
use std::path::Path;
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};
use serde::Serializer;

/// What a duration value looks like, for error messages.
const DURATION_EXPECTED: &str = "a duration such as \"90s\", \"30m\", \"4h\", \"7d\" or \"1h30m\"";

/// What a byte size value looks like, for error messages.
const BYTE_SIZE_EXPECTED: &str = "a byte size such as \"512Mi\", \"2Gi\" or \"1G\" \
     (binary suffixes Ki, Mi, Gi, Ti, Pi; decimal suffixes k, M, G, T, P; no suffix means bytes)";

/// Parses a duration: a number and a unit, possibly repeated (`"1h30m"`), or `"0"`.
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|_| {
        let hint = if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
            " (a unit is required)"
        } else {
            ""
        };
        format!("expected {DURATION_EXPECTED}, found {text:?}{hint}")
    })
}

/// Formats a duration so that [`parse_duration`] reads it back unchanged.
pub(crate) fn format_duration(duration: Duration) -> String {
    humantime::format_duration(duration).to_string()
}

/// Serde adapter for a [`Duration`] written as a duration string (`"30m"`).
pub(crate) mod serde_duration {
    use super::*;

    /// Writes the duration as a string such as `"1h 30m"`.
    pub(crate) fn serialize<S: Serializer>(duration: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&format_duration(*duration))
    }

    /// Reads a duration string; anything else is an error that says what is expected.
    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        deserializer.deserialize_str(DurationVisitor)
    }

    /// Serde adapter for an `Option<Duration>` whose absence means `None` (use it together with
    /// `#[serde(default)]` and `skip_serializing_if = "Option::is_none"`).
    pub(crate) mod option {
        use super::*;

        /// Writes `Some(duration)` as a duration string and `None` as nothing at all.
        pub(crate) fn serialize<S: Serializer>(
            duration: &Option<Duration>,
            serializer: S,
        ) -> Result<S::Ok, S::Error> {
            match duration {
                Some(duration) => serializer.serialize_str(&format_duration(*duration)),
                None => serializer.serialize_none(),
            }
        }

        /// Reads a present duration string as `Some`.
        pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
            deserializer: D,
        ) -> Result<Option<Duration>, D::Error> {
            deserializer.deserialize_str(DurationVisitor).map(Some)
        }
    }
}

/// Accepts a duration string.
struct DurationVisitor;

impl Visitor<'_> for DurationVisitor {
    type Value = Duration;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(DURATION_EXPECTED)
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<Duration, E> {
        parse_duration(text).map_err(E::custom)
    }
}

/// Parses a byte size: a decimal number (a fraction is allowed) and an optional suffix, in
/// Kubernetes quantity style: `Ki`, `Mi`, `Gi`, `Ti`, `Pi` are powers of 1024; `k` (or `K`), `M`,
/// `G`, `T`, `P` are powers of 1000; no suffix means bytes. A fractional result is rounded up to
/// a whole byte. Zero and sizes beyond `u64::MAX` bytes are rejected.
pub(crate) fn parse_byte_size(text: &str) -> Result<u64, String> {
    let bad = |why: &str| format!("expected {BYTE_SIZE_EXPECTED}, found {text:?}{why}");
    let number_len = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(number_len);
    let multiplier: u128 = match suffix {
        "" => 1,
        "k" | "K" => 1000,
        "M" => 1000_u128.pow(2),
        "G" => 1000_u128.pow(3),
        "T" => 1000_u128.pow(4),
        "P" => 1000_u128.pow(5),
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        _ => return Err(bad(" (unknown suffix)")),
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    let digits_ok = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty()
        || !digits_ok(whole)
        || !digits_ok(fraction)
        || (number.contains('.') && fraction.is_empty())
    {
        return Err(bad(""));
    }
    // At most 20 integer digits (more than u64::MAX has) and 9 fraction digits keep the
    // arithmetic below comfortably inside u128.
    if whole.trim_start_matches('0').len() > 20 || fraction.len() > 9 {
        return Err(bad(" (too large or too precise)"));
    }
    let whole: u128 = whole.parse().map_err(|_| bad(""))?;
    let fraction_value: u128 = if fraction.is_empty() {
        0
    } else {
        fraction.parse().map_err(|_| bad(""))?
    };
    let scale = 10_u128.pow(fraction.len() as u32);
    let bytes = whole * multiplier + (fraction_value * multiplier).div_ceil(scale);
    match u64::try_from(bytes) {
        Ok(0) => Err(bad(" (must be more than zero)")),
        Ok(bytes) => Ok(bytes),
        Err(_) => Err(bad(" (too large)")),
    }
}

/// Formats a byte count with the largest binary suffix that divides it exactly, so that
/// [`parse_byte_size`] reads it back unchanged.
pub(crate) fn format_byte_size(bytes: u64) -> String {
    const UNITS: [(&str, u32); 5] = [("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)];
    for (suffix, shift) in UNITS {
        let unit = 1_u64 << shift;
        if bytes != 0 && bytes.is_multiple_of(unit) {
            return format!("{}{suffix}", bytes / unit);
        }
    }
    bytes.to_string()
}

/// Serde adapter for an optional byte size: a string such as `"2Gi"` or a plain integer number of
/// bytes. Use with `#[serde(default)]` and `skip_serializing_if = "Option::is_none"`.
pub(crate) mod serde_byte_size_option {
    use super::*;

    /// Writes `Some(bytes)` as a size string such as `"2Gi"`, and `None` as nothing.
    pub(crate) fn serialize<S: Serializer>(bytes: &Option<u64>, serializer: S) -> Result<S::Ok, S::Error> {
        match bytes {
            Some(bytes) => serializer.serialize_str(&format_byte_size(*bytes)),
            None => serializer.serialize_none(),
        }
    }

    /// Reads a size string or a positive integer number of bytes as `Some`.
    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u64>, D::Error> {
        deserializer.deserialize_any(ByteSizeVisitor).map(Some)
    }
}

/// Accepts a byte size string or a positive integer.
struct ByteSizeVisitor;

impl Visitor<'_> for ByteSizeVisitor {
    type Value = u64;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(BYTE_SIZE_EXPECTED)
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<u64, E> {
        parse_byte_size(text).map_err(E::custom)
    }

    fn visit_u64<E: de::Error>(self, bytes: u64) -> Result<u64, E> {
        if bytes == 0 {
            return Err(E::custom(format!(
                "expected {BYTE_SIZE_EXPECTED}, found 0 (must be more than zero)"
            )));
        }
        Ok(bytes)
    }

    fn visit_i64<E: de::Error>(self, bytes: i64) -> Result<u64, E> {
        match u64::try_from(bytes) {
            Ok(bytes) => self.visit_u64(bytes),
            Err(_) => Err(E::custom(format!("expected {BYTE_SIZE_EXPECTED}, found {bytes}"))),
        }
    }
}

/// Checks one side of a read-only mount: absolute, without `.` or `..` components, and without
/// `:` (which separates the two sides in the configuration).
pub(crate) fn check_mount_path(which: &str, path: &Path) -> Result<(), String> {
    if !path.is_absolute() {
        return Err(format!("{which} {} is not absolute", quoted(path)));
    }
    // `Path::components` silently drops inner `.` components, so look at the text itself.
    if path
        .to_string_lossy()
        .split('/')
        .any(|part| part == "." || part == "..")
    {
        return Err(format!(
            "{which} {} must not contain `.` or `..` components",
            quoted(path)
        ));
    }
    if path.to_string_lossy().contains(':') {
        return Err(format!("{which} {} must not contain `:`", quoted(path)));
    }
    Ok(())
}

/// A path in double quotes, for messages.
pub(crate) fn quoted(path: &Path) -> String {
    format!("{:?}", path.to_string_lossy())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        for bad in ["", "soon", "-5m", "5", "m", "1.5.3h"] {
            let err = parse_duration(bad).unwrap_err();
            assert!(err.contains("expected a duration"), "{bad}: {err}");
        }
        for d in [
            Duration::from_secs(5),
            Duration::from_secs(7 * 86400),
            Duration::from_millis(1500),
        ] {
            assert_eq!(parse_duration(&format_duration(d)), Ok(d));
        }
    }

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_byte_size("2Gi"), Ok(2 << 30));
        assert_eq!(parse_byte_size("512Mi"), Ok(512 << 20));
        assert_eq!(parse_byte_size("1G"), Ok(1_000_000_000));
        assert_eq!(parse_byte_size("1k"), Ok(1000));
        assert_eq!(parse_byte_size("4096"), Ok(4096));
        assert_eq!(parse_byte_size("1.5Gi"), Ok(3 << 29));
        assert_eq!(parse_byte_size("0.5"), Ok(1));
        assert_eq!(parse_byte_size("16Pi"), Ok(16 << 50));
        for bad in [
            "",
            "lots",
            "2GB",
            "2 Gi",
            "-1Gi",
            "0",
            "0Mi",
            ".5Gi",
            "1.Gi",
            "1.2.3",
            "99999999999999999999999",
            "20000Pi",
            "1.0000000001Gi",
        ] {
            let err = parse_byte_size(bad).unwrap_err();
            assert!(err.contains("expected a byte size"), "{bad}: {err}");
        }
    }

    #[test]
    fn byte_size_round_trip() {
        for bytes in [1, 1000, 1024, 3 << 29, 2 << 30, 5 << 40, u64::MAX] {
            assert_eq!(parse_byte_size(&format_byte_size(bytes)), Ok(bytes), "{bytes}");
        }
        assert_eq!(format_byte_size(2 << 30), "2Gi");
        assert_eq!(format_byte_size(1536 << 20), "1536Mi");
    }
}
