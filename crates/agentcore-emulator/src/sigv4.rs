//! SigV4 verification: the signature a request carries (in its `Authorization` header or in a
//! presigned query) is recomputed with `aws-sigv4` from the request's own method, path, query,
//! signed headers and body at the request's own date, with the emulator's static credentials,
//! and compared in constant time.
//!
//! Refusals follow AWS's front: no authentication at all is `MissingAuthenticationTokenException`,
//! an unknown access key or session token `UnrecognizedClientException`, an expired token
//! `ExpiredTokenException`, a signature that does not match or whose date is more than five
//! minutes from now `InvalidSignatureException` (with AWS's texts), a malformed header
//! `IncompleteSignatureException`. All are 403.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_sigv4::http_request::{
    sign, PercentEncodingMode, SignableBody, SignableRequest, SignatureLocation, SigningSettings,
    UriPathNormalizationMode,
};
use aws_sigv4::sign::v4;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::credentials::TestCredentials;
use crate::error::{ErrorKind, ServiceError, INVALID_SIGNATURE_MESSAGE};
use crate::http::Request;

/// The only algorithm accepted.
const ALGORITHM: &str = "AWS4-HMAC-SHA256";
/// The SigV4 service name of AgentCore's data plane.
pub(crate) const SERVICE: &str = "bedrock-agentcore";
/// How far a request's date may be from now.
const MAX_SKEW: Duration = Duration::from_secs(5 * 60);
/// The longest presigned URL validity SigV4 allows (7 days).
const MAX_EXPIRES: u64 = 604_800;
/// The presigned query parameters that carry the signature itself (not signed as query).
const PRESIGN_PARAMS: [&str; 7] = [
    "X-Amz-Algorithm",
    "X-Amz-Credential",
    "X-Amz-Date",
    "X-Amz-Expires",
    "X-Amz-SignedHeaders",
    "X-Amz-Signature",
    "X-Amz-Security-Token",
];

/// What a request is verified against.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Expectation<'a> {
    pub(crate) credentials: &'a TestCredentials,
    pub(crate) region: &'a str,
    /// The test knob: the session token counts as expired.
    pub(crate) token_expired: bool,
    pub(crate) now: SystemTime,
}

/// The parts of a signature, from either place.
#[derive(Debug)]
struct Presented {
    access_key: String,
    scope_date: String,
    scope_region: String,
    scope_service: String,
    signed_headers: Vec<String>,
    signature: String,
    date: String,
    token: Option<String>,
    /// `Some(expires)` for a presigned query.
    presigned_expires: Option<u64>,
}

/// Verifies `request`'s SigV4 signature.
///
/// # Errors
/// The [`ServiceError`] AWS would answer (see the module docs).
pub(crate) fn verify(request: &Request, expect: Expectation<'_>) -> Result<(), ServiceError> {
    let presented = if let Some(auth) = request.header("authorization") {
        from_header(request, auth)?
    } else if request.query_param("X-Amz-Algorithm").is_some() {
        from_query(request)?
    } else {
        return Err(ServiceError::of(ErrorKind::MissingAuthenticationToken));
    };

    if presented.access_key != expect.credentials.access_key_id() {
        return Err(ServiceError::of(ErrorKind::UnrecognizedClient));
    }
    match (expect.credentials.session_token(), presented.token.as_deref()) {
        (None, None) => {}
        (Some(want), Some(got)) if bool::from(want.as_bytes().ct_eq(got.as_bytes())) => {
            if expect.token_expired {
                return Err(ServiceError::of(ErrorKind::ExpiredToken));
            }
        }
        _ => return Err(ServiceError::of(ErrorKind::UnrecognizedClient)),
    }

    let signed_at = parse_amz_date(&presented.date).ok_or_else(|| {
        ServiceError::new(
            ErrorKind::IncompleteSignature,
            format!(
                "Date must be in ISO-8601 'basic format'. Got '{}'.",
                presented.date
            ),
        )
    })?;
    check_date(&presented, signed_at, expect.now)?;
    if presented.scope_date != presented.date[..8] {
        return Err(ServiceError::new(
            ErrorKind::InvalidSignature,
            format!(
                "Date in Credential scope does not match YYYYMMDD from ISO-8601 version of date from HTTP: \
                 '{}' != '{}', from '{}'.",
                presented.scope_date,
                &presented.date[..8],
                presented.date
            ),
        ));
    }
    if presented.scope_region != expect.region {
        return Err(ServiceError::new(
            ErrorKind::InvalidSignature,
            format!(
                "Credential should be scoped to a valid region. Expected '{}', got '{}'.",
                expect.region, presented.scope_region
            ),
        ));
    }
    if presented.scope_service != SERVICE {
        return Err(ServiceError::new(
            ErrorKind::InvalidSignature,
            format!("Credential should be scoped to correct service: '{SERVICE}'."),
        ));
    }

    let expected = match presented.presigned_expires {
        None => vec![recompute_header_signature(
            request, &presented, signed_at, expect,
        )?],
        // A presigned GET carries no body; clients hash it either as the empty body or as
        // `UNSIGNED-PAYLOAD` (botocore's query signer does the latter), so both are accepted.
        Some(expires) => [SignableBody::UnsignedPayload, SignableBody::empty()]
            .into_iter()
            .map(|body| recompute_query_signature(request, &presented, signed_at, expires, body, expect))
            .collect::<Result<Vec<_>, _>>()?,
    };
    let matches = expected.iter().fold(subtle::Choice::from(0), |any, candidate| {
        any | candidate.as_bytes().ct_eq(presented.signature.as_bytes())
    });
    if bool::from(matches) {
        Ok(())
    } else {
        Err(ServiceError::new(
            ErrorKind::InvalidSignature,
            INVALID_SIGNATURE_MESSAGE,
        ))
    }
}

