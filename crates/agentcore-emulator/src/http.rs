//! Just enough HTTP/1.1 for the emulator's front and for talking to workers: request heads
//! parsed with `httparse`, bodies by `Content-Length` or chunked, responses written by hand.
//!
//! The front keeps the raw request target as the client sent it, because SigV4 signs the path
//! and query exactly as they were encoded.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::arn::query_decode;

/// The largest request or response head accepted.
const MAX_HEAD: usize = 64 * 1024;
/// The most header lines accepted.
const MAX_HEADERS: usize = 100;
/// The largest request body accepted (AgentCore's payload limit is 100 MB).
pub(crate) const MAX_BODY: usize = 100 * 1024 * 1024;

/// What went wrong reading a message.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HttpError {
    /// The peer closed or the socket failed.
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    /// The bytes are not HTTP/1.1 the emulator understands.
    #[error("malformed http: {0}")]
    Malformed(String),
}

/// A socket with the bytes read past the last message: the start of the next one.
#[derive(Debug)]
pub(crate) struct Conn<S> {
    pub(crate) stream: S,
    pub(crate) buffered: Vec<u8>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Conn<S> {
    pub(crate) fn new(stream: S) -> Self {
        Self {
            stream,
            buffered: Vec::new(),
        }
    }

    /// Reads until the head ends (`\r\n\r\n`); `None` at a clean end of stream before any byte.
    async fn read_head(&mut self) -> Result<Option<Vec<u8>>, HttpError> {
        loop {
            if let Some(end) = find(&self.buffered, b"\r\n\r\n") {
                let rest = self.buffered.split_off(end + 4);
                let head = std::mem::replace(&mut self.buffered, rest);
                return Ok(Some(head));
            }
            if self.buffered.len() > MAX_HEAD {
                return Err(HttpError::Malformed("head too large".into()));
            }
            let mut chunk = [0u8; 8192];
            let n = self.stream.read(&mut chunk).await?;
            if n == 0 {
                return if self.buffered.is_empty() {
                    Ok(None)
                } else {
                    Err(HttpError::Malformed("end of stream inside a head".into()))
                };
            }
            self.buffered.extend_from_slice(&chunk[..n]);
        }
    }

    /// Reads exactly `len` bytes (buffered ones first).
    async fn read_exact_len(&mut self, len: usize) -> Result<Vec<u8>, HttpError> {
        while self.buffered.len() < len {
            let mut chunk = [0u8; 16384];
            let n = self.stream.read(&mut chunk).await?;
            if n == 0 {
                return Err(HttpError::Malformed("end of stream inside a body".into()));
            }
            self.buffered.extend_from_slice(&chunk[..n]);
        }
        let rest = self.buffered.split_off(len);
        Ok(std::mem::replace(&mut self.buffered, rest))
    }

    /// Reads one line ending in `\r\n` (without it).
    async fn read_line(&mut self) -> Result<Vec<u8>, HttpError> {
        loop {
            if let Some(end) = find(&self.buffered, b"\r\n") {
                let rest = self.buffered.split_off(end + 2);
                let mut line = std::mem::replace(&mut self.buffered, rest);
                line.truncate(end);
                return Ok(line);
            }
            if self.buffered.len() > MAX_HEAD {
                return Err(HttpError::Malformed("line too long".into()));
            }
            let mut chunk = [0u8; 8192];
            let n = self.stream.read(&mut chunk).await?;
            if n == 0 {
                return Err(HttpError::Malformed("end of stream inside a chunk".into()));
            }
            self.buffered.extend_from_slice(&chunk[..n]);
        }
    }

    /// Reads the next request, or `None` when the client closed the connection between requests.
    pub(crate) async fn read_request(&mut self) -> Result<Option<Request>, HttpError> {
        let Some(head) = self.read_head().await? else {
            return Ok(None);
        };
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut parsed = httparse::Request::new(&mut headers);
        match parsed.parse(&head) {
            Ok(httparse::Status::Complete(_)) => {}
            Ok(httparse::Status::Partial) => return Err(HttpError::Malformed("partial head".into())),
            Err(e) => return Err(HttpError::Malformed(e.to_string())),
        }
        let method = parsed.method.unwrap_or_default().to_owned();
        let target = parsed.path.unwrap_or_default().to_owned();
        let version = parsed.version.unwrap_or(1);
        let headers = collect_headers(parsed.headers)?;
        let mut request = Request {
            method,
            target,
            version,
            headers,
            body: Vec::new(),
        };
        request.body = self.read_body(&request.headers, false).await?;
        Ok(Some(request))
    }

    /// Reads a body framed by `headers`; `to_eof` allows a body delimited by the end of stream
    /// (responses only).
    async fn read_body(&mut self, headers: &[(String, String)], to_eof: bool) -> Result<Vec<u8>, HttpError> {
        if is_chunked(headers) {
            let mut body = Vec::new();
            while let Some(chunk) = self.next_chunk().await? {
                if body.len() + chunk.len() > MAX_BODY {
                    return Err(HttpError::Malformed("body too large".into()));
                }
                body.extend_from_slice(&chunk);
            }
            return Ok(body);
        }
        match content_length(headers)? {
            Some(len) if len > MAX_BODY => Err(HttpError::Malformed("body too large".into())),
            Some(len) => self.read_exact_len(len).await,
            None if to_eof => {
                let mut body = std::mem::take(&mut self.buffered);
                self.stream.read_to_end(&mut body).await?;
                Ok(body)
            }
            None => Ok(Vec::new()),
        }
    }

    /// The next chunk of a chunked body; `None` after the last (and its trailers).
    pub(crate) async fn next_chunk(&mut self) -> Result<Option<Vec<u8>>, HttpError> {
        let line = self.read_line().await?;
        let line = String::from_utf8_lossy(&line);
        let size = line.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size, 16)
            .map_err(|_| HttpError::Malformed(format!("bad chunk size {size:?}")))?;
        if size == 0 {
            // Trailers, up to the empty line.
            while !self.read_line().await?.is_empty() {}
            return Ok(None);
        }
        let data = self.read_exact_len(size).await?;
        if !self.read_line().await?.is_empty() {
            return Err(HttpError::Malformed("chunk not followed by CRLF".into()));
        }
        Ok(Some(data))
    }

