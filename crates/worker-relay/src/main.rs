//! `oab-relay`: the worker's entrypoint. See the `worker_relay` crate documentation.

use std::ffi::OsString;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use tokio::net::{TcpListener, TcpStream};
use tokio::signal::unix::{signal, SignalKind};
use worker_relay::server::{listen, DEFAULT_PORT};
use worker_relay::server::{AgentCoreServer, RelayTemplate, UnboundRelay};
use worker_relay::token::{BIND_TOKEN_HASH_ENV, TOKEN_HASH_ENV};
use worker_relay::{Overflow, Relay, RelayConfig, TokenHash};

/// The worker relay: runs an ACP agent and serves its stdio to the broker over a resumable,
/// fenced, framed protocol.
#[derive(Debug, Parser)]
#[command(name = "oab-relay", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the protocol and run the agent (started on the first valid hello; with --unbound,
    /// once a broker bound the relay to a session).
    Serve(Box<Serve>),
    /// Create directories (with parents; mode 0700 for each named one) and exit: run as an init
    /// container, so that the session's workspace and HOME exist, owned by the worker user, before
    /// the kubelet mounts them as subPaths (it would make a missing subPath as root).
    Prepare {
        /// The directories.
        #[arg(required = true)]
        dirs: Vec<PathBuf>,
    },
    /// Bridge stdin/stdout to the local relay (for `kubectl exec -i <pod> -- oab-relay connect`).
    Connect {
        /// The relay's address.
        #[arg(default_value_t = SocketAddr::from(([127, 0, 0, 1], DEFAULT_PORT)))]
        addr: SocketAddr,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum OverflowArg {
    /// Stop reading the agent's output until the broker acknowledges some (lossless).
    Block,
    /// While no broker is connected, drop the oldest output (a later resume gets resume-gap).
    Discard,
}

#[derive(Debug, clap::Args)]
struct Serve {
    /// TCP address for the framed protocol (repeatable); default `[::]:7780`, IPv6 and IPv4 on one
    /// socket (`0.0.0.0:7780` on a host without IPv6), unless --http is given. `[::]:PORT` is
    /// always dual-stack.
    #[arg(long)]
    listen: Vec<SocketAddr>,
    /// HTTP address for AgentCore's contract: GET /ping, WebSocket /ws, POST /invocations;
    /// `--http` alone listens on AgentCore's 0.0.0.0:8080.
    #[arg(long, num_args = 0..=1, default_missing_value = "0.0.0.0:8080")]
    http: Option<SocketAddr>,
    /// AgentCore mode: serve only the HTTP contract (default 0.0.0.0:8080) and take the session,
    /// its incarnation and the token hash from the runtime session id AgentCore passes in the
    /// X-Amzn-Bedrock-AgentCore-Runtime-Session-Id header; each newer worker generation replaces
    /// the agent. No session, generation or token hash is configured.
    #[arg(long, conflicts_with_all = ["listen", "session", "generation"])]
    agentcore: bool,
    /// Warm pool mode: start with no session, listen at once and start no agent until a broker
    /// binds the relay to a session (a `bind` carrying the bind token whose SHA-256 is
    /// $OAB_RELAY_BIND_TOKEN_SHA256, 64 hex digits); from then on serve that session as if started
    /// with it. The bind may set the agent's working directory and add to its environment
    /// (over the relay's own for the same name). TCP listeners only.
    #[arg(long, conflicts_with_all = ["agentcore", "session", "generation", "http"])]
    unbound: bool,
    /// The session id (default: $OAB_RELAY_SESSION; not with --unbound).
    #[arg(long)]
    session: Option<String>,
    /// The worker generation (default: $OAB_RELAY_GENERATION; not with --unbound).
    #[arg(long)]
    generation: Option<u64>,
    /// The agent's working directory (default: the current directory; with --unbound, a binding
    /// that names one wins).
    #[arg(long)]
    workdir: Option<PathBuf>,
    /// A directory to make (as `prepare` does) before the relay listens, so that a worker whose
    /// volume is mounted whole makes its session's directories itself, owned by its user, with
    /// no init container (repeatable).
    #[arg(long = "make-dir", value_name = "DIR")]
    make_dirs: Vec<PathBuf>,
    /// Bound of unacknowledged agent output kept for replay, in bytes.
    #[arg(long, default_value_t = worker_relay::server::DEFAULT_REPLAY_BYTES)]
    replay_bytes: usize,
    /// Bound of broker input not yet written to the agent's stdin, in bytes (a broker with more
    /// unacknowledged input is refused with input-overflow).
    #[arg(long, default_value_t = worker_relay::server::DEFAULT_INPUT_BYTES)]
    input_bytes: usize,
    /// What to do when the replay buffer is full.
    #[arg(long, value_enum, default_value = "block")]
    overflow: OverflowArg,
    /// Heartbeat interval; a connection silent for three intervals is dropped.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "30s")]
    heartbeat: Duration,
    /// How long a new connection has to say hello.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    handshake_timeout: Duration,
    /// How long to wait after the agent's exit for a broker to acknowledge it.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "60s")]
    linger: Duration,
    /// On SIGTERM/SIGINT: how long the agent gets before SIGKILL.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    term_grace: Duration,
    /// Reap only the agent, not every orphan (when something else is the init process).
    #[arg(long)]
    no_reap: bool,
    /// The agent's argv.
    #[arg(last = true, required = true)]
    agent: Vec<OsString>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("oab-relay: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let code = runtime.block_on(async move {
        match cli.command {
            Command::Serve(serve) => run_serve(*serve).await,
            Command::Connect { addr } => run_connect(addr).await,
            Command::Prepare { dirs } => prepare(&dirs).unwrap_or(0),
        }
    });
    runtime.shutdown_timeout(Duration::from_millis(100));
    ExitCode::from(u8::try_from(code.clamp(0, 255)).unwrap_or(1))
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("OAB_RELAY_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_target(false)
        .init();
}

/// Makes each of `dirs` (see [`make_private_dir`]); the exit code of the first failure.
fn prepare(dirs: &[PathBuf]) -> Option<i32> {
    dirs.iter().find_map(|dir| {
        make_private_dir(dir)
            .err()
            .map(|error| fail(&format!("prepare {}: {error}", dir.display())))
    })
}

/// Creates `dir` (and missing parents); the last component gets mode 0700. An existing directory
/// is kept as it is.
fn make_private_dir(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent)?;
    }
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
        other => other,
    }
}