fn incomplete(message: impl Into<String>) -> ServiceError {
    ServiceError::new(ErrorKind::IncompleteSignature, message)
}

/// Parses `AWS4-HMAC-SHA256 Credential=AK/date/region/service/aws4_request, SignedHeaders=a;b, Signature=hex`.
fn from_header(request: &Request, auth: &str) -> Result<Presented, ServiceError> {
    let rest = auth
        .strip_prefix(ALGORITHM)
        .filter(|rest| rest.starts_with(' '))
        .ok_or_else(|| {
            incomplete(format!(
                "Unsupported authorization type. Only {ALGORITHM} is accepted."
            ))
        })?;
    let mut credential = None;
    let mut signed_headers = None;
    let mut signature = None;
    for part in rest.split(',') {
        let part = part.trim();
        if let Some(value) = part.strip_prefix("Credential=") {
            credential = Some(value);
        } else if let Some(value) = part.strip_prefix("SignedHeaders=") {
            signed_headers = Some(value);
        } else if let Some(value) = part.strip_prefix("Signature=") {
            signature = Some(value);
        }
    }
    let (Some(credential), Some(signed_headers), Some(signature)) = (credential, signed_headers, signature)
    else {
        return Err(incomplete(
            "Authorization header requires 'Credential', 'SignedHeaders' and 'Signature' parameters.",
        ));
    };
    let date = request.header("x-amz-date").ok_or_else(|| {
        incomplete("Authorization header requires existence of either a 'X-Amz-Date' or a 'Date' header.")
    })?;
    let (access_key, scope_date, scope_region, scope_service) = parse_credential(credential)?;
    Ok(Presented {
        access_key,
        scope_date,
        scope_region,
        scope_service,
        signed_headers: split_signed_headers(signed_headers),
        signature: signature.to_owned(),
        date: date.to_owned(),
        token: request.header("x-amz-security-token").map(str::to_owned),
        presigned_expires: None,
    })
}

/// Reads the `X-Amz-*` parameters of a presigned URL.
fn from_query(request: &Request) -> Result<Presented, ServiceError> {
    let param = |name: &str| {
        request
            .query_param(name)
            .ok_or_else(|| incomplete(format!("AWS query-string parameters must include '{name}'.")))
    };
    let algorithm = param("X-Amz-Algorithm")?;
    if algorithm != ALGORITHM {
        return Err(incomplete(format!(
            "Unsupported algorithm {algorithm}. Only {ALGORITHM} is accepted."
        )));
    }
    let credential = param("X-Amz-Credential")?;
    let (access_key, scope_date, scope_region, scope_service) = parse_credential(&credential)?;
    let expires = param("X-Amz-Expires")?;
    let expires = expires
        .parse::<u64>()
        .ok()
        .filter(|secs| *secs <= MAX_EXPIRES)
        .ok_or_else(|| {
            incomplete(format!(
                "X-Amz-Expires must be a whole number of seconds, at most {MAX_EXPIRES}; got '{expires}'."
            ))
        })?;
    Ok(Presented {
        access_key,
        scope_date,
        scope_region,
        scope_service,
        signed_headers: split_signed_headers(&param("X-Amz-SignedHeaders")?),
        signature: param("X-Amz-Signature")?,
        date: param("X-Amz-Date")?,
        token: request.query_param("X-Amz-Security-Token"),
        presigned_expires: Some(expires),
    })
}

