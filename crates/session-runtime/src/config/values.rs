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

/// Serde adapter for a [`Duration`] written as a duration string: a number and a unit, possibly
/// repeated (`"90s"`, `"30m"`, `"1h30m"`, `"7d"`), or `"0"`.
///
/// Use it as `#[serde(with = "session_runtime::config::serde_duration")]`; anything other than
/// such a string is an error that says what is expected, e.g. `expected a duration such as
/// "90s", "30m", "4h", "7d" or "1h30m", found "soon"`.
pub mod serde_duration {
    use super::*;

    /// Writes the duration as a string such as `"1h 30m"`.
    pub fn serialize<S: Serializer>(duration: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&format_duration(*duration))
    }

    /// Reads a duration string; anything else is an error that says what is expected.
    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        deserializer.deserialize_str(DurationVisitor)
    }

    /// Serde adapter for an `Option<Duration>` whose absence means `None` (use it together with
    /// `#[serde(default)]` and `skip_serializing_if = "Option::is_none"`).
    pub mod option {
        use super::*;

        /// Writes `Some(duration)` as a duration string and `None` as nothing at all.
        pub fn serialize<S: Serializer>(
            duration: &Option<Duration>,
            serializer: S,
        ) -> Result<S::Ok, S::Error> {
            match duration {
                Some(duration) => serializer.serialize_str(&format_duration(*duration)),
                None => serializer.serialize_none(),
            }
        }

        /// Reads a present duration string as `Some`.
        pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Duration>, D::Error> {
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

/// Parses a quantity in Kubernetes style: a decimal number (a fraction is allowed) directly
/// followed by a suffix, possibly empty, that scales it: `"512Mi"`, `"1.5"`, `"500m"`.
///
/// The result is the number times the suffix's multiplier, a fraction rounded up to a whole unit
/// (as Kubernetes rounds), so any two quantities of one kind compare exactly. Which suffixes there
/// are, and what each is worth, is the caller's: byte sizes and CPU millicores share the syntax
/// but not the suffixes. Zero is refused.
///
/// - `expected` says what a valid value looks like, for messages, e.g. `a byte size such as
///   "512Mi"`.
/// - `max_digits` is the most digits the whole part may have, leading zeros aside; the fraction
///   may have at most 9.
/// - `multiplier` gives the value of one of a suffix (`""` when there is none) in the result's
///   unit, or a note that says why the suffix is refused, e.g. `"unknown suffix"`.
///
/// ```
/// use session_runtime::config::parse_quantity;
///
/// let millicores = |suffix: &str| match suffix {
///     "m" => Ok(1),
///     "" => Ok(1000),
///     _ => Err("unknown suffix; use m or none"),
/// };
/// assert_eq!(parse_quantity("1.5", "a CPU quantity such as \"500m\"", 18, millicores), Ok(1500));
/// assert_eq!(
///     parse_quantity("2k", "a CPU quantity such as \"500m\"", 18, millicores).unwrap_err(),
///     "expected a CPU quantity such as \"500m\", found \"2k\" (unknown suffix; use m or none)"
/// );
/// ```
///
/// # Errors
///
/// A reason `expected <expected>, found "<text>"`, followed, where there is one, by a note in
/// parentheses: the refusal of the suffix, `too large or too precise` (more than `max_digits`
/// whole or 9 fraction digits), `too large` (beyond `u128`) or `must be more than zero`.
pub fn parse_quantity(
    text: &str,
    expected: &str,
    max_digits: usize,
    multiplier: impl FnOnce(&str) -> Result<u128, &'static str>,
) -> Result<u128, String> {
    let bad = |note: &str| {
        if note.is_empty() {
            format!("expected {expected}, found {text:?}")
        } else {
            format!("expected {expected}, found {text:?} ({note})")
        }
    };
    let number_len = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(number_len);
    let multiplier = multiplier(suffix).map_err(bad)?;
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    let digits_ok = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty()
        || !digits_ok(whole)
        || !digits_ok(fraction)
        || (number.contains('.') && fraction.is_empty())
    {
        return Err(bad(""));
    }
    if whole.trim_start_matches('0').len() > max_digits || fraction.len() > 9 {
        return Err(bad("too large or too precise"));
    }
    let too_large = || bad("too large");
    let whole: u128 = whole.parse().map_err(|_| too_large())?;
    let fraction_value: u128 = if fraction.is_empty() {
        0
    } else {
        fraction.parse().map_err(|_| too_large())?
    };
    let scale = 10_u128.pow(fraction.len() as u32);
    let value = whole
        .checked_mul(multiplier)
        .zip(fraction_value.checked_mul(multiplier))
        .and_then(|(whole, fraction)| whole.checked_add(fraction.div_ceil(scale)))
        .ok_or_else(too_large)?;
    if value == 0 {
        return Err(bad("must be more than zero"));
    }
    Ok(value)
}

/// Parses a byte size: a decimal number (a fraction is allowed) and an optional suffix, in
/// Kubernetes quantity style: `Ki`, `Mi`, `Gi`, `Ti`, `Pi` are powers of 1024; `k` (or `K`), `M`,
/// `G`, `T`, `P` are powers of 1000; no suffix means bytes. A fractional result is rounded up to
/// a whole byte. Zero and sizes beyond `u64::MAX` bytes are rejected.
pub(crate) fn parse_byte_size(text: &str) -> Result<u64, String> {
    // At most 20 integer digits: more than u64::MAX has.
    let bytes = parse_quantity(text, BYTE_SIZE_EXPECTED, 20, |suffix| match suffix {
        "" => Ok(1),
        "k" | "K" => Ok(1000),
        "M" => Ok(1000_u128.pow(2)),
        "G" => Ok(1000_u128.pow(3)),
        "T" => Ok(1000_u128.pow(4)),
        "P" => Ok(1000_u128.pow(5)),
        "Ki" => Ok(1 << 10),
        "Mi" => Ok(1 << 20),
        "Gi" => Ok(1 << 30),
        "Ti" => Ok(1 << 40),
        "Pi" => Ok(1 << 50),
        _ => Err("unknown suffix"),
    })?;
    u64::try_from(bytes).map_err(|_| format!("expected {BYTE_SIZE_EXPECTED}, found {text:?} (too large)"))
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
