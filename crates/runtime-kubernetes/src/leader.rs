//! The installation's leader Lease: at most one controller acts at a time.
//!
//! A Lease `oab-leader-<installation>` in the sessions namespace names its holder. Every change is
//! a compare-and-swap on its `resourceVersion`, so two candidates never both take it. Whether the
//! holder's term ran out is judged the way client-go judges it, by this process's own clock: the
//! Lease counts as expired once it has not changed for its `leaseDurationSeconds` since this
//! candidate first saw it in that version, so clock skew between machines cannot hand it over
//! early. Each change of holder increments `leaseTransitions`, which is the term's epoch: a
//! broker that takes over relays with it is newer than every earlier holder.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::PostParams;
use kube::{Api, Client, ResourceExt};
use parking_lot::Mutex;
use session_runtime::Result;
use tokio::time::Instant;

use crate::api::{api_error, is_status};
use crate::names;

/// One holder's tenure of the leader Lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Term {
    /// The Lease's `leaseTransitions` when this holder took it: greater than every earlier
    /// holder's epoch.
    pub epoch: u64,
}

/// A candidate for an installation's leader Lease.
pub struct LeaderElection {
    leases: Api<Lease>,
    name: String,
    /// The installation's label form: the Lease carries it, so the admission policy can tell
    /// this installation's Lease from another's.
    installation: String,
    holder: String,
    duration: Duration,
    /// The Lease version last seen and when this process first saw it.
    observed: Mutex<Option<(String, Instant)>>,
}

impl std::fmt::Debug for LeaderElection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaderElection")
            .field("lease", &self.name)
            .field("holder", &self.holder)
            .field("duration", &self.duration)
            .finish_non_exhaustive()
    }
}

impl LeaderElection {
    /// How long a holder's term lasts without a renewal, unless set: 15 seconds, client-go's
    /// default.
    pub const DEFAULT_DURATION: Duration = Duration::from_secs(15);

    /// A candidate named `holder` (unique per process: a Pod name, a host and pid) for the
    /// leader Lease of `installation` in `namespace`.
    pub fn new(client: Client, namespace: &str, installation: &str, holder: impl Into<String>) -> Self {
        LeaderElection {
            leases: Api::namespaced(client, namespace),
            name: names::leader(installation),
            installation: names::installation_label(installation),
            holder: holder.into(),
            duration: Self::DEFAULT_DURATION,
            observed: Mutex::new(None),
        }
    }

    /// How long a term lasts without a renewal. A holder renews three times per duration.
    pub fn with_duration(mut self, duration: Duration) -> Self {
        self.duration = duration.max(Duration::from_secs(1));
        self
    }

    fn labels(&self) -> std::collections::BTreeMap<String, String> {
        [
            (names::MANAGED_BY.to_owned(), names::MANAGER.to_owned()),
            (names::INSTALLATION.to_owned(), self.installation.clone()),
        ]
        .into()
    }

    /// The name of the leader Lease.
    pub fn lease_name(&self) -> &str {
        &self.name
    }

    /// This candidate's name.
    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// How long a term lasts without a renewal.
    pub fn duration(&self) -> Duration {
        self.duration
    }

    /// One attempt to hold the Lease: renews it if this candidate holds it, takes it if it is
    /// free or its holder's term ran out, and otherwise leaves it.
    ///
    /// # Errors
    /// [`session_runtime::Error::Backend`] when the API server cannot be read or written; a lost
    /// compare-and-swap is not an error but `Ok(None)`.
    ///
    /// # Cancellation
    /// Safe: each write is one compare-and-swap that either happened or not.
    pub async fn try_acquire(&self) -> Result<Option<Term>> {
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        let Some(current) = self
            .leases
            .get_opt(&self.name)
            .await
            .map_err(|e| api_error("reading the leader Lease", e))?
        else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    labels: Some(self.labels()),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.holder.clone()),
                    lease_duration_seconds: Some(self.duration_seconds()),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: Some(0),
                    ..LeaseSpec::default()
                }),
            };
            return match self.leases.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(Some(Term { epoch: 0 })),
                Err(error) if is_status(&error, 409) => Ok(None),
                Err(error) => Err(api_error("creating the leader Lease", error)),
            };
        };
        let spec = current.spec.clone().unwrap_or_default();
        let transitions = spec
            .lease_transitions
            .and_then(|t| u64::try_from(t).ok())
            .unwrap_or(0);
        let ours = spec.holder_identity.as_deref() == Some(self.holder.as_str());
        let free = spec.holder_identity.as_deref().is_none_or(str::is_empty);
        let mut next = current.clone();
        // A Lease written before it carried the installation gets it with this write.
        next.metadata
            .labels
            .get_or_insert_with(Default::default)
            .extend(self.labels());
        let next_spec = next.spec.get_or_insert_with(LeaseSpec::default);
        let epoch = if ours {
            transitions
        } else if free || self.expired(&current) {
            next_spec.holder_identity = Some(self.holder.clone());
            next_spec.acquire_time = Some(now.clone());
            next_spec.lease_transitions = Some(i32::try_from(transitions + 1).unwrap_or(i32::MAX));
            transitions + 1
        } else {
            return Ok(None);
        };
        next_spec.renew_time = Some(now);
        next_spec.lease_duration_seconds = Some(self.duration_seconds());
        match self
            .leases
            .replace(&self.name, &PostParams::default(), &next)
            .await
        {
            Ok(written) => {
                self.observe(&written);
                Ok(Some(Term { epoch }))
            }
            Err(error) if is_status(&error, 409) || is_status(&error, 404) => Ok(None),
            Err(error) => Err(api_error("renewing the leader Lease", error)),
        }
    }

    /// Gives the Lease up if this candidate holds it, so the next one need not wait for the term
    /// to run out.
    ///
    /// # Errors
    /// [`session_runtime::Error::Backend`] when the API server cannot be read or written.
    pub async fn release(&self) -> Result<()> {
        let Some(current) = self
            .leases
            .get_opt(&self.name)
            .await
            .map_err(|e| api_error("reading the leader Lease", e))?
        else {
            return Ok(());
        };
        let spec = current.spec.clone().unwrap_or_default();
        if spec.holder_identity.as_deref() != Some(self.holder.as_str()) {
            return Ok(());
        }
        let mut next = current;
        if let Some(spec) = next.spec.as_mut() {
            spec.holder_identity = None;
            spec.renew_time = None;
        }
        match self
            .leases
            .replace(&self.name, &PostParams::default(), &next)
            .await
        {
            Ok(_) => Ok(()),
            Err(error) if is_status(&error, 409) || is_status(&error, 404) => Ok(()),
            Err(error) => Err(api_error("releasing the leader Lease", error)),
        }
    }

    fn duration_seconds(&self) -> i32 {
        i32::try_from(self.duration.as_secs()).unwrap_or(i32::MAX)
    }

    /// Whether the Lease has stayed in this version for a whole term, by this process's clock.
    fn expired(&self, lease: &Lease) -> bool {
        let version = lease.resource_version().unwrap_or_default();
        let term = lease
            .spec
            .as_ref()
            .and_then(|spec| spec.lease_duration_seconds)
            .and_then(|seconds| u64::try_from(seconds).ok())
            .map_or(self.duration, Duration::from_secs);
        let mut observed = self.observed.lock();
        match observed.as_ref() {
            Some((seen, since)) if *seen == version => since.elapsed() >= term,
            _ => {
                *observed = Some((version, Instant::now()));
                false
            }
        }
    }

    fn observe(&self, lease: &Lease) {
        *self.observed.lock() = Some((lease.resource_version().unwrap_or_default(), Instant::now()));
    }
}
