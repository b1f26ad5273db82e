//! The worker relay: the in-worker entrypoint `oab-relay` and its resumable, fenced stream
//! protocol, shared by the Kubernetes and AgentCore backends.
//!
//! # Overview
//!
//! ```text
//!  broker                                        worker (Pod or microVM)
//! +---------------------------+  TCP, exec stdio  +----------------------------+
//! | RelayClient -> Attachment |<-- or WebSocket ->| oab-relay serve -- <agent> |
//! | (reconnects, resumes)     |  Noise channel,   | (spawns, buffers, fences)  |
//! |                           |  framed protocol  |                            |
//! +---------------------------+                   +-------------+--------------+
//!                                                               | stdin/stdout pipes
//!                                                          agent (ACP)
//! ```
//!
//! - [`server`]: [`Relay`] runs inside the worker. It starts the agent on the first valid
//!   `hello`, keeps it alive across broker disconnects, numbers its output and keeps what no
//!   broker acknowledged in a bounded buffer, replays it after a reconnect, drops duplicate broker
//!   input, fences stale brokers, forwards signals, reaps children and reports the exit.
//! - [`client`]: [`RelayClient`] turns any [`Connector`] (TCP, a command's stdio, a WebSocket)
//!   into a contract [`Attachment`](session_runtime::Attachment) that reconnects and resumes
//!   transparently.
//! - [`channel`]: the mutually authenticated, encrypted channel (a Noise `NNpsk0` handshake
//!   through `snow`, then ChaCha20-Poly1305 records) every connection opens before a frame flows.
//! - [`protocol`]: frames, their encoding, the decoder and [`Sequencer`](protocol::Sequencer).
//! - [`token`]: `HMAC-SHA256` tokens; the worker holds only their hash.
//! - [`bind`] and [`UnboundRelay`]: a warm pool's relay, started before its session is known and
//!   bound to one later (see "Binding a warm relay").
//!
//! # Protocol
//!
//! Every connection first opens the [`channel`]: a two-message Noise handshake keyed by a secret
//! derived from the token's hash, in which the relay proves it holds this session generation's
//! secret before the broker sends anything else. Everything below then travels inside its
//! encrypted records. The same bytes run over TCP, the `oab-relay connect` stdio bridge and
//! WebSocket binary messages.
//!
//! Inside it, length-prefixed binary frames: `version u8 (1) | type u8 | length u32 | payload`
//! (big-endian, payload at most 1 MiB, rejected from the header alone if longer).
//!
//! | type | dir | payload | meaning |
//! |---|---|---|---|
//! | `1 hello` | B→R | generation u64, epoch u64, nonce u64, resume u64, token \[32\], session (u8 len) | first frame; resume = last output item held (0: all you have) |
//! | `2 welcome` | R→B | generation u64, input_acked u64, output_first u64, pid u32, flags u8, working_dir (u16 len) | hello accepted |
//! | `3 data` | both | seq u64, bytes | agent stdout (R→B) or stdin (B→R) |
//! | `4 ack` | both | seq u64 | every item of the other side's stream up to seq received |
//! | `5 eof` | both | seq u64 | stdout closed (R→B) / close stdin (B→R); sequenced |
//! | `6 exit` | R→B | seq u64, kind u8 (0 code, 1 signal), value i32 | how the agent ended; last output item |
//! | `7 ping` / `8 pong` | both | nonce u64 | heartbeat |
//! | `9 signal` | B→R | signal u8 (15, 9, 2), grace_ms u32 | signal the agent's process group; SIGTERM escalates to SIGKILL after grace |
//! | `10 error` | both | code u16, message (u16 len) | refusal or failure; the connection closes |
//! | `11 bind` | B→R | bind_token \[32\], session (u8 len), generation u64, token_hash \[32\], working_dir (u16 len), env_count u16, env_count × (name (u16 len), value (u32 len)) | first and only frame of a bind connection: binds an unbound relay (see "Binding a warm relay") |
//! | `12 bound` | R→B | generation u64 | the bind took (or had already taken) effect; the connection closes |
//!
//! Error codes ([`ErrorCode`]): 1 `bad-frame`, 2 `unsupported-version`, 3 `unexpected-frame`,
//! 4 `out-of-order`, 5 `frame-too-large`, 6 `session-mismatch`, 7 `stale-generation`,
//! 8 `bad-token`, 9 `stale-epoch`, 10 `replayed-hello`, 11 `resume-gap`, 12 `superseded`,
//! 13 `spawn-failed`, 14 `handshake-timeout`, 15 `idle-timeout`, 16 `internal`,
//! 17 `input-overflow`, 18 `epoch-ahead`, 19 `already-bound`. A refused connection never disturbs the current one. A
//! peer that fails the channel handshake gets no error frame at all: only the channel's empty
//! refusal.
//!
//! A hello is checked in this order: token (`bad-token`: nothing else is said to a client
//! without it, not even the generation), session (`session-mismatch`), generation
//! (`stale-generation`), epoch (`epoch-ahead` if further ahead of the relay's clock than
//! [`EPOCH_LEEWAY`](server::EPOCH_LEEWAY), `stale-epoch` if older than the newest accepted), nonce
//! (`replayed-hello` if it does not exceed the last accepted one of the same epoch), resume point
//! (`resume-gap`). An accepted hello replaces the current connection, which is closed with
//! `superseded`.
//!
//! # Epochs
//!
//! A hello with a newer epoch takes the relay over from an older one; that is how a restarted
//! broker (epoch: its start time in milliseconds) or a new leader fences its predecessor. The
//! relay cannot tell a broker from any other holder of the token, so it does not trust a
//! client-chosen epoch blindly; it *bounds* it by its own clock: an epoch more than
//! [`EPOCH_LEEWAY`](server::EPOCH_LEEWAY) (60 s) ahead is refused with `epoch-ahead` (the
//! client retries: a broker whose clock runs ahead gets in once the relay's catches up). Why a
//! bound, and not signed epochs or connection order:
//!
//! - Who can hold the token at all is now narrow: it travels only inside a channel whose other
//!   end proved it holds the session generation's secret, so eavesdroppers, impostors at a reused
//!   Pod IP and relays of other sessions never see it, and captured bytes cannot be replayed (see
//!   [`channel`]). What remains is the broker and the worker itself.
//! - Against those, the bound is what the relay can check on its own: a holder can claim at most
//!   "now + 60 s", which fences the brokers started before that moment, as a newer broker would,
//!   but every broker started later wins again. The `2^64-1` lockout "for good" is gone.
//! - Fencing by connection order alone would let a partitioned old broker's reconnect take the
//!   stream back from its successor; signed epochs would need a signing key in the broker and
//!   its public half in every worker (and in AgentCore's shared environment), for a threat (the
//!   worker disturbing its own session) that the agent inside it can already carry out by exiting.
//!
//! # Guarantees
//!
//! - **Exactly once, in order, per client.** Each direction is a numbered stream of items kept by
//!   its sender until acknowledged. After a transport drop the client reconnects (the first retry
//!   at once, then with backoff), resumes the output after the last item it received and resends
//!   the input the relay did not acknowledge; both sides drop duplicates and refuse gaps.
//!   Acknowledgements ride along with other frames or follow within 5 ms / 8 items.
//! - **Nothing is lost silently.** Agent output nobody acknowledged stays in the relay's bounded
//!   buffer; by default ([`Overflow::Block`]) the relay stops reading the agent's stdout when the
//!   buffer is full, so the agent waits instead of losing output. With [`Overflow::Discard`] the
//!   oldest output is dropped while no broker is connected, and a broker that needs it is refused
//!   with `resume-gap`.
//! - **Takeover.** A client that takes over a running worker (a restarted broker, a new epoch)
//!   receives the output no previous client acknowledged, then new output. A dropped attachment
//!   first delivers the input written to it and acknowledges the output it received (best effort,
//!   within 2 s).
//! - **Independent directions.** Reading and writing never wait on each other, on either side, so
//!   a `session/cancel` gets through while a turn streams to a broker that reads slowly. The
//!   relay takes input off the connection at once and writes it to the agent from a task of its
//!   own, acknowledging each item once written: an agent that stops reading its stdin holds up
//!   neither the acknowledgements nor the heartbeats and signals behind its input. What it holds
//!   unwritten is bounded (`input_bytes`, 4 MiB; more is refused with `input-overflow`), and a
//!   client never has more than its input window (1 MiB) unacknowledged.
//! - **How it ended.** The relay reports the agent's exit code or signal as the last output item
//!   and ends once a broker acknowledged it (or after `--linger`).
//!
//! # Errors
//!
//! The client keeps its failures private and converts them once into the contract's
//! [`Error`](session_runtime::Error):
//!
//! | relay failure | contract error |
//! |---|---|
//! | `superseded`, `stale-epoch`, or the relay's input moved past this client's | `Fenced` (by the same generation) |
//! | `resume-gap` | `Disconnected` |
//! | `spawn-failed` | `WorkerFailed` with `WorkerFailure::Spawn` |
//! | `stale-generation`, `session-mismatch`, `bad-token`, `unsupported-version`, `input-overflow` | `Backend`, not retryable |
//! | the channel handshake failed other than by the transport: the relay did not prove it holds the session generation's secret, refused the broker's key, or speaks no channel | `Backend`, not retryable (the broker sent it nothing but the handshake) |
//! | `epoch-ahead` | retried with backoff; `Backend` (retryable) or `Disconnected` once the reconnect budget is spent |
//! | a connector's [`Refusal`] (e.g. AgentCore denied access) | `Backend`, at once, retryable as it says |
//! | no connection within the reconnect budget on attach | `Backend`, retryable |
//! | connection lost for longer than the reconnect budget | `Disconnected` |
//!
//! Reads report them inside an `std::io::Error` (recover with
//! [`Error::from_io`](session_runtime::Error::from_io)) after the output received before them;
//! writes through [`AgentInput`](session_runtime::AgentInput) report `Disconnected`.
//!
//! # Tokens and the channel key
//!
//! The broker derives `token = HMAC-SHA256(broker key, u8 len ‖ session id ‖ u64be generation)`
//! ([`BrokerKey::token`]) and gives the worker only `SHA-256(token)` in hex, in the environment
//! variable [`TOKEN_HASH_ENV`](token::TOKEN_HASH_ENV). Both sides derive the channel's pre-shared
//! key from that hash and the session id ([`ChannelKey`](channel::ChannelKey)): the relay proves
//! it holds the hash by completing the handshake, the broker proves it holds the token itself (a
//! preimage nothing in the worker can compute) in its hello inside the channel, which the relay
//! compares in constant time. A token (and so a channel key) of one session or generation opens
//! nothing of another.
//!
//! # Binding a warm relay
//!
//! A warm pool keeps worker Pods running before any session needs them, so that a session's first
//! attach does not wait for a Pod to be scheduled, its image pulled and its relay started. Such a
//! Pod's relay runs `oab-relay serve --unbound -- <agent>` ([`UnboundRelay`]): it knows no session,
//! generation or token hash, only `SHA-256` of its *bind token*, from
//! [`BIND_TOKEN_HASH_ENV`](token::BIND_TOKEN_HASH_ENV) (the broker derives one bind token per pool
//! member with [`BrokerKey::bind_token`], which never equals a session token). It listens at once,
//! so the Pod becomes Ready, and starts no agent.
//!
//! When a session claims the member:
//!
//! 1. The broker calls [`bind`] with the bind token and a [`Binding`]: the session, the generation,
//!    the hash of that session generation's token, and optionally the agent's working directory
//!    and environment entries. It opens a connection whose channel is keyed by the bind token's
//!    hash ([`ChannelKey::for_bind`](channel::ChannelKey::for_bind)), as a hello's is keyed by the
//!    session token's, and sends one `bind`. The relay checks that the token in it hashes to what
//!    it holds (in constant time; `bad-token` otherwise), answers `bound` and closes the
//!    connection.
//! 2. The broker then attaches as to any relay ([`RelayClient`]): from the `bind` on, the relay is
//!    exactly a relay started with that session, generation and token hash. A hello with another
//!    generation's token fails at the channel, the first valid hello starts the agent, in the
//!    binding's working directory (the relay's own if it names none), with the binding's
//!    environment.
//!
//! Before it is bound the relay holds no session key, so every hello, whatever its token, fails
//! at the channel with the same empty refusal a wrong token gets. A relay started bound holds no
//! bind key, so a `bind` fails at its channel. A `bind` on a hello's connection, or a hello on a
//! bind connection, is `unexpected-frame`.
//!
//! **Idempotency.** A `bind` with the binding the relay already has (the same session, generation,
//! token hash, working directory and environment, in the same order) is answered `bound` again, so a
//! broker whose answer was lost ([`BindError::is_retryable`]) simply binds again; any other binding
//! is refused with `already-bound` and changes nothing. A binding that breaks a rule (an
//! environment name that is empty, holds `=` or NUL, starts with `OAB_RELAY_` or appears twice, a
//! NUL in a value, more than 64 KiB of names and values, a relative working directory) is refused
//! with `bad-frame` and binds nothing; [`bind`] does not send one.
//!
//! **What the agent sees.** The relay's environment without any `OAB_RELAY_` variable (the bind
//! token's hash included), plus the binding's entries, which win over the worker's for the same
//! name. The relay logs the binding's session, generation, working directory and environment
//! names, never a token, a token hash or an environment value.
//!
//! The bind token's hash guards the bind as a token hash guards a hello: whoever reads it from the
//! Pod's spec can pose as the unbound relay to a broker that binds it, as whoever reads a token
//! hash can pose as a bound relay today.
//!
//! # The binary
//!
//! ```text
//! oab-relay serve [--listen ADDR]... [--http ADDR] [--session ID] [--generation N]
//!                 [--workdir DIR] [--replay-bytes N] [--overflow block|discard]
//!                 [--heartbeat 30s] [--linger 60s] [--term-grace 10s] -- <agent argv>
//! oab-relay serve --agentcore [--http ADDR] [options] -- <agent argv>
//! oab-relay serve --unbound [--listen ADDR]... [--workdir DIR] [options] -- <agent argv>
//! oab-relay connect [ADDR]        # stdio <-> the local relay, for pods/exec
//! ```
//!
//! `serve` reads `OAB_RELAY_SESSION`, `OAB_RELAY_GENERATION` and `OAB_RELAY_TOKEN_SHA256`
//! (never passed on to the agent), listens on TCP port [`DEFAULT_PORT`](server::DEFAULT_PORT) of
//! `[::]` with `IPV6_V6ONLY` off, so IPv6 and IPv4 brokers reach it on one socket (`0.0.0.0` on a
//! host without IPv6; [`server::listen`]) unless told otherwise, and with `--http 0.0.0.0:8080` serves AgentCore's contract (`GET /ping`,
//! WebSocket `/ws`, `POST /invocations`). With `--agentcore` it needs no session, generation
//! or token hash: it serves only that contract (on `0.0.0.0:8080` by default), takes them from
//! the runtime session id AgentCore passes in each `/ws` request's header ([`agentcore`]), and
//! replaces the agent for each newer generation ([`AgentCoreServer`](server::AgentCoreServer)).
//! With `--unbound` (TCP only) it reads `OAB_RELAY_BIND_TOKEN_SHA256` instead of the session's
//! three variables, which it ignores, and waits to be bound (see "Binding a warm relay"); a missing
//! or malformed value ends it with code 2 before it listens, as a missing token hash does.
//! It prints one `oab-relay: listening on <kind> <addr>`
//! line per listener to stdout, forwards `SIGTERM`/`SIGINT` to the agent's process group, acts as
//! a child subreaper and reaps every orphan, and exits with the agent's exit code (128 + signal
//! for a signal, 127 if it could not be started).
//!
//! # Static binary
//!
//! The relay must run in a `FROM scratch` image, so build it statically linked:
//!
//! ```text
//! RUSTFLAGS='-C target-feature=+crt-static' \
//!     cargo build --release -p worker-relay --bin oab-relay --target x86_64-unknown-linux-gnu
//! # -> target/x86_64-unknown-linux-gnu/release/oab-relay (static-pie, no dynamic loader)
//! ```
//!
//! (`--target` keeps the flag away from build scripts and proc macros. With the musl target
//! installed, `--target x86_64-unknown-linux-musl` works without `RUSTFLAGS`; for AgentCore's
//! ARM64 use the `aarch64-*` triples.) The crate has no C dependencies, so either way the
//! result needs nothing from the image. `tests/static_build.rs` checks it (ignored by default:
//! it builds a release binary).

