//! The socket probes: [`LISTEN_METHOD`](crate::LISTEN_METHOD) serves a secret from inside the
//! agent's session, [`CONNECT_METHOD`](crate::CONNECT_METHOD) tries to fetch one. Isolation
//! tests use them to see whether one session reaches what another listens on (a loopback TCP
//! port, an abstract UNIX socket) without depending on any tool in the worker.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};

/// At most this much of a reply is read.
const MAX_REPLY: u64 = 64 * 1024;

/// The longest a connect probe may wait for its reply.
const MAX_CONNECT_TIME: Duration = Duration::from_secs(20);

/// What a probe names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum SocketKind {
    /// A TCP address, `IP:PORT` (port 0 to listen on a free one).
    Tcp,
    /// An abstract UNIX socket, by its name without the leading NUL (`@name` in `ss`).
    Abstract,
}

/// Params of [`LISTEN_METHOD`](crate::LISTEN_METHOD).
#[derive(Debug, Deserialize)]
pub(crate) struct ListenParams {
    kind: SocketKind,
    address: String,
    reply: String,
}

/// Params of [`CONNECT_METHOD`](crate::CONNECT_METHOD).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ConnectParams {
    kind: SocketKind,
    address: String,
    #[serde(default, alias = "timeout_ms")]
    timeout_ms: Option<u64>,
}

/// Starts listening as `params` say and answers every connection with the reply, then closes it,
/// until the agent exits. Returns `{"address": <bound address>}` (a TCP port 0 resolved).
pub(crate) fn listen(params: ListenParams) -> Result<Value, String> {
    let reply = params.reply.into_bytes();
    match params.kind {
        SocketKind::Tcp => {
            let address: SocketAddr = params
                .address
                .parse()
                .map_err(|_| format!("not an IP:PORT address: {:?}", params.address))?;
            let listener = TcpListener::bind(address).map_err(|e| format!("listening on {address}: {e}"))?;
            let bound = listener
                .local_addr()
                .map_err(|e| format!("reading the bound address: {e}"))?;
            serve(move || listener.accept().map(|(stream, _)| stream), reply);
            Ok(json!({ "address": bound.to_string() }))
        }
        SocketKind::Abstract => {
            let address = UnixAddr::from_abstract_name(params.address.as_bytes())
                .map_err(|e| format!("abstract name {:?}: {e}", params.address))?;
            let listener = UnixListener::bind_addr(&address)
                .map_err(|e| format!("listening on @{}: {e}", params.address))?;
            serve(move || listener.accept().map(|(stream, _)| stream), reply);
            Ok(json!({ "address": params.address }))
        }
    }
}

/// Answers each connection `accept` returns with `reply` on a thread of its own, which ends with
/// the process.
fn serve<S: Write>(mut accept: impl FnMut() -> io::Result<S> + Send + 'static, reply: Vec<u8>) {
    std::thread::spawn(move || loop {
        match accept() {
            // A client that went away is not this listener's problem.
            Ok(mut stream) => drop(stream.write_all(&reply)),
            // Out of descriptors, say: wait rather than spin.
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    });
}

/// Connects as `params` say and reads what the other end sends until it closes (at most
/// [`MAX_REPLY`] bytes, within the time limit). Returns `{"connected": bool, "received": string,
/// "error": string | null, "errno": i32 | null}`: a refused connection is a result, not an error.
pub(crate) fn connect(params: ConnectParams) -> Result<Value, String> {
    let limit = params
        .timeout_ms
        .map_or(Duration::from_secs(5), Duration::from_millis)
        .min(MAX_CONNECT_TIME);
    let outcome = match params.kind {
        SocketKind::Tcp => {
            let address: SocketAddr = params
                .address
                .parse()
                .map_err(|_| format!("not an IP:PORT address: {:?}", params.address))?;
            TcpStream::connect_timeout(&address, limit).and_then(|stream| {
                stream.set_read_timeout(Some(limit))?;
                read_reply(stream)
            })
        }
        SocketKind::Abstract => {
            let address = UnixAddr::from_abstract_name(params.address.as_bytes())
                .map_err(|e| format!("abstract name {:?}: {e}", params.address))?;
            UnixStream::connect_addr(&address).and_then(|stream| {
                stream.set_read_timeout(Some(limit))?;
                read_reply(stream)
            })
        }
    };
    Ok(match outcome {
        Ok(received) => json!({ "connected": true, "received": received, "error": null, "errno": null }),
        Err(error) => json!({
            "connected": false,
            "received": "",
            "error": error.to_string(),
            "errno": error.raw_os_error(),
        }),
    })
}

/// Everything `stream` sends until it closes, as lossy UTF-8.
fn read_reply(stream: impl Read) -> io::Result<String> {
    let mut received = Vec::new();
    stream.take(MAX_REPLY).read_to_end(&mut received)?;
    Ok(String::from_utf8_lossy(&received).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random_name() -> String {
        format!(
            "oab-test-agent-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default()
        )
    }

    #[test]
    fn a_listener_answers_with_its_reply_and_a_missing_one_is_refused() {
        for kind in [SocketKind::Tcp, SocketKind::Abstract] {
            let address = match kind {
                SocketKind::Tcp => "127.0.0.1:0".to_owned(),
                SocketKind::Abstract => random_name(),
            };
            let listening = listen(ListenParams {
                kind,
                address,
                reply: "the secret".to_owned(),
            })
            .expect("listens");
            let bound = listening["address"].as_str().expect("an address").to_owned();
            let got = connect(ConnectParams {
                kind,
                address: bound,
                timeout_ms: Some(2000),
            })
            .expect("a result");
            assert_eq!(got["connected"], json!(true), "{kind:?}: {got}");
            assert_eq!(got["received"], json!("the secret"), "{kind:?}: {got}");
        }
        let refused = connect(ConnectParams {
            kind: SocketKind::Abstract,
            address: random_name(),
            timeout_ms: Some(2000),
        })
        .expect("a result");
        assert_eq!(refused["connected"], json!(false), "{refused}");
        assert_eq!(refused["errno"], json!(111), "ECONNREFUSED: {refused}");
    }

    #[test]
    fn bad_addresses_are_errors() {
        let bad = ListenParams {
            kind: SocketKind::Tcp,
            address: "localhost".to_owned(),
            reply: String::new(),
        };
        assert!(listen(bad).is_err());
    }
}
