//! An offline emulator of AWS Bedrock AgentCore Runtime's data plane, for tests.
//!
//! It listens on `127.0.0.1` (and contacts nothing but loopback), speaks the wire format the
//! real `aws-sdk-bedrockagentcore` client sends and expects, verifies SigV4 signatures against
//! static test credentials, and runs one isolated worker per runtime session id: by default an
//! `oab-relay serve --http 127.0.0.1:0 --agentcore -- <agent>` under the local backend's sandbox,
//! on a per-session storage directory that survives stop and resume.
//!
//! # Starting it and pointing the SDK at it
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use agentcore_emulator::{Emulator, WorkerCommand};
//!
//! let emulator = Emulator::builder()
//!     .worker_command(WorkerCommand::relay("/path/to/oab-relay", ["/path/to/acp-test-agent"]))
//!     .idle_timeout(std::time::Duration::from_secs(2))
//!     .start()
//!     .await?;
//! println!("sandbox: {}", emulator.sandbox());
//! // SDK (dev-dependency):
//! // let creds = emulator.credentials();
//! // let config = aws_sdk_bedrockagentcore::Config::builder()
//! //     .behavior_version(BehaviorVersion::latest())
//! //     .region(Region::new(emulator.region().to_owned()))
//! //     .credentials_provider(Credentials::new(creds.access_key_id(), creds.secret_access_key(),
//! //         creds.session_token().map(str::to_owned), None, "test"))
//! //     .endpoint_url(emulator.endpoint_url())
//! //     .build();
//! // client.invoke_agent_runtime().agent_runtime_arn(emulator.runtime_arn().to_string()) …
//! emulator.shutdown().await?;
//! # Ok(())
//! # }
//! ```
//!
//! # What it emulates
//!
//! | request | behaviour |
//! |---|---|
//! | `POST /runtimes/{arn}/invocations?qualifier=Q` | starts the session's worker if none runs, sends the payload to its `POST /invocations` (with the session id header, content type, accept, user id and trace headers; chunked when the client sent it chunked or [`EmulatorBuilder::chunk_invocation_bodies`] asks), and streams its answer back chunk by chunk with the worker's content type. A worker answering non-2xx, or one that cannot be reached or started, is `424 RuntimeClientError`. |
//! | `POST /runtimes/{arn}/stopruntimesession?qualifier=Q` | stops the session's worker now, cutting its in-flight streams (the client sees its stream fail); storage stays. The microVM then takes [`EmulatorBuilder::stop_latency`] (default 15 s) to terminate: invocations and upgrades of the session meanwhile are `409 RetryableConflictException`. A session with no running worker (never seen, already stopped, timed out, terminating) is `404 ResourceNotFoundException`: the emulator's choice, since the service's answer there is undocumented. |
//! | `GET /runtimes/{arn}/ws?qualifier=Q` (WebSocket upgrade) | after verification, starts the worker if needed, sends the upgrade to its `GET /ws` with the session id header and the client's `Sec-WebSocket-*` headers, passes the worker's answer on, then passes WebSocket frames both ways, each parsed and passed whole, under the front's quotas ([`WebSocketLimits`]: 32 KB frames, 250 frames per second each way, 60 minutes per connection); a connection breaking one is closed (the client gets a close frame: 1009 for a frame too large, 1008 for the rate, 1001 at the duration cap). |
//!
//! Shared by all three: the session id comes from the `X-Amzn-Bedrock-AgentCore-Runtime-Session-Id`
//! header (or, for presigned URLs, the query parameter of that name) and must be 33 to 256
//! characters (`400 ValidationException`); the path label is the percent-encoded runtime ARN (or
//! a bare runtime id with `?accountId=`), unknown ones are `404 ResourceNotFoundException`, as is
//! an unknown `qualifier` (default `DEFAULT`; add more with [`EmulatorBuilder::qualifier`]).
//! Errors are `{"message": "..."}` with `x-amzn-errortype: <Name>` and its status. Connections
//! are kept alive across requests unless the client sends `Connection: close`; a cut stream
//! closes its connection.
//!
//! Checks happen in AWS's order: route, signature, runtime, qualifier (its pattern
//! `[a-zA-Z][a-zA-Z0-9_]{0,47}`, `400 ValidationException`, then whether the endpoint exists),
//! the caller's IAM policy, session id, the invocation rate (25 invocations and upgrades per
//! second per endpoint, `429 ThrottlingException`), an armed fault, the termination window
//! (`409`), the active-session cap (1,000 running workers, `402 ServiceQuotaExceededException`),
//! then the worker.
//!
//! # IAM
//!
//! Every request is authorized against the [`IamPolicy`] of the credentials that signed it
//! ([`TestCredentials::with_policy`]; default: allow all). The actions are
//! `bedrock-agentcore:InvokeAgentRuntime`, `bedrock-agentcore:StopRuntimeSession` and, for the
//! upgrade, `bedrock-agentcore:InvokeAgentRuntimeWithWebSocketStream`; each must be allowed on the
//! runtime's ARN and on its endpoint's (`<runtime ARN>/runtime-endpoint/<qualifier>`). A refusal
//! is `403 AccessDeniedException` with IAM's wording.
//!
//! # Signatures
//!
//! Header auth (`Authorization: AWS4-HMAC-SHA256 …`, `x-amz-date`, `x-amz-security-token`) and
//! presigned query auth (`X-Amz-Algorithm` … `X-Amz-Signature`) are both recomputed with
//! `aws-sigv4` from the request as received (method, encoded path, query, the headers it lists as
//! signed, the body hash) at its own date, and compared in constant time. Refusals, all 403:
//! none at all `MissingAuthenticationTokenException`; an unknown access key or session token
//! `UnrecognizedClientException`; a token marked expired ([`Emulator::expire_session_token`])
//! `ExpiredTokenException`; a wrong signature, a wrong region or service in the scope, or a date
//! more than 5 minutes off (or past a presigned URL's `X-Amz-Expires`)
//! `InvalidSignatureException` with AWS's texts; a malformed header `IncompleteSignatureException`.
//! A presigned upgrade may hash its empty body either as the empty string or as
//! `UNSIGNED-PAYLOAD`.
//!
//! # Workers and sandbox
//!
//! A [`WorkerLauncher`] starts one worker per runtime session (keyed by runtime ARN and session
//! id) at its first invoke or `/ws`, and again after a stop. The default, [`LocalLauncher`],
//! makes each runtime session a session of the local backend (`runtime-local`): sandbox `auto`
//! (bubblewrap, else Landlock, else plain processes: [`Emulator::sandbox`] says which), `network
//! = host` so the relay's loopback port is reachable, the local session's workspace as the
//! worker's working directory, where the session storage appears (see
//! [Session storage](#session-storage); [`Emulator::session_storage`] gives its host path), the
//! agent binary bound read-only. Stop, idle timeout and lifetime end suspend the
//! local session; storage expiry and [`Emulator::bump_runtime_version`] close it (its storage is
//! deleted). A worker is anything that prints `oab-relay: listening on http 127.0.0.1:PORT` and
//! then serves `GET /ping`, `GET /ws` and `POST /invocations` there ([`WorkerCommand::new`] for
//! another program, or a [`WorkerLauncher`] of your own for in-process workers).
//!
//! # Session storage
//!
//! [`StorageLimits`] (set with [`EmulatorBuilder::storage_limits`] or
//! [`LocalLauncherBuilder::storage_limits`]) are AgentCore's reported limits, enforced by the
//! kernel on the worker itself, not checked in the emulator's code:
//!
//! | limit (default) | mechanism |
//! |---|---|
//! | 1 GB (1 GiB) per session: writes beyond fail with `ENOSPC` | the storage is an ext4 file system of that size: a sparse image per session (`mkfs.ext4`, no journal, no reserved blocks; about 990 MiB of a 1 GiB image hold files, the rest is ext4's metadata) in the local session's directory, loop-mounted on the host while the launcher lives |
//! | absent while the worker starts | the worker's working directory is a mount point of its own until the worker has announced its port; the storage is bound onto it (and propagates into the sandbox) just before the first request is forwarded, and unmounted at every stop: during start-up the worker sees an empty directory whose writes the storage later hides |
//! | no hard links, FIFOs, UNIX sockets, xattrs or `fallocate` | `oab-storage-rules` execs the worker under a Landlock ruleset that refuses making sockets and FIFOs on the storage alone (`EACCES`), and seccomp filters: `link`/`linkat` get `EPERM`, setting or removing an xattr and `fallocate` get `EOPNOTSUPP`, in every directory ([`storage_rules`]) |
//!
//! Why these: a loop-mounted image makes the cap a real file system's `ENOSPC` for any program;
//! no stock file system has exactly the reported refusals (vfat refuses links, FIFOs, sockets
//! and xattrs but also symbolic links, permissions and names with `:`, and allows `fallocate`;
//! a size-limited tmpfs allows all five and lives in memory), and a FUSE file system of our own
//! would be much more code on the data path. Landlock is path-aware, so a socket or FIFO in
//! `/tmp` or HOME still works (except under the local backend's Landlock mode, where the worker
//! cannot list the directories it would need to grant); a seccomp filter sees call numbers, not
//! paths, so hard links, xattrs and `fallocate` are refused in every directory the worker
//! writes (its HOME and `/tmp` too, which in the emulator are local session storage as well):
//! stricter than the service, never looser.
//!
//! The mounts need root, `mount` and `mkfs.ext4` (e2fsprogs); without them the launcher warns
//! and [`LocalLauncher::storage_enforcement`] says which limits hold. The refusals need the
//! `oab-storage-rules` binary of this crate (found next to the running executable or one
//! directory up, or given with [`LocalLauncherBuilder::storage_rules_helper`]). A stop, a
//! storage reset, [`Emulator::shutdown`] and dropping the launcher unmount what it mounted
//! (dropping lazily, so nothing stays in the mount table; each loop device is freed with its
//! last user). [`Emulator::session_storage`] is the image's host mount point.
//!
//! # Lifecycle
//!
//! [`Lifecycle`]: idle timeout (900 s), as AgentCore documents it: the clock restarts at every
//! request for the session and while an invocation's answer streams, whenever the worker's
//! `/ping` (asked every tick) answers `{"status":"HealthyBusy"}`, and whenever the
//! `time_of_last_update` it reports changes; frames on an open WebSocket restart it only with
//! [`EmulatorBuilder::stream_bytes_are_activity`]. Maximum lifetime (8 h; the worker is stopped at
//! that age even mid-stream), storage expiry (14 days without use). All can be set down to
//! milliseconds for tests. The emulator does not enforce AgentCore's
//! 60 s minimum or idle ≤ lifetime.
//!
//! # Faults
//!
//! [`Emulator::fail_next`] makes the next N calls of an [`Operation`] answer a [`Fault`]
//! (500 `InternalServerException`, 429 `ThrottlingException`, 403 `ExpiredTokenException`,
//! 403 `AccessDeniedException`, 424 `RuntimeClientError`, 503 `ServiceUnavailableException`,
//! 401 `UnauthorizedException`, 402 `ServiceQuotaExceededException`, 409
//! `RetryableConflictException`, 409 `ConflictException`);
//! a faulted call never reaches a worker. [`Emulator::drop_websockets`] cuts every open
//! WebSocket of a session (both directions; the worker keeps running).
//! [`Emulator::slow_stream`] delays every chunk of an invocation's answer. [`Emulator::requests`]
//! is the request log ([`RequestRecord`]: operation, session id, qualifier, the SDK's
//! `amz-sdk-request` attempt header, status), e.g. to assert that a stream was not retried.
//!
//! # Its tests
//!
//! `cargo test -p agentcore-emulator` runs them against `examples/test_worker.rs` (a stand-in
//! for the relay that streams SSE, writes and reads files in its storage, reports busy, and
//! echoes on `/ws`), sandboxed like the default launcher sandboxes (bubblewrap where it works).
//! The end-to-end test with the real relay and the ACP test agent needs them built first:
//! `cargo build -p worker-relay --bin oab-relay -p acp-test-agent`, then
//! `cargo test -p agentcore-emulator --test relay -- --ignored`.
//!
//! # What it does not emulate
//!
//! - IAM beyond identity policies of `Effect`/`Action`/`Resource` (no conditions, resource
//!   policies or SCPs); no `InvokeAgentRuntimeForUser` check for `runtimeUserId`.
//! - `InvokeAgentRuntimeCommand`, the `/ws/shells` interactive shell, MCP/A2A/AG-UI protocols,
//!   OAuth (JWT) inbound auth, the control plane (`GetAgentRuntime` …), runtime versions other
//!   than the reset of storage.
//! - microVM isolation: workers are processes under the local sandbox, with the host's network.
//! - The 15-minute cap on synchronous invocations, payload and chunk size limits other than a
//!   100 MB request body, cold-start latency, the control plane's quotas.
//! - Session storage's durability (everything written is kept, crash or not) and its 14-day
//!   expiry beyond the configured clock; its refusals hold for the whole worker, not only on the
//!   storage (see [Session storage](#session-storage)).
//! - TLS: plain `http://` and `ws://` only.
//! - The service's exact answer for a stopped session (404 here), and whether WebSocket frames
//!   count as activity (not documented; not here unless the flag says so).

