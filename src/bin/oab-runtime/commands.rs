//! Every subcommand but `verify`.

use std::process::ExitCode;
use std::sync::Arc;

use openab_runtime::{
    AgentCommand, CloseReason, Error, SessionId, SessionRuntime, SessionStatus, StorageState, SuspendReason,
};

use crate::settings::{ConfiguredAgent, Settings};
use crate::{Cli, CloseArg, Command, SuspendArg};

pub(crate) type Outcome = Result<ExitCode, Box<dyn std::error::Error>>;

pub(crate) async fn dispatch(cli: Cli) -> Outcome {
    let settings = Settings::load(cli.config.as_deref())?;
    match cli.command {
        Command::Verify { root, shared_input } => crate::verify::run(settings, root, shared_input).await,
        Command::Run {
            platform,
            thread,
            agent,
            env,
            keep_cwd,
            argv,
        } => crate::run::run(settings, &platform, &thread, &agent, argv, &env, keep_cwd).await,
        Command::Ls => ls(&runtime(&settings, None)?).await,
        Command::Status { id } => {
            let status = runtime(&settings, None)?.status(&session_id(&id)?).await?;
            println!("{}", serde_json::to_string_pretty(&status)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Suspend { id, reason } => {
            runtime(&settings, None)?
                .suspend(&session_id(&id)?, suspend_reason(reason))
                .await?;
            println!("suspended {id}");
            Ok(ExitCode::SUCCESS)
        }
        Command::Close { id, reason } => {
            let runtime = runtime(&settings, None)?;
            let id = session_id(&id)?;
            // Closing is idempotent, so an unknown id is no error; but it is not a close either.
            if let Err(Error::NotFound { .. }) = runtime.status(&id).await {
                println!("nothing to close: there is no session {id} (it never existed here, or its storage is already gone)");
                return Ok(ExitCode::SUCCESS);
            }
            runtime.close(&id, close_reason(reason)).await?;
            println!("closed {id}");
            Ok(ExitCode::SUCCESS)
        }
        Command::Gc => {
            let report = runtime(&settings, None)?.reconcile().await?;
            println!("killed workers:    {}", report.killed_workers.len());
            for (id, why) in &report.killed_workers {
                println!("  {id}: {why}");
            }
            println!("finished closes:   {}", report.finished_closes.len());
            println!("suspended (idle):  {}", report.suspended_idle.len());
            println!("expired storage:   {}", report.expired_storage.len());
            println!("expired records:   {}", report.expired_records.len());
            println!(
                "orphaned storage:  {} (left in place)",
                report.orphaned_storage.len()
            );
            for (id, what) in &report.orphaned_storage {
                println!("  {id}: {what}");
            }
            println!("storage found lost: {}", report.lost_storage.len());
            for (id, what) in &report.lost_storage {
                println!("  {id}: {what}");
            }
            for error in &report.errors {
                println!("error: {error}");
            }
            Ok(if report.errors.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Command::Controller {
            holder,
            resync,
            lease_duration,
            metrics_listen,
        } => {
            let args = crate::controller::ControllerArgs {
                holder,
                resync,
                lease_duration,
                metrics_listen,
            };
            crate::controller::run(settings, args).await
        }
        Command::RunGuard { id } => crate::run::guard(&settings, &id).await,
        Command::TestAgent { args } => Ok(test_agent(&args)),
    }
}

/// Builds the configured runtime. Commands that start no agent still need an agent command to
/// build one; without `[agent]` it is the bundled test agent.
pub(crate) fn runtime(
    settings: &Settings,
    agent: Option<AgentCommand>,
) -> Result<Arc<dyn SessionRuntime>, Error> {
    let configured = settings.agent.as_ref().and_then(ConfiguredAgent::command);
    let agent = match agent.or(configured) {
        Some(agent) => agent,
        None => bundled_test_agent()?,
    };
    openab_runtime::from_config(&settings.runtime, &agent)
}

/// This very binary, in its hidden test-agent mode.
pub(crate) fn bundled_test_agent() -> Result<AgentCommand, Error> {
    let exe = std::env::current_exe()
        .map_err(|e| Error::backend("oab-runtime", false, "locating the oab-runtime binary", e))?;
    Ok(AgentCommand::new(exe.display().to_string()).args(["__acp-test-agent"]))
}

fn session_id(text: &str) -> Result<SessionId, Error> {
    SessionId::parse(text.trim())
}

fn suspend_reason(reason: SuspendArg) -> SuspendReason {
    match reason {
        SuspendArg::Idle => SuspendReason::Idle,
        SuspendArg::Capacity => SuspendReason::Capacity,
        SuspendArg::Shutdown => SuspendReason::Shutdown,
        SuspendArg::Hung => SuspendReason::Hung,
    }
}

fn close_reason(reason: CloseArg) -> CloseReason {
    match reason {
        CloseArg::Reset => CloseReason::Reset,
        CloseArg::Ended => CloseReason::Ended,
        CloseArg::Expired => CloseReason::Expired,
    }
}

async fn ls(runtime: &Arc<dyn SessionRuntime>) -> Outcome {
    let mut sessions = runtime.list().await?;
    sessions.sort_by_key(|s| std::cmp::Reverse(s.last_activity));
    println!(
        "{:<20}  {:<9}  {:>4}  {:<32}  {:>5}  STORAGE",
        "SESSION", "STATE", "GEN", "WORKER", "IDLE"
    );
    let now = std::time::SystemTime::now();
    for status in &sessions {
        println!("{}", row(status, now));
    }
    Ok(ExitCode::SUCCESS)
}

/// How long ago `then` was at `now`, in the largest whole unit (`42s`, `5m`, `3h`, `2d`).
fn ago(then: std::time::SystemTime, now: std::time::SystemTime) -> String {
    let seconds = now.duration_since(then).map_or(0, |elapsed| elapsed.as_secs());
    match seconds {
        0..60 => format!("{seconds}s"),
        60..3600 => format!("{}m", seconds / 60),
        3600..86400 => format!("{}h", seconds / 3600),
        _ => format!("{}d", seconds / 86400),
    }
}

fn row(status: &SessionStatus, now: std::time::SystemTime) -> String {
    let worker = status
        .worker
        .as_ref()
        .map(|w| w.worker_id.as_str())
        .unwrap_or("-");
    let storage = match status.storage {
        StorageState::Present => "present".to_owned(),
        StorageState::Retained { until } => format!("retained ({until:?})"),
        StorageState::Deleted => "deleted".to_owned(),
        StorageState::Lost => "LOST".to_owned(),
        _ => "unknown".to_owned(),
    };
    // A failed start leaves the state as it was (`created` at generation 0 for a first start),
    // so the failure is shown beside it.
    let failure = match &status.last_start_failure {
        Some(failure) => format!("  start failed: {}", one_line(&failure.error, 160)),
        None => String::new(),
    };
    format!(
        "{:<20}  {:<9}  {:>4}  {:<32}  {:>5}  {storage}{failure}",
        status.id,
        status.state,
        status.generation,
        worker,
        ago(status.last_activity, now)
    )
}

/// `text` on one line (line breaks as spaces), at most `limit` characters.
fn one_line(text: &str, limit: usize) -> String {
    let flat: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    match flat.char_indices().nth(limit) {
        Some((cut, _)) => format!("{}...", &flat[..cut]),
        None => flat,
    }
}

pub(crate) fn test_agent(args: &[String]) -> ExitCode {
    let mut options = acp_test_agent::AgentOptions::default();
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--ignore-stdin-eof" => options.ignore_stdin_eof = true,
            "--state-dir" => options.state_dir = args.next().map(Into::into),
            other => {
                eprintln!("oab-runtime __acp-test-agent: unknown argument {other:?}");
                return ExitCode::from(2);
            }
        }
    }
    if options.state_dir.is_none() {
        options.state_dir =
            std::env::var_os("HOME").map(|home| std::path::Path::new(&home).join(".acp-test-agent"));
    }
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("oab-runtime __acp-test-agent: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(acp_test_agent::serve(
        tokio::io::stdin(),
        tokio::io::stdout(),
        options,
    )) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("oab-runtime __acp-test-agent: {error}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use super::ago;

    #[test]
    fn idle_times_are_shown_in_their_largest_whole_unit() {
        let now = SystemTime::now();
        for (seconds, shown) in [
            (0, "0s"),
            (59, "59s"),
            (60, "1m"),
            (3599, "59m"),
            (7200, "2h"),
            (3 * 86400 + 5, "3d"),
        ] {
            assert_eq!(ago(now - Duration::from_secs(seconds), now), shown);
        }
        assert_eq!(
            ago(now + Duration::from_secs(5), now),
            "0s",
            "a clock ahead is no idle time"
        );
    }
}