fn fail(message: &str) -> i32 {
    eprintln!("oab-relay: {message}");
    2
}

/// The relay configuration for one session and generation, from the command line.
fn relay_config(serve: &Serve, session: String, generation: u64, token_hash: TokenHash) -> RelayConfig {
    let mut config = RelayConfig::new(session, generation, token_hash, serve.agent.clone())
        .replay_bytes(serve.replay_bytes)
        .input_bytes(serve.input_bytes)
        .overflow(match serve.overflow {
            OverflowArg::Block => Overflow::Block,
            OverflowArg::Discard => Overflow::Discard,
        })
        .heartbeat(serve.heartbeat)
        .handshake_timeout(serve.handshake_timeout)
        .linger(serve.linger)
        .reap_orphans(!serve.no_reap);
    if let Some(workdir) = &serve.workdir {
        config = config.working_dir(workdir.clone());
    }
    config
}

fn become_subreaper(serve: &Serve) {
    if !serve.no_reap && std::process::id() != 1 {
        // Orphaned descendants of the agent are re-parented to us, so we can reap them.
        if let Err(error) = rustix::process::set_child_subreaper(Some(rustix::process::getpid())) {
            tracing::warn!(%error, "cannot become a child subreaper");
        }
    }
}

fn print_listening(lines: &[String]) {
    let mut stdout = std::io::stdout().lock();
    for line in lines {
        let _ = writeln!(stdout, "oab-relay: listening on {line}");
    }
    let _ = stdout.flush();
}