//!
//! # Testing
//!
//! - `cargo test -p worker-relay`: protocol, channel and token unit tests; `oab-relay` processes
//!   driven end to end (`tests/relay.rs`, `tests/fencing.rs`); the channel attacked from outside
//!   (`tests/authentication.rs`: a replayed exchange with a larger epoch, a token holder's epoch,
//!   an impostor listener, a relay with another secret, a client fishing for the generation, the
//!   dual-stack listener); unbound relays bound, re-bound and refused, the agent's environment and
//!   working directory after a bind, the `--unbound` command line (`tests/binding.rs`); 10,000
//!   lines each way across 200 random transport drops, cancel under a 50 MiB stream, memory with
//!   a full buffer
//!   (`tests/reliability.rs`); the contract's conformance suite through a `RelayRuntime` whose
//!   workers are `oab-relay serve -- acp-test-agent` (`tests/conformance.rs`); a bounded
//!   randomized run of the decoder (`tests/decode_fuzz.rs`).
//! - Fuzzing (cargo-fuzz; nightly, or stable with `RUSTC_BOOTSTRAP=1`): the workspace's
//!   `fuzz/fuzz_targets/relay_frames.rs`, run by `./scripts/fuzz 300 relay_frames` (CI runs every
//!   target for a bounded time).
//! - Benchmarks: `cargo bench -p worker-relay --bench relay` (ratios against a raw pipe and raw
//!   loopback TCP in the same run, and the relay's memory with a full replay buffer).

pub mod agentcore;
pub mod channel;
pub mod client;
mod error;
pub mod protocol;
pub mod server;
pub mod token;
pub mod transport;

pub use client::{bind, BindError, ClientConfig, RelayClient};
pub use protocol::{Binding, ErrorCode, Frame, FrameError};
pub use server::{Overflow, Relay, RelayConfig, UnboundRelay};
pub use token::{BrokerKey, Token, TokenHash};
pub use transport::{CommandConnector, Connector, Refusal, TcpConnector, Transport, WebSocketConnector};