mod arn;
mod credentials;
mod emulator;
mod error;
mod faults;
mod http;
mod iam;
mod lifecycle;
mod local;
mod proxy;
mod server;
mod sessions;
mod sigv4;
mod storage;
pub mod storage_rules;
mod websocket;
mod worker;

pub use arn::{RuntimeArn, MAX_SESSION_ID_LEN, MIN_SESSION_ID_LEN};
pub use credentials::TestCredentials;
pub use emulator::{
    Emulator, EmulatorBuilder, DEFAULT_ACCOUNT, DEFAULT_INVOCATIONS_PER_SECOND, DEFAULT_MAX_ACTIVE_SESSIONS,
    DEFAULT_REGION, DEFAULT_RUNTIME_ID, DEFAULT_STOP_LATENCY,
};
pub use error::{EmulatorError, ErrorKind, ServiceError, WorkerError};
pub use faults::{Fault, Operation, RequestRecord};
pub use iam::{IamPolicy, PolicyError};
pub use lifecycle::Lifecycle;
pub use local::{LocalLauncher, LocalLauncherBuilder, WorkerCommand, STORAGE_RULES_HELPER};
pub use session_runtime::config::SandboxMode;
pub use session_runtime::IsolationLevel;
pub use storage::{StorageEnforcement, StorageLimits};
pub use websocket::WebSocketLimits;
pub use worker::{
    read_announcement, RunningWorker, SandboxReport, SessionKey, WorkerLauncher, ANNOUNCEMENT_PREFIX,
};

/// The header carrying the runtime session id (also the presigned query parameter's name).
pub const SESSION_HEADER: &str = "x-amzn-bedrock-agentcore-runtime-session-id";
/// The query parameter name of the session id in a presigned URL, as AWS spells it.
pub const SESSION_QUERY_PARAM: &str = "X-Amzn-Bedrock-AgentCore-Runtime-Session-Id";