async fn run_agentcore(serve: Serve) -> i32 {
    let addr = serve
        .http
        .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 8080)));
    become_subreaper(&serve);
    let (mut term, mut int) = match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(term), Ok(int)) => (term, int),
        (Err(error), _) | (_, Err(error)) => return fail(&format!("cannot handle signals: {error}")),
    };
    let listener = match TcpListener::bind(addr).await {
        Ok(listener) => listener,
        Err(error) => return fail(&format!("cannot listen on {addr}: {error}")),
    };
    let line = format!("http {}", local_addr(&listener, addr));
    let handshake_timeout = serve.handshake_timeout;
    let term_grace = serve.term_grace;
    let storage = match serve.workdir.clone().map_or_else(std::env::current_dir, Ok) {
        Ok(dir) => dir,
        Err(error) => return fail(&format!("cannot tell the working directory: {error}")),
    };
    let template = RelayTemplate::new(move |session, generation, token_hash| {
        relay_config(&serve, session.to_owned(), generation, token_hash)
    });
    let server = AgentCoreServer::new(template, storage, handshake_timeout);
    let serving = server.clone();
    tokio::spawn(async move { serving.serve(listener).await });
    print_listening(std::slice::from_ref(&line));
    tracing::info!(listener = %line, "relay ready for AgentCore");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: stopping the agent"),
        _ = int.recv() => tracing::info!("SIGINT: stopping the agent"),
    }
    server.stop(term_grace).await
}

/// Binds the TCP listeners `serve` asks for (the default one if it names none and no --http);
/// their announcement lines.
fn tcp_listeners(serve: &Serve) -> Result<Vec<(TcpListener, String)>, i32> {
    let mut listeners = Vec::new();
    if serve.listen.is_empty() && serve.http.is_none() {
        match listen::bind_any(DEFAULT_PORT) {
            Ok(listener) => listeners.push(listener),
            Err(error) => return Err(fail(&format!("cannot listen on port {DEFAULT_PORT}: {error}"))),
        }
    }
    for addr in &serve.listen {
        match listen::bind(*addr) {
            Ok(listener) => listeners.push(listener),
            Err(error) => return Err(fail(&format!("cannot listen on {addr}: {error}"))),
        }
    }
    listeners
        .into_iter()
        .map(|listener| match listener.local_addr() {
            Ok(addr) => Ok((listener, format!("tcp {addr}"))),
            Err(error) => Err(fail(&format!("cannot tell a listener's address: {error}"))),
        })
        .collect()
}

/// `serve --unbound`: listen at once, start nothing until a broker binds the relay.
async fn run_unbound(serve: Serve) -> i32 {
    let bind_token_hash = match std::env::var(BIND_TOKEN_HASH_ENV).map(|hex| TokenHash::from_hex(&hex)) {
        Ok(Ok(hash)) => hash,
        Ok(Err(why)) => return fail(&format!("{BIND_TOKEN_HASH_ENV}: {why}")),
        Err(_) => return fail(&format!("{BIND_TOKEN_HASH_ENV} is not set")),
    };
    if let Some(code) = prepare(&serve.make_dirs) {
        return code;
    }
    become_subreaper(&serve);
    let (mut term, mut int) = match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(term), Ok(int)) => (term, int),
        (Err(error), _) | (_, Err(error)) => return fail(&format!("cannot handle signals: {error}")),
    };
    let listeners = match tcp_listeners(&serve) {
        Ok(listeners) => listeners,
        Err(code) => return code,
    };
    let handshake_timeout = serve.handshake_timeout;
    let term_grace = serve.term_grace;
    let template = RelayTemplate::new(move |session, generation, token_hash| {
        relay_config(&serve, session.to_owned(), generation, token_hash)
    });
    let relay = UnboundRelay::new(template, bind_token_hash, handshake_timeout);
    let mut announce = Vec::new();
    for (listener, line) in listeners {
        announce.push(line);
        let relay = relay.clone();
        tokio::spawn(async move { relay.serve_tcp(listener).await });
    }
    print_listening(&announce);
    tracing::info!(listeners = ?announce, "relay ready, unbound");
    until_finished(
        relay.finished(),
        (&mut term, &mut int),
        || relay.terminate(term_grace),
        "stopping",
    )
    .await
}