fn split_signed_headers(list: &str) -> Vec<String> {
    list.split(';')
        .filter(|h| !h.is_empty())
        .map(str::to_ascii_lowercase)
        .collect()
}

/// Splits `AK/20261130/us-east-1/bedrock-agentcore/aws4_request`.
fn parse_credential(credential: &str) -> Result<(String, String, String, String), ServiceError> {
    let parts: Vec<&str> = credential.split('/').collect();
    match parts.as_slice() {
        [key, date, region, service, "aws4_request"] => Ok((
            (*key).to_owned(),
            (*date).to_owned(),
            (*region).to_owned(),
            (*service).to_owned(),
        )),
        _ => Err(incomplete(format!(
            "Credential should be scoped to a valid region, not in the form \
             '<key>/<date>/<region>/<service>/aws4_request': '{credential}'."
        ))),
    }
}

/// Refuses a signature dated more than five minutes from now, or a presigned URL past its
/// validity, with AWS's texts.
fn check_date(presented: &Presented, signed_at: SystemTime, now: SystemTime) -> Result<(), ServiceError> {
    let expired = |limit: SystemTime, how: &str| {
        ServiceError::new(
            ErrorKind::InvalidSignature,
            format!(
                "Signature expired: {} is now earlier than {} ({} - {how}.)",
                presented.date,
                format_amz_date(limit),
                format_amz_date(now)
            ),
        )
    };
    match presented.presigned_expires {
        None => {
            if signed_at + MAX_SKEW < now {
                return Err(expired(now - MAX_SKEW, "5 min"));
            }
        }
        Some(expires) => {
            if signed_at + Duration::from_secs(expires) < now {
                return Err(expired(
                    now - Duration::from_secs(expires),
                    &format!("{expires} sec"),
                ));
            }
        }
    }
    if signed_at > now + MAX_SKEW {
        return Err(ServiceError::new(
            ErrorKind::InvalidSignature,
            format!(
                "Signature not yet current: {} is still later than {} ({} + 5 min.)",
                presented.date,
                format_amz_date(now + MAX_SKEW),
                format_amz_date(now)
            ),
        ));
    }
    Ok(())
}

/// The request's values of the headers it signed, in its order. A signed header the request
/// does not carry makes the signature fail (as it would at AWS).
fn signed_header_values<'r>(
    request: &'r Request,
    presented: &Presented,
) -> Result<Vec<(&'r str, &'r str)>, ServiceError> {
    let mut out = Vec::new();
    for name in &presented.signed_headers {
        let mut found = false;
        for (key, value) in &request.headers {
            if key.eq_ignore_ascii_case(name) {
                out.push((key.as_str(), value.as_str()));
                found = true;
            }
        }
        if !found {
            return Err(ServiceError::new(
                ErrorKind::InvalidSignature,
                INVALID_SIGNATURE_MESSAGE,
            ));
        }
    }
    Ok(out)
}

fn settings(location: SignatureLocation, expires: Option<u64>) -> SigningSettings {
    let mut settings = SigningSettings::default();
    settings.signature_location = location;
    settings.expires_in = expires.map(Duration::from_secs);
    settings.percent_encoding_mode = PercentEncodingMode::Double;
    settings.uri_path_normalization_mode = UriPathNormalizationMode::Enabled;
    // Sign exactly what the client says it signed: the list came from the request itself.
    settings.excluded_headers = None;
    settings
}

fn recompute(
    request: SignableRequest<'_>,
    settings: SigningSettings,
    region: &str,
    signed_at: SystemTime,
    credentials: &TestCredentials,
) -> Result<String, ServiceError> {
    let identity = credentials.to_aws().into();
    let params = v4::SigningParams::builder()
        .identity(&identity)
        .region(region)
        .name(SERVICE)
        .time(signed_at)
        .settings(settings)
        .build()
        .map_err(|e| ServiceError::new(ErrorKind::InternalServer, format!("signing parameters: {e}")))?;
    let signed = sign(request, &params.into())
        .map_err(|_| ServiceError::new(ErrorKind::InvalidSignature, INVALID_SIGNATURE_MESSAGE))?;
    let (_, signature) = signed.into_parts();
    Ok(signature)
}

