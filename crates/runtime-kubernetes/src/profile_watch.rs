//! The broker's worker profile as one watch of it last saw it, so `create`, `attach` and `close`
//! read no profile from the API server.
//!
//! A profile an administrator changes takes effect with the first operation after the watch
//! delivers the change (milliseconds), as any controller acts on its informer's view: a worker
//! started a moment before runs the previous version, as it would have had it started a moment
//! earlier. The watch vouches for nothing until it has listed the profile, nor while it is
//! failing (from an error until its next event): then the profile is read. A profile the watch
//! says is missing is read too before anything is refused for it (it may have been created a
//! moment ago). `reconcile`, which decides what to remove, always reads.

use std::sync::Arc;

use kube::api::DynamicObject;
use kube::runtime::watcher::{self, Event};
use kube::{Api, ResourceExt};
use parking_lot::Mutex;
use tokio::task::AbortHandle;

/// The watch of one profile, started by the first read.
#[derive(Debug)]
pub(crate) struct ProfileWatch {
    profiles: Api<DynamicObject>,
    name: String,
    seen: Arc<Mutex<Seen>>,
    task: std::sync::OnceLock<AbortHandle>,
}

#[derive(Debug, Default)]
struct Seen {
    /// `None` until the first list is done; then the profile, or `None` while there is none.
    current: Option<Option<DynamicObject>>,
    /// While a list is in progress, what it has shown so far.
    listing: Option<Option<DynamicObject>>,
    /// The watch failed and has delivered nothing since: `current` may be stale.
    failing: bool,
}

impl Seen {
    fn apply(&mut self, name: &str, event: Event<DynamicObject>) {
        self.failing = false;
        match event {
            Event::Init => self.listing = Some(None),
            Event::InitApply(object) if object.name_any() == name => self.listing = Some(Some(object)),
            Event::InitDone => self.current = self.listing.take(),
            Event::Apply(object) if object.name_any() == name => {
                if self.current.is_some() {
                    self.current = Some(Some(object));
                }
            }
            Event::Delete(object) if object.name_any() == name => {
                if self.current.is_some() {
                    self.current = Some(None);
                }
            }
            Event::InitApply(_) | Event::Apply(_) | Event::Delete(_) => {}
        }
    }

    /// The profile, if the watch can vouch for it: `Some(None)` when it saw none. Not while it
    /// fails, nor while it lists again (what it saw before may be stale).
    fn vouched(&self) -> Option<Option<DynamicObject>> {
        if self.failing || self.listing.is_some() {
            return None;
        }
        self.current.clone()
    }
}

impl ProfileWatch {
    /// A watch of the profile `name` among `profiles`, not started yet.
    pub(crate) fn new(profiles: Api<DynamicObject>, name: &str) -> Self {
        Self {
            profiles,
            name: name.to_owned(),
            seen: Arc::default(),
            task: std::sync::OnceLock::new(),
        }
    }

    /// The profile as the watch last saw it (`Some(None)`: there was none), or `None` when the
    /// watch cannot vouch for it yet. Starts the watch.
    pub(crate) fn current(&self) -> Option<Option<DynamicObject>> {
        self.start();
        self.seen.lock().vouched()
    }

    fn start(&self) {
        self.task.get_or_init(|| {
            let seen = Arc::clone(&self.seen);
            let name = self.name.clone();
            let config = watcher::Config::default().fields(&format!("metadata.name={}", self.name));
            crate::api::spawn_watch(self.profiles.clone(), config, move |event| match event {
                Ok(event) => seen.lock().apply(&name, event),
                Err(error) => {
                    tracing::debug!(profile = %name, "watching the worker profile failed: {error}");
                    seen.lock().failing = true;
                }
            })
        });
    }
}

impl Drop for ProfileWatch {
    fn drop(&mut self) {
        if let Some(task) = self.task.get() {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(name: &str, version: &str) -> DynamicObject {
        let mut object = DynamicObject::new(name, &crate::profile::WorkerProfile::resource());
        object.metadata.resource_version = Some(version.to_owned());
        object
    }

    fn version(seen: &Seen) -> Option<Option<String>> {
        seen.vouched()
            .map(|object| object.and_then(|object| object.resource_version()))
    }

    #[test]
    fn vouches_only_after_a_list_and_not_while_failing() {
        let mut seen = Seen::default();
        assert_eq!(version(&seen), None, "nothing before the first list");
        seen.apply("coder", Event::Init);
        seen.apply("coder", Event::InitApply(profile("coder", "1")));
        assert_eq!(version(&seen), None, "nor while listing");
        seen.apply("coder", Event::InitDone);
        assert_eq!(version(&seen), Some(Some("1".to_owned())));

        seen.apply("coder", Event::Apply(profile("coder", "2")));
        seen.apply("coder", Event::Apply(profile("other", "3")));
        assert_eq!(
            version(&seen),
            Some(Some("2".to_owned())),
            "another profile changes nothing"
        );

        seen.failing = true;
        assert_eq!(version(&seen), None, "a failing watch vouches for nothing");
        seen.apply("coder", Event::Delete(profile("coder", "2")));
        assert_eq!(version(&seen), Some(None), "seen deleted, once it delivers again");
    }

    #[test]
    fn a_relist_replaces_what_was_seen() {
        let mut seen = Seen::default();
        for event in [
            Event::Init,
            Event::InitApply(profile("coder", "1")),
            Event::InitDone,
            Event::Init,
        ] {
            seen.apply("coder", event);
        }
        assert_eq!(version(&seen), None, "not while it lists again");
        seen.apply("coder", Event::InitDone);
        assert_eq!(version(&seen), Some(None), "a relist without it: gone");
    }
}