async fn run_serve(serve: Serve) -> i32 {
    if serve.agentcore {
        return run_agentcore(serve).await;
    }
    if serve.unbound {
        return run_unbound(serve).await;
    }
    let Some(session) = serve
        .session
        .clone()
        .or_else(|| std::env::var("OAB_RELAY_SESSION").ok())
    else {
        return fail("no session: pass --session or set OAB_RELAY_SESSION");
    };
    let generation = match serve.generation {
        Some(generation) => generation,
        None => match std::env::var("OAB_RELAY_GENERATION").map(|g| g.trim().parse::<u64>()) {
            Ok(Ok(generation)) => generation,
            Ok(Err(_)) => return fail("OAB_RELAY_GENERATION is not a number"),
            Err(_) => return fail("no generation: pass --generation or set OAB_RELAY_GENERATION"),
        },
    };
    let token_hash = match std::env::var(TOKEN_HASH_ENV).map(|hex| TokenHash::from_hex(&hex)) {
        Ok(Ok(hash)) => hash,
        Ok(Err(why)) => return fail(&format!("{TOKEN_HASH_ENV}: {why}")),
        Err(_) => return fail(&format!("{TOKEN_HASH_ENV} is not set")),
    };
    if let Some(code) = prepare(&serve.make_dirs) {
        return code;
    }
    let relay = match Relay::new(relay_config(&serve, session, generation, token_hash)) {
        Ok(relay) => relay,
        Err(error) => return fail(&error.to_string()),
    };
    become_subreaper(&serve);
    let (mut term, mut int) = match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(term), Ok(int)) => (term, int),
        (Err(error), _) | (_, Err(error)) => return fail(&format!("cannot handle signals: {error}")),
    };
    let listeners = match tcp_listeners(&serve) {
        Ok(listeners) => listeners,
        Err(code) => return code,
    };
    let mut announce = Vec::new();
    for (listener, line) in listeners {
        announce.push(line);
        let relay = relay.clone();
        tokio::spawn(async move { relay.serve_tcp(listener).await });
    }
    if let Some(addr) = serve.http {
        let listener = match TcpListener::bind(addr).await {
            Ok(listener) => listener,
            Err(error) => return fail(&format!("cannot listen on {addr}: {error}")),
        };
        announce.push(format!("http {}", local_addr(&listener, addr)));
        let relay = relay.clone();
        tokio::spawn(async move { relay.serve_http(listener).await });
    }
    print_listening(&announce);
    tracing::info!(listeners = ?announce, generation, "relay ready");
    let term_grace = serve.term_grace;
    until_finished(
        relay.finished(),
        (&mut term, &mut int),
        || relay.terminate(term_grace),
        "stopping the agent",
    )
    .await
}

/// Waits for a relay's exit code, calling `terminate` on each SIGTERM or SIGINT meanwhile.
async fn until_finished(
    finished: impl std::future::Future<Output = i32>,
    (term, int): (&mut tokio::signal::unix::Signal, &mut tokio::signal::unix::Signal),
    terminate: impl Fn(),
    what: &str,
) -> i32 {
    tokio::pin!(finished);
    loop {
        tokio::select! {
            code = &mut finished => return code,
            _ = term.recv() => {
                tracing::info!("SIGTERM: {what}");
                terminate();
            }
            _ = int.recv() => {
                tracing::info!("SIGINT: {what}");
                terminate();
            }
        }
    }
}

fn local_addr(listener: &TcpListener, asked: SocketAddr) -> SocketAddr {
    listener.local_addr().unwrap_or(asked)
}

async fn run_connect(addr: SocketAddr) -> i32 {
    let stream = match TcpStream::connect(addr).await {
        Ok(stream) => stream,
        Err(error) => return fail(&format!("cannot connect to {addr}: {error}")),
    };
    let _ = stream.set_nodelay(true);
    let (mut from_relay, mut to_relay) = stream.into_split();
    let upstream = async move {
        let mut stdin = tokio::io::stdin();
        let _ = tokio::io::copy(&mut stdin, &mut to_relay).await;
        let _ = tokio::io::AsyncWriteExt::shutdown(&mut to_relay).await;
        // Keep the other direction going until the relay closes.
        std::future::pending::<()>().await;
    };
    let downstream = async move {
        let mut stdout = tokio::io::stdout();
        let copied = tokio::io::copy(&mut from_relay, &mut stdout).await;
        let _ = tokio::io::AsyncWriteExt::flush(&mut stdout).await;
        copied
    };
    tokio::select! {
        () = upstream => 0,
        copied = downstream => match copied {
            Ok(_) => 0,
            Err(error) => fail(&format!("bridge failed: {error}")),
        },
    }
}