fn recompute_header_signature(
    request: &Request,
    presented: &Presented,
    signed_at: SystemTime,
    expect: Expectation<'_>,
) -> Result<String, ServiceError> {
    let headers = signed_header_values(request, presented)?;
    let body = match request.header("x-amz-content-sha256") {
        Some("UNSIGNED-PAYLOAD") => SignableBody::UnsignedPayload,
        Some(hash) => {
            let actual = hex(&Sha256::digest(&request.body));
            if !hash.eq_ignore_ascii_case(&actual) {
                return Err(ServiceError::new(
                    ErrorKind::InvalidSignature,
                    "The provided 'x-amz-content-sha256' header does not match what was computed.",
                ));
            }
            SignableBody::Precomputed(hash.to_ascii_lowercase())
        }
        None => SignableBody::Bytes(&request.body),
    };
    let signable = SignableRequest::new(
        &request.method,
        request.target.as_str(),
        headers.into_iter(),
        body,
    )
    .map_err(|_| ServiceError::new(ErrorKind::InvalidSignature, INVALID_SIGNATURE_MESSAGE))?;
    recompute(
        signable,
        settings(SignatureLocation::Headers, None),
        &presented.scope_region,
        signed_at,
        expect.credentials,
    )
}

fn recompute_query_signature(
    request: &Request,
    presented: &Presented,
    signed_at: SystemTime,
    expires: u64,
    body: SignableBody<'static>,
    expect: Expectation<'_>,
) -> Result<String, ServiceError> {
    let headers = signed_header_values(request, presented)?;
    // The query without the signature's own parameters (aws-sigv4 adds them back), kept as sent.
    let rest: Vec<&str> = request
        .query()
        .unwrap_or_default()
        .split('&')
        .filter(|pair| {
            let key = pair.split_once('=').map_or(*pair, |(key, _)| key);
            !pair.is_empty() && !PRESIGN_PARAMS.contains(&key)
        })
        .collect();
    let target = if rest.is_empty() {
        request.path().to_owned()
    } else {
        format!("{}?{}", request.path(), rest.join("&"))
    };
    let signable = SignableRequest::new(&request.method, target, headers.into_iter(), body)
        .map_err(|_| ServiceError::new(ErrorKind::InvalidSignature, INVALID_SIGNATURE_MESSAGE))?;
    recompute(
        signable,
        settings(SignatureLocation::QueryParams, Some(expires)),
        &presented.scope_region,
        signed_at,
        expect.credentials,
    )
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses SigV4's `YYYYMMDD'T'HHMMSS'Z'`.
pub(crate) fn parse_amz_date(text: &str) -> Option<SystemTime> {
    let bytes = text.as_bytes();
    if bytes.len() != 16 || bytes[8] != b'T' || bytes[15] != b'Z' {
        return None;
    }
    let digits = |range: std::ops::Range<usize>| -> Option<i64> {
        let part = text.get(range)?;
        if !part.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        part.parse().ok()
    };
    let (year, month, day) = (digits(0..4)?, digits(4..6)?, digits(6..8)?);
    let (hour, minute, second) = (digits(9..11)?, digits(11..13)?, digits(13..15)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 || second > 60 {
        return None;
    }
    let days = days_from_civil(year, month, day);
    let secs = days * 86_400 + hour * 3600 + minute * 60 + second;
    u64::try_from(secs)
        .ok()
        .map(|secs| UNIX_EPOCH + Duration::from_secs(secs))
}

/// Formats a time as SigV4's `YYYYMMDD'T'HHMMSS'Z'`.
pub(crate) fn format_amz_date(time: SystemTime) -> String {
    let secs = time.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}{month:02}{day:02}T{:02}{:02}{:02}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let yoe = year - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The inverse of [`days_from_civil`].
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amz_dates_round_trip() {
        for text in ["20261130T032943Z", "19700101T000000Z", "20240229T235959Z"] {
            let time = parse_amz_date(text).expect("parses");
            assert_eq!(format_amz_date(time), text);
        }
        assert_eq!(
            parse_amz_date("20261130T032943Z"),
            Some(UNIX_EPOCH + Duration::from_secs(1_796_009_383))
        );
        assert!(parse_amz_date("2026-11-30T03:29:43Z").is_none());
        assert!(parse_amz_date("20261330T032943Z").is_none());
    }
}
