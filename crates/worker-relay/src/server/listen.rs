//! The relay's listening sockets: dual-stack unless told otherwise.
//!
//! A Pod's IP may be IPv4 or IPv6 (single or dual-stack clusters), and the broker dials whichever
//! the Pod reports. The default listener is therefore `[::]` with `IPV6_V6ONLY` off, which takes
//! IPv6 and (as IPv4-mapped addresses) IPv4 connections on one socket, whatever the host's
//! `net.ipv6.bindv6only` says; on a host without IPv6 it falls back to `0.0.0.0`.

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};

use tokio::net::{TcpListener, TcpSocket};

/// The backlog of every listener.
const BACKLOG: u32 = 1024;

/// Listens on `addr`. The IPv6 wildcard (`[::]`) accepts IPv4 as well (`IPV6_V6ONLY` off), and
/// on a host without IPv6 (the kernel refuses IPv6 sockets or the wildcard) falls back to every
/// IPv4 address; any other address listens only on itself.
///
/// # Errors
/// Creating, configuring or binding the socket failed (e.g. the address is in use).
pub fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    match addr {
        SocketAddr::V6(v6) if v6.ip().is_unspecified() => match bind_exactly(addr) {
            Err(error) if no_ipv6(&error) => {
                tracing::info!(%error, "no IPv6 on this host: listening on IPv4 only");
                bind_exactly(SocketAddr::from((Ipv4Addr::UNSPECIFIED, v6.port())))
            }
            other => other,
        },
        _ => bind_exactly(addr),
    }
}

fn bind_exactly(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(v6) => {
            let socket = TcpSocket::new_v6()?;
            if v6.ip().is_unspecified() {
                rustix::net::sockopt::set_ipv6_v6only(&socket, false).map_err(io::Error::from)?;
            }
            socket
        }
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(BACKLOG)
}

/// Listens on `port` of every address, IPv6 and IPv4 ([`bind`] of `[::]:port`).
///
/// # Errors
/// As [`bind`].
pub fn bind_any(port: u16) -> io::Result<TcpListener> {
    bind(SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)))
}

fn no_ipv6(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error().map(rustix::io::Errno::from_raw_os_error),
        Some(rustix::io::Errno::AFNOSUPPORT | rustix::io::Errno::ADDRNOTAVAIL)
    )
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::*;

    async fn reaches(listener: &TcpListener, to: SocketAddr) {
        let (client, accepted) = tokio::join!(TcpStream::connect(to), listener.accept());
        let mut client = client.expect("connect");
        let (mut accepted, _) = accepted.expect("accept");
        client.write_all(b"x").await.expect("write");
        let mut byte = [0u8; 1];
        accepted.read_exact(&mut byte).await.expect("read");
    }

    #[tokio::test]
    async fn the_wildcard_takes_ipv6_and_ipv4_clients() {
        let listener = bind_any(0).expect("listen");
        let addr = listener.local_addr().expect("address");
        if addr.is_ipv4() {
            eprintln!("this host has no IPv6: only IPv4 is checked");
        } else {
            reaches(&listener, SocketAddr::from((Ipv6Addr::LOCALHOST, addr.port()))).await;
        }
        reaches(&listener, SocketAddr::from((Ipv4Addr::LOCALHOST, addr.port()))).await;
    }
}
