//! `ThreadSessions::end_after_turn`: an idle or capacity eviction lets a turn in flight finish,
//! as upstream's drop of the last `Arc` did, but not forever.

use std::sync::Arc;
use std::time::Duration;

use openab_runtime::compat::{PoolPath, ThreadSessions, TurnWait};
use openab_runtime::{CreateOptions, SessionRuntime, SessionState};
use session_runtime::testing::FakeRuntime;

const KEY: &str = "discord:1234";

async fn running_session() -> (ThreadSessions, Arc<FakeRuntime>) {
    let runtime = Arc::new(FakeRuntime::builder().build().expect("fake runtime"));
    let sessions = ThreadSessions::new(Arc::clone(&runtime) as Arc<dyn SessionRuntime>, "test", "agent");
    let transport = sessions.open(KEY, &CreateOptions::new()).await.expect("open");
    drop(transport);
    (sessions, runtime)
}

async fn state(runtime: &FakeRuntime, sessions: &ThreadSessions) -> SessionState {
    let id = sessions.session_id(KEY).expect("id");
    runtime.status(&id).await.expect("status").state
}

#[tokio::test]
async fn an_eviction_waits_for_the_turn_that_holds_the_connection() {
    let (sessions, runtime) = running_session().await;
    let connection = Arc::new(tokio::sync::Mutex::new(()));
    let turn = Arc::clone(&connection).lock_owned().await;

    let evicting = {
        let sessions = sessions.clone();
        let connection = Arc::clone(&connection);
        tokio::spawn(async move {
            sessions
                .end_after_turn(KEY, PoolPath::IdleEviction, &connection, Duration::from_secs(30))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        state(&runtime, &sessions).await,
        SessionState::Running,
        "not while the turn runs"
    );
    drop(turn);
    let outcome = evicting.await.expect("task").expect("evicted");
    assert_eq!(outcome, TurnWait::Finished);
    assert_eq!(state(&runtime, &sessions).await, SessionState::Suspended);
}

#[tokio::test]
async fn an_eviction_ends_a_turn_that_outlasts_the_wait() {
    let (sessions, runtime) = running_session().await;
    let connection = tokio::sync::Mutex::new(());
    let _turn = connection.lock().await;
    let outcome = sessions
        .end_after_turn(
            KEY,
            PoolPath::CapacityEviction,
            &connection,
            Duration::from_millis(100),
        )
        .await
        .expect("evicted");
    assert_eq!(outcome, TurnWait::WaitedOut);
    assert_eq!(state(&runtime, &sessions).await, SessionState::Suspended);
}
