//! A fault-injecting TCP proxy: cuts connections after a random number of bytes in either
//! direction (seeded, so each run draws the same budgets), often in the middle of a frame.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use worker_relay::{Connector, TcpConnector};

/// What the proxy did.
#[derive(Debug, Default)]
pub struct Stats {
    pub connections: AtomicUsize,
    pub cuts: AtomicUsize,
    pub cuts_to_relay: AtomicUsize,
    pub cuts_to_broker: AtomicUsize,
    pub cuts_mid_frame: AtomicUsize,
}

/// A proxy in front of one relay.
pub struct FaultProxy {
    pub addr: SocketAddr,
    pub stats: Arc<Stats>,
    stop: CancellationToken,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl FaultProxy {
    /// Proxies to `upstream`, cutting the first `cuts` connections after a random number of bytes
    /// (uniform in `1..=2 * mean_bytes`, drawn per direction); later connections pass through.
    pub async fn start(upstream: SocketAddr, seed: u64, cuts: usize, mean_bytes: usize) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let stats = Arc::new(Stats::default());
        let stop = CancellationToken::new();
        let mut rng = StdRng::seed_from_u64(seed);
        {
            let stats = Arc::clone(&stats);
            let stop = stop.clone();
            tokio::spawn(async move {
                loop {
                    let accepted = tokio::select! {
                        accepted = listener.accept() => accepted,
                        () = stop.cancelled() => return,
                    };
                    let Ok((client, _)) = accepted else { continue };
                    let _ = client.set_nodelay(true);
                    stats.connections.fetch_add(1, Ordering::Relaxed);
                    let budgets = (stats.cuts.load(Ordering::Relaxed) < cuts).then(|| {
                        (
                            rng.random_range(1..=2 * mean_bytes),
                            rng.random_range(1..=2 * mean_bytes),
                        )
                    });
                    let stats = Arc::clone(&stats);
                    let stop = stop.clone();
                    tokio::spawn(async move {
                        let Ok(server) = TcpStream::connect(upstream).await else {
                            return;
                        };
                        let _ = server.set_nodelay(true);
                        let (client_read, client_write) = client.into_split();
                        let (server_read, server_write) = server.into_split();
                        let cut = stop.child_token();
                        let (to_relay, to_broker) = budgets.unzip();
                        tokio::join!(
                            pump(client_read, server_write, to_relay, &cut, &stats, true),
                            pump(server_read, client_write, to_broker, &cut, &stats, false),
                        );
                    });
                }
            });
        }
        Self { addr, stats, stop }
    }

    /// A connector through the proxy.
    pub fn connector(&self) -> Arc<dyn Connector> {
        Arc::new(TcpConnector::new(self.addr.to_string()))
    }

    pub fn cuts(&self) -> usize {
        self.stats.cuts.load(Ordering::Relaxed)
    }
}

/// Copies bytes until EOF, the budget is spent (then cuts both directions), or the other
/// direction cut.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut budget: Option<usize>,
    cut: &CancellationToken,
    stats: &Stats,
    to_relay: bool,
) {
    let mut frames = FrameBoundaries::default();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => {
                    let _ = to.shutdown().await;
                    return;
                }
                Ok(n) => n,
            },
            () = cut.cancelled() => return,
        };
        let (send, cutting) = match budget {
            Some(left) if n >= left => (left, true),
            Some(left) => {
                budget = Some(left - n);
                (n, false)
            }
            None => (n, false),
        };
        let written = tokio::select! {
            written = to.write_all(&buf[..send]) => written.is_ok(),
            () = cut.cancelled() => return,
        };
        frames.feed(&buf[..send]);
        if cutting {
            if cut.is_cancelled() {
                return;
            }
            cut.cancel();
            stats.cuts.fetch_add(1, Ordering::Relaxed);
            let direction = if to_relay {
                &stats.cuts_to_relay
            } else {
                &stats.cuts_to_broker
            };
            direction.fetch_add(1, Ordering::Relaxed);
            if !frames.at_boundary() {
                stats.cuts_mid_frame.fetch_add(1, Ordering::Relaxed);
            }
            return;
        }
        if !written {
            return;
        }
    }
}

/// The length prefix of the channel's handshake messages and records (`u16be`).
const RECORD_HEADER_LEN: usize = 2;

/// Tracks where the channel's record boundaries fall in a byte stream (the handshake messages
/// have the same `u16be len | bytes` shape): a cut inside a record is a cut inside the frames
/// it carries.
#[derive(Default)]
struct FrameBoundaries {
    header: Vec<u8>,
    payload_left: usize,
}

impl FrameBoundaries {
    fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.payload_left > 0 {
                let n = self.payload_left.min(bytes.len());
                self.payload_left -= n;
                bytes = &bytes[n..];
                continue;
            }
            let n = (RECORD_HEADER_LEN - self.header.len()).min(bytes.len());
            self.header.extend_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
            if self.header.len() == RECORD_HEADER_LEN {
                let h = &self.header;
                self.payload_left = usize::from(u16::from_be_bytes([h[0], h[1]]));
                self.header.clear();
            }
        }
    }

    fn at_boundary(&self) -> bool {
        self.header.is_empty() && self.payload_left == 0
    }
}