    /// Reads a response head (the body is left to the caller).
    pub(crate) async fn read_response_head(&mut self) -> Result<ResponseHead, HttpError> {
        let Some(raw) = self.read_head().await? else {
            return Err(HttpError::Malformed("closed before a response".into()));
        };
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut parsed = httparse::Response::new(&mut headers);
        match parsed.parse(&raw) {
            Ok(httparse::Status::Complete(_)) => {}
            Ok(httparse::Status::Partial) => return Err(HttpError::Malformed("partial head".into())),
            Err(e) => return Err(HttpError::Malformed(e.to_string())),
        }
        let status = parsed.code.unwrap_or_default();
        let headers = collect_headers(parsed.headers)?;
        Ok(ResponseHead { status, headers, raw })
    }

    /// Reads a whole (small) response body framed by `head`.
    pub(crate) async fn read_response_body(&mut self, head: &ResponseHead) -> Result<Vec<u8>, HttpError> {
        self.read_body(&head.headers, true).await
    }

    /// The body of a response as it arrives: the next piece, `None` at its end.
    pub(crate) async fn next_body_piece(
        &mut self,
        framing: &mut BodyFraming,
    ) -> Result<Option<Vec<u8>>, HttpError> {
        match framing {
            BodyFraming::Chunked => self.next_chunk().await,
            BodyFraming::Length(0) | BodyFraming::Done => Ok(None),
            BodyFraming::Length(left) => {
                if self.buffered.is_empty() {
                    let mut chunk = vec![0u8; 16384];
                    let n = self.stream.read(&mut chunk).await?;
                    if n == 0 {
                        return Err(HttpError::Malformed("end of stream inside a body".into()));
                    }
                    chunk.truncate(n);
                    self.buffered = chunk;
                }
                let take = self.buffered.len().min(*left);
                let rest = self.buffered.split_off(take);
                *left -= take;
                Ok(Some(std::mem::replace(&mut self.buffered, rest)))
            }
            BodyFraming::ToEof => {
                if !self.buffered.is_empty() {
                    return Ok(Some(std::mem::take(&mut self.buffered)));
                }
                let mut chunk = vec![0u8; 16384];
                let n = self.stream.read(&mut chunk).await?;
                if n == 0 {
                    *framing = BodyFraming::Done;
                    return Ok(None);
                }
                chunk.truncate(n);
                Ok(Some(chunk))
            }
        }
    }
}

