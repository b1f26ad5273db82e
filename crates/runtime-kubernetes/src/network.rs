//! The profile's egress allowances, as a NetworkPolicy of its own.
//!
//! `deploy/kubernetes/networkpolicy.yaml` denies workers every private range; NetworkPolicies add
//! up, so a profile's `egress` CIDRs become one more policy, `oab-egress-<profile>`, that selects
//! the workers and seed Jobs of that profile (label [`names::PROFILE`]) and allows exactly those
//! CIDRs (a seed may clone from a mirror the workers also use). The
//! broker writes it with server-side apply before a worker of a new profile version starts; its
//! content comes only from the administrator's profile. An empty `egress` applies a policy with
//! no rule, which allows nothing: removing an allowance from the profile removes it from the
//! cluster at the next start.
//!
//! The egress gateway is not among them: every worker may reach its Pods on their port, by the
//! administrator's policy `oab-workers` (`deploy/kubernetes/networkpolicy.yaml`), and the
//! admission policy lets the broker write address blocks only, never a Pod selector.

use k8s_openapi::api::networking::v1::{
    IPBlock, NetworkPolicy, NetworkPolicyEgressRule, NetworkPolicyPeer, NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement, ObjectMeta};

use crate::names;
use crate::profile::WorkerProfile;

/// The field manager of the runtime's server-side applies.
pub(crate) const FIELD_MANAGER: &str = "openab-broker";

pub(crate) fn egress_policy(profile: &WorkerProfile, installation: &str) -> NetworkPolicy {
    let selector = [
        (names::MANAGED_BY.to_owned(), names::MANAGER.to_owned()),
        (
            names::INSTALLATION.to_owned(),
            names::installation_label(installation),
        ),
        (names::PROFILE.to_owned(), names::profile_label(profile.name())),
    ];
    let roles = LabelSelectorRequirement {
        key: names::ROLE.to_owned(),
        operator: "In".to_owned(),
        values: Some(vec![
            "worker".to_owned(),
            names::POOL_ROLE.to_owned(),
            "seed".to_owned(),
        ]),
    };
    let peers: Vec<NetworkPolicyPeer> = profile
        .egress
        .iter()
        .map(|cidr| NetworkPolicyPeer {
            ip_block: Some(IPBlock {
                cidr: cidr.clone(),
                except: None,
            }),
            ..NetworkPolicyPeer::default()
        })
        .collect();
    let mut rules = Vec::new();
    if !peers.is_empty() {
        rules.push(NetworkPolicyEgressRule {
            to: Some(peers),
            ports: None,
        });
    }
    NetworkPolicy {
        metadata: ObjectMeta {
            name: Some(names::egress_policy(installation, profile.name())),
            labels: Some(
                [
                    (names::MANAGED_BY.to_owned(), names::MANAGER.to_owned()),
                    (
                        names::INSTALLATION.to_owned(),
                        names::installation_label(installation),
                    ),
                ]
                .into(),
            ),
            annotations: Some([(names::PROFILE_VERSION.to_owned(), profile.version().to_owned())].into()),
            ..ObjectMeta::default()
        },
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some(selector.into()),
                match_expressions: Some(vec![roles]),
            }),
            policy_types: Some(vec!["Egress".to_owned()]),
            egress: Some(rules),
            ingress: None,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_selects_the_profiles_workers_and_allows_exactly_its_cidrs() {
        let document = "image = \"w\"\nagent = [\"/a\"]\negress = [\"203.0.113.0/24\", \"2001:db8::/32\"]\n";
        let profile = WorkerProfile::from_toml("coder", "7", document).expect("a profile");
        let policy = egress_policy(&profile, "prod");
        let spec = policy.spec.as_ref().expect("spec");
        let pod_selector = spec.pod_selector.as_ref().expect("a selector");
        let selector = pod_selector.match_labels.clone().expect("labels");
        assert_eq!(selector.get(names::PROFILE).map(String::as_str), Some("coder"));
        assert_eq!(
            selector.get(names::INSTALLATION).map(String::as_str),
            Some("prod")
        );
        let roles = pod_selector
            .match_expressions
            .iter()
            .flatten()
            .find(|requirement| requirement.key == names::ROLE)
            .expect("a role requirement");
        assert_eq!(
            (roles.operator.as_str(), roles.values.clone()),
            (
                "In",
                Some(vec!["worker".to_owned(), "pool".to_owned(), "seed".to_owned()])
            ),
            "a warm pool member is under its profile's egress before its claim too"
        );
        let cidrs: Vec<String> = spec
            .egress
            .iter()
            .flatten()
            .flat_map(|rule| rule.to.iter().flatten())
            .filter_map(|peer| Some(peer.ip_block.as_ref()?.cidr.clone()))
            .collect();
        assert_eq!(cidrs, ["203.0.113.0/24", "2001:db8::/32"]);
        let none =
            WorkerProfile::from_toml("coder", "8", "image = \"w\"\nagent = [\"/a\"]\n").expect("a profile");
        let empty = egress_policy(&none, "prod");
        assert_eq!(
            empty.spec.and_then(|s| s.egress),
            Some(Vec::new()),
            "no rule: nothing more allowed"
        );
        // The gateway is the administrator's policy's to allow (a Pod selector, which the
        // admission policy refuses from the broker): a profile naming one adds no rule.
        let gateway = WorkerProfile::from_toml(
            "coder",
            "9",
            "image = \"w\"\nagent = [\"/a\"]\negress_gateway = \"10.96.0.50:3128\"\n\
             egress_hosts = [\"github.com:443\"]\n",
        )
        .expect("a profile");
        assert_eq!(
            egress_policy(&gateway, "prod").spec.and_then(|s| s.egress),
            Some(Vec::new())
        );
    }
}
