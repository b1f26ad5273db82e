//! The anchor of each session as this process last read or wrote it, so an operation can start
//! from it instead of reading it again.
//!
//! A remembered anchor may be stale (another broker, the controller or an operator changed it
//! since), so it may only lead to a compare-and-swap, which then fails on the stale
//! `resourceVersion` and sends the caller to a fresh read. A refusal, or a decision that nothing
//! is to be written, is never made on a remembered anchor (see
//! [`KubernetesRuntime::update_from`](crate::KubernetesRuntime)).

use std::collections::HashMap;

use parking_lot::Mutex;
use session_runtime::SessionId;

use crate::anchor::OabSession;

/// How many sessions' anchors are remembered at most; past it the memory starts again empty (a
/// broker serves far fewer live sessions, and forgetting costs one read each).
const CAPACITY: usize = 4096;

#[derive(Default)]
pub(crate) struct AnchorMemory {
    anchors: Mutex<HashMap<SessionId, OabSession>>,
}

impl AnchorMemory {
    /// Remembers `anchor` as session `id`'s latest.
    pub(crate) fn remember(&self, id: &SessionId, anchor: &OabSession) {
        let mut anchors = self.anchors.lock();
        if anchors.len() >= CAPACITY && !anchors.contains_key(id) {
            anchors.clear();
        }
        anchors.insert(*id, anchor.clone());
    }

    /// Session `id`'s anchor as last seen here, if remembered.
    pub(crate) fn recall(&self, id: &SessionId) -> Option<OabSession> {
        self.anchors.lock().get(id).cloned()
    }

    /// Forgets session `id`'s anchor: it was found stale, gone, or its session closed.
    pub(crate) fn forget(&self, id: &SessionId) {
        self.anchors.lock().remove(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use session_runtime::SessionIdentity;

    fn session(thread: &str) -> (SessionId, OabSession) {
        let id = SessionIdentity::new("prod", "agent", "discord", thread)
            .expect("identity")
            .id();
        (id, OabSession::for_session("prod", &id, "digest"))
    }

    #[test]
    fn remembers_until_forgotten_and_starts_again_when_full() {
        let memory = AnchorMemory::default();
        let (id, anchor) = session("1");
        assert!(memory.recall(&id).is_none());
        memory.remember(&id, &anchor);
        assert_eq!(memory.recall(&id).map(|a| a.spec), Some(anchor.spec.clone()));
        memory.forget(&id);
        assert!(memory.recall(&id).is_none());

        memory.remember(&id, &anchor);
        for n in 0..CAPACITY {
            let (other, anchor) = session(&format!("other {n}"));
            memory.remember(&other, &anchor);
        }
        assert!(memory.anchors.lock().len() <= CAPACITY);
        assert!(memory.recall(&id).is_none(), "the memory started again once full");
    }
}