/// How a response body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyFraming {
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// `Content-Length`: this many bytes left.
    Length(usize),
    /// Until the peer closes.
    ToEof,
    /// Finished.
    Done,
}

impl BodyFraming {
    /// The framing `headers` declare for a response body.
    pub(crate) fn of(headers: &[(String, String)]) -> Result<Self, HttpError> {
        if is_chunked(headers) {
            return Ok(Self::Chunked);
        }
        Ok(match content_length(headers)? {
            Some(len) => Self::Length(len),
            None => Self::ToEof,
        })
    }
}

/// A parsed request.
#[derive(Debug, Clone)]
pub(crate) struct Request {
    pub(crate) method: String,
    /// The request target exactly as sent: path and query, still encoded.
    pub(crate) target: String,
    /// The minor HTTP version (0 or 1).
    pub(crate) version: u8,
    /// Header names as sent, values as sent.
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body: Vec<u8>,
}

impl Request {
    /// The encoded path.
    pub(crate) fn path(&self) -> &str {
        self.target
            .split_once('?')
            .map_or(self.target.as_str(), |(path, _)| path)
    }

    /// The encoded query, if any.
    pub(crate) fn query(&self) -> Option<&str> {
        self.target.split_once('?').map(|(_, query)| query)
    }

    /// The first value of header `name` (case-insensitive).
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }

    /// The decoded query parameters, in order.
    pub(crate) fn query_pairs(&self) -> Vec<(String, String)> {
        self.query()
            .unwrap_or_default()
            .split('&')
            .filter(|pair| !pair.is_empty())
            .map(|pair| {
                let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
                (
                    query_decode(key).unwrap_or_else(|| key.to_owned()),
                    query_decode(value).unwrap_or_else(|| value.to_owned()),
                )
            })
            .collect()
    }

    /// The first decoded value of query parameter `name` (case-sensitive, as AWS reads them).
    pub(crate) fn query_param(&self, name: &str) -> Option<String> {
        self.query_pairs()
            .into_iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value)
    }

    /// The first decoded value of query parameter `name`, matched without regard to case.
    pub(crate) fn query_param_ignoring_case(&self, name: &str) -> Option<String> {
        self.query_pairs()
            .into_iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value)
    }

    /// Whether the client asked to close the connection after this request.
    pub(crate) fn wants_close(&self) -> bool {
        match self.header("connection") {
            Some(value) => value
                .split(',')
                .any(|token| token.trim().eq_ignore_ascii_case("close")),
            None => self.version == 0,
        }
    }
}

/// A parsed response head, with its raw bytes (to pass a `101` on unchanged).
#[derive(Debug, Clone)]
pub(crate) struct ResponseHead {
    pub(crate) status: u16,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) raw: Vec<u8>,
}

impl ResponseHead {
    /// The first value of header `name`.
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(key, _)| key.eq_ignore_ascii_case(name))
        .map(|(_, value)| value.as_str())
}

