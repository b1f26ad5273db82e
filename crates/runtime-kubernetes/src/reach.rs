//! How the broker reaches a worker's relay: TCP to the Pod IP, or `oab-relay connect` run through
//! `pods/exec` (a stdio bridge to the relay inside the Pod). Never `pods/attach` (no fencing, and
//! it leaks the protocol into the node's logs) and never port-forward.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use async_trait::async_trait;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{AttachParams, AttachedProcess};
use kube::Api;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf, ReadHalf, SimplexStream, WriteHalf};
use worker_relay::transport::{Connector, Transport};

/// Where the relay binary sits in the worker image, and the bridge subcommand.
pub(crate) const RELAY_BINARY: &str = "/usr/local/bin/oab-relay";

/// Opens `oab-relay connect 127.0.0.1:<port>` in the worker Pod through `pods/exec`; every
/// reconnect of the relay client runs a fresh one.
#[derive(Clone)]
pub(crate) struct ExecConnector {
    pods: Api<Pod>,
    pod: String,
    port: u16,
}

impl std::fmt::Debug for ExecConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecConnector")
            .field("pod", &self.pod)
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

impl ExecConnector {
    pub(crate) fn new(pods: Api<Pod>, pod: String, port: u16) -> Self {
        ExecConnector { pods, pod, port }
    }
}

#[async_trait]
impl Connector for ExecConnector {
    async fn connect(&self) -> io::Result<Transport> {
        let address = format!("127.0.0.1:{}", self.port);
        let params = AttachParams::default()
            .container("worker")
            .stdin(true)
            .stdout(true)
            .stderr(false);
        let mut process = self
            .pods
            .exec(&self.pod, [RELAY_BINARY, "connect", address.as_str()], &params)
            .await
            .map_err(|error| io::Error::other(format!("pods/exec into {}: {error}", self.pod)))?;
        let (Some(stdout), Some(stdin)) = (process.stdout(), process.stdin()) else {
            return Err(io::Error::other("pods/exec gave no stdin or stdout"));
        };
        Ok(Box::new(ExecStream {
            stdout,
            stdin,
            _process: process,
        }))
    }
}

/// The exec's stdout and stdin as one byte stream; holds the exec open while it lives.
struct ExecStream {
    stdout: ReadHalf<SimplexStream>,
    stdin: WriteHalf<SimplexStream>,
    _process: AttachedProcess,
}

impl AsyncRead for ExecStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stdout).poll_read(cx, buf)
    }
}

impl AsyncWrite for ExecStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stdin).poll_write(cx, data)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stdin).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stdin).poll_shutdown(cx)
    }
}
