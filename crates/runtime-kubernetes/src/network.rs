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
//! A profile that names an `egress_gateway` also allows its workers the gateway's Pods (label
//! [`GATEWAY_NAME`] in the sessions namespace) on the gateway's port, which its Pods must listen
//! on as its Service does: NetworkPolicy judges the Pod a Service address leads to.

use k8s_openapi::api::networking::v1::{
    IPBlock, NetworkPolicy, NetworkPolicyEgressRule, NetworkPolicyPeer, NetworkPolicyPort, NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::names;
use crate::profile::WorkerProfile;

/// The `app.kubernetes.io/name` label of the egress gateway's Pods (`deploy/kubernetes/`).
pub(crate) const GATEWAY_NAME: &str = "openab-egress-gateway";

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
        values: Some(vec!["worker".to_owned(), "seed".to_owned()]),
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
    if let Some(gateway) = &profile.egress_gateway {
        rules.push(NetworkPolicyEgressRule {
            to: Some(vec![NetworkPolicyPeer {
                pod_selector: Some(LabelSelector {
                    match_labels: Some(
                        [("app.kubernetes.io/name".to_owned(), GATEWAY_NAME.to_owned())].into(),
                    ),
                    match_expressions: None,
                }),
                ..NetworkPolicyPeer::default()
            }]),
            ports: Some(vec![NetworkPolicyPort {
                protocol: Some("TCP".to_owned()),
                port: Some(IntOrString::Int(i32::from(gateway.port()))),
                end_port: None,
            }]),
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
            ("In", Some(vec!["worker".to_owned(), "seed".to_owned()]))
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
    }

    #[test]
    fn a_profile_with_a_gateway_allows_the_gateways_pods_on_its_port_only() {
        let document = "image = \"w\"\nagent = [\"/a\"]\negress_gateway = \"10.96.0.50:3128\"\n\
                        egress_hosts = [\"github.com:443\"]\n";
        let profile = WorkerProfile::from_toml("coder", "9", document).expect("a profile");
        let rules = egress_policy(&profile, "prod")
            .spec
            .and_then(|spec| spec.egress)
            .expect("rules");
        assert_eq!(rules.len(), 1, "{rules:?}");
        let peers = rules[0].to.clone().expect("peers");
        let labels = peers[0]
            .pod_selector
            .as_ref()
            .and_then(|selector| selector.match_labels.clone())
            .expect("a Pod selector");
        assert_eq!(
            labels.get("app.kubernetes.io/name").map(String::as_str),
            Some(GATEWAY_NAME)
        );
        assert!(peers[0].namespace_selector.is_none() && peers[0].ip_block.is_none());
        let ports = rules[0].ports.clone().expect("ports");
        assert_eq!(ports.len(), 1);
        assert_eq!(ports[0].port, Some(IntOrString::Int(3128)));
        assert_eq!(ports[0].protocol.as_deref(), Some("TCP"));
    }
}