fn collect_headers(raw: &[httparse::Header<'_>]) -> Result<Vec<(String, String)>, HttpError> {
    raw.iter()
        .map(|h| {
            let value = std::str::from_utf8(h.value)
                .map_err(|_| HttpError::Malformed(format!("header {} is not utf-8", h.name)))?;
            Ok((h.name.to_owned(), value.to_owned()))
        })
        .collect()
}

fn is_chunked(headers: &[(String, String)]) -> bool {
    header(headers, "transfer-encoding").is_some_and(|v| v.to_ascii_lowercase().contains("chunked"))
}

fn content_length(headers: &[(String, String)]) -> Result<Option<usize>, HttpError> {
    header(headers, "content-length")
        .map(|v| {
            v.trim()
                .parse::<usize>()
                .map_err(|_| HttpError::Malformed(format!("bad content-length {v:?}")))
        })
        .transpose()
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// The reason phrase of the statuses the emulator sends.
pub(crate) fn reason(status: u16) -> &'static str {
    match status {
        101 => "Switching Protocols",
        200 => "OK",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        424 => "Failed Dependency",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

/// Writes a complete response with a `Content-Length` body.
pub(crate) async fn write_response<W: AsyncWrite + Unpin>(
    out: &mut W,
    status: u16,
    headers: &[(&str, &str)],
    body: &[u8],
    close: bool,
) -> io::Result<()> {
    let mut head = format!("HTTP/1.1 {status} {}\r\n", reason(status));
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str(&format!("content-length: {}\r\n", body.len()));
    if close {
        head.push_str("connection: close\r\n");
    }
    head.push_str("\r\n");
    out.write_all(head.as_bytes()).await?;
    out.write_all(body).await?;
    out.flush().await
}

/// Writes the head of a chunked response.
pub(crate) async fn write_chunked_head<W: AsyncWrite + Unpin>(
    out: &mut W,
    status: u16,
    headers: &[(&str, &str)],
    close: bool,
) -> io::Result<()> {
    let mut head = format!("HTTP/1.1 {status} {}\r\n", reason(status));
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("transfer-encoding: chunked\r\n");
    if close {
        head.push_str("connection: close\r\n");
    }
    head.push_str("\r\n");
    out.write_all(head.as_bytes()).await?;
    out.flush().await
}

/// Writes one chunk of a chunked body (an empty `data` writes nothing: it would end the body).
pub(crate) async fn write_chunk<W: AsyncWrite + Unpin>(out: &mut W, data: &[u8]) -> io::Result<()> {
    if data.is_empty() {
        return Ok(());
    }
    out.write_all(format!("{:x}\r\n", data.len()).as_bytes()).await?;
    out.write_all(data).await?;
    out.write_all(b"\r\n").await?;
    out.flush().await
}

/// Ends a chunked body.
pub(crate) async fn write_last_chunk<W: AsyncWrite + Unpin>(out: &mut W) -> io::Result<()> {
    out.write_all(b"0\r\n\r\n").await?;
    out.flush().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn two_requests_on_one_connection_are_read_one_after_the_other() {
        let bytes = b"POST /a?x=1%2F2 HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\nabcGET /b HTTP/1.1\r\n\
                      Transfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n";
        let (mut client, server) = tokio::io::duplex(4096);
        client.write_all(bytes).await.expect("write");
        drop(client);
        let mut conn = Conn::new(server);
        let first = conn.read_request().await.expect("read").expect("a request");
        assert_eq!(first.method, "POST");
        assert_eq!(first.path(), "/a");
        assert_eq!(first.query_param("x").as_deref(), Some("1/2"));
        assert_eq!(first.body, b"abc");
        let second = conn.read_request().await.expect("read").expect("a request");
        assert_eq!(second.target, "/b");
        assert_eq!(second.body, b"hi");
        assert!(conn.read_request().await.expect("read").is_none());
    }
}
