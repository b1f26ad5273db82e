//! The admission policy of the deploy files (`deploy/kubernetes/admission.yaml`), each rule tried
//! by the write it forbids, made with the broker's own token, next to a write of the same kind
//! that the runtime makes and the policy lets through (the positive control). Writes that would
//! create are dry runs (`dryRun=All` runs the whole admission chain and stores nothing); deletes
//! aim at objects the administrator made, and are dry runs too.
//!
//! Every forbidden write here is one the broker's Role allows: before the policy, each succeeded.
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --test admission -- --ignored`.

mod common;

use std::collections::BTreeMap;

use runtime_kubernetes::{OabSession, OabSessionSpec};
use serde_json::json;
use test_cluster::k8s_openapi::api::batch::v1::Job;
use test_cluster::k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, ServiceAccount};
use test_cluster::k8s_openapi::api::networking::v1::NetworkPolicy;
use test_cluster::kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use test_cluster::kube::{Api, Resource};
use test_cluster::{unique_name, unique_session_id, TestCluster};

/// The labels the runtime puts on a session's objects.
fn labels(installation: &str, session: &str, role: &str) -> BTreeMap<String, String> {
    [
        ("app.kubernetes.io/managed-by", "openab"),
        ("openab.dev/installation", installation),
        ("openab.dev/session", session),
        ("openab.dev/role", role),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

/// A worker Pod as the runtime makes it (the parts admission looks at), as JSON to vary.
fn worker_pod(session: &str) -> serde_json::Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": format!("oab-w-{session}"),
            "labels": labels("admission", session, "worker"),
        },
        "spec": {
            "serviceAccountName": format!("oab-i-{session}-1"),
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
            "restartPolicy": "Never",
            "securityContext": {
                "runAsNonRoot": true, "runAsUser": 65532, "runAsGroup": 65532,
                "seccompProfile": {"type": "RuntimeDefault"}
            },
            "containers": [{
                "name": "worker",
                "image": "openab.dev/worker:test",
                "imagePullPolicy": "Never",
                "securityContext": {
                    "allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true,
                    "capabilities": {"drop": ["ALL"]}
                }
            }],
            "volumes": [
                {"name": "session", "persistentVolumeClaim": {"claimName": format!("oab-d-{session}-1")}},
                {"name": "tmp", "emptyDir": {}}
            ]
        }
    })
}

fn dry_run() -> PostParams {
    PostParams {
        dry_run: true,
        ..PostParams::default()
    }
}

/// Asserts `result` is the admission policy `policy` refusing, in its own words.
fn refused_by<T: std::fmt::Debug>(policy: &str, what: &str, result: Result<T, test_cluster::kube::Error>) {
    match result {
        Err(test_cluster::kube::Error::Api(status)) => {
            assert!(
                status.code == 403 || status.code == 422,
                "{what}: refused with {}: {}",
                status.code,
                status.message
            );
            assert!(
                status.message.contains(policy),
                "{what}: refused, but not by {policy}: {}",
                status.message
            );
        }
        other => panic!("{what}: the broker's write must be refused by {policy}, got {other:?}"),
    }
}

/// A claim the administrator made (no labels: not the runtime's), and the admin's claims API.
async fn administrators_claim(cluster: &TestCluster) -> (Api<PersistentVolumeClaim>, String) {
    let name = unique_name("oab-d-admin");
    let admin_claims: Api<PersistentVolumeClaim> =
        Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let claim: PersistentVolumeClaim = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "openab-test-local",
            "resources": {"requests": {"storage": "1Gi"}}
        }
    }))
    .expect("a claim");
    admin_claims
        .create(&PostParams::default(), &claim)
        .await
        .expect("the administrator's claim");
    (admin_claims, name)
}

/// Creates `pod` as a dry run with the broker's client.
async fn create_pod(pods: &Api<Pod>, pod: serde_json::Value) -> Result<Pod, test_cluster::kube::Error> {
    let pod: Pod = serde_json::from_value(pod).expect("a Pod");
    pods.create(&dry_run(), &pod).await
}

#[tokio::test]
#[ignore = "needs a cluster: scripts/cluster up (OPENAB_CLUSTER_NODE=0 is enough), then cargo test -- --ignored"]
async fn the_broker_writes_only_what_the_admission_policy_allows() {
    let cluster = TestCluster::connect().await;
    let namespace = cluster.sessions_namespace();
    let session = unique_session_id();
    let session = session.as_str();
    // The ServiceAccount admission plugin refuses a Pod (even a dry run) whose account is
    // missing: the session's account, as the runtime would have made it at create.
    let admin_accounts: Api<ServiceAccount> = Api::namespaced(cluster.admin(), namespace);
    let own_account: ServiceAccount = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": format!("oab-i-{session}-1"), "labels": labels("admission", session, "identity")},
        "automountServiceAccountToken": false
    }))
    .expect("a ServiceAccount");
    admin_accounts
        .create(&PostParams::default(), &own_account)
        .await
        .expect("the session's account");
    let outcome = tokio::spawn(broker_writes(cluster, session.to_owned())).await;
    let _ = admin_accounts
        .delete(&format!("oab-i-{session}-1"), &DeleteParams::default())
        .await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic.into_panic());
    }
}

/// Each write the broker's Role allows and the admission policy forbids, next to its positive
/// control.
async fn broker_writes(cluster: TestCluster, session: String) {
    let session = session.as_str();
    let namespace = cluster.sessions_namespace();
    let pods: Api<Pod> = Api::namespaced(cluster.broker(), namespace);

    // The positive control: a worker as the runtime makes it passes.
    create_pod(&pods, worker_pod(session))
        .await
        .expect("a worker Pod as the runtime makes it is admitted");

    let mut other_image = worker_pod(session);
    other_image["spec"]["containers"][0]["image"] = json!("registry.example/anything:latest");
    refused_by(
        "openab-workloads",
        "another image",
        create_pod(&pods, other_image).await,
    );

    let mut secret_volume = worker_pod(session);
    secret_volume["spec"]["volumes"]
        .as_array_mut()
        .expect("volumes")
        .push(json!({"name": "loot", "secret": {"secretName": "broker-credentials"}}));
    refused_by(
        "openab-workloads",
        "an unlisted Secret",
        create_pod(&pods, secret_volume).await,
    );

    let mut secret_env = worker_pod(session);
    secret_env["spec"]["containers"][0]["env"] = json!([{
        "name": "LOOT",
        "valueFrom": {"secretKeyRef": {"name": "broker-credentials", "key": "token"}}
    }]);
    refused_by(
        "openab-workloads",
        "an unlisted Secret's key",
        create_pod(&pods, secret_env).await,
    );

    let mut other_claim = worker_pod(session);
    other_claim["spec"]["volumes"][0] = json!({
        "name": "session",
        "persistentVolumeClaim": {"claimName": "oab-d-bbbbbbbbbbbbbbbbbbbb-1"}
    });
    refused_by(
        "openab-workloads",
        "another session's claim, writable",
        create_pod(&pods, other_claim).await,
    );

    let mut shared_account = worker_pod(session);
    shared_account["spec"]["serviceAccountName"] = json!("default");
    refused_by(
        "openab-workloads",
        "an account other than the session's",
        create_pod(&pods, shared_account).await,
    );

    let mut token = worker_pod(session);
    token["spec"]["automountServiceAccountToken"] = json!(true);
    refused_by(
        "openab-workloads",
        "a mounted token",
        create_pod(&pods, token).await,
    );

    let mut foreign = worker_pod(session);
    foreign["metadata"]["labels"]
        .as_object_mut()
        .expect("labels")
        .remove("app.kubernetes.io/managed-by");
    refused_by(
        "openab-installation-objects",
        "a Pod that is not the runtime's",
        create_pod(&pods, foreign).await,
    );

    let mut misnamed = worker_pod(session);
    misnamed["metadata"]["name"] = json!("kube-proxy-imposter");
    refused_by(
        "openab-installation-objects",
        "a name the runtime never gives",
        create_pod(&pods, misnamed).await,
    );

    // A Job: the seed's shape with another image.
    let jobs: Api<Job> = Api::namespaced(cluster.broker(), namespace);
    let mut template = worker_pod(session);
    template["spec"]["containers"][0]["image"] = json!("registry.example/anything:latest");
    let job: Job = serde_json::from_value(json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": format!("oab-p-{session}-1"), "labels": labels("admission", session, "seed")},
        "spec": {"template": {"metadata": {"labels": labels("admission", session, "seed")}, "spec": template["spec"]}}
    }))
    .expect("a Job");
    refused_by(
        "openab-workloads",
        "a seed Job with another image",
        jobs.create(&dry_run(), &job).await,
    );

    // NetworkPolicies: never the namespace's own, never ingress, never a selector peer.
    let policies: Api<NetworkPolicy> = Api::namespaced(cluster.broker(), namespace);
    let widen = json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "oab-workers"},
        "spec": {"egress": [{"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]}]}
    });
    // Both the name rule and the egress-only rule refuse it; either may report first.
    refused_by(
        "ValidatingAdmissionPolicy 'openab-",
        "widening the namespace's worker policy",
        policies
            .patch(
                "oab-workers",
                &PatchParams::apply("openab-broker").force().dry_run(),
                &Patch::Apply(&widen),
            )
            .await,
    );
    let allowance = |spec: serde_json::Value| -> NetworkPolicy {
        serde_json::from_value(json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {
                "name": "oab-egress-admission",
                "labels": {"app.kubernetes.io/managed-by": "openab", "openab.dev/installation": "admission"}
            },
            "spec": spec
        }))
        .expect("a NetworkPolicy")
    };
    let selector = json!({"matchLabels": {
        "app.kubernetes.io/managed-by": "openab", "openab.dev/installation": "admission",
        "openab.dev/profile": "p"
    }});
    policies
        .create(
            &dry_run(),
            &allowance(json!({
                "podSelector": selector, "policyTypes": ["Egress"],
                "egress": [{"to": [{"ipBlock": {"cidr": "203.0.113.0/24"}}]}]
            })),
        )
        .await
        .expect("a profile's egress allowance is admitted");
    refused_by(
        "openab-egress-policies",
        "an ingress rule",
        policies
            .create(
                &dry_run(),
                &allowance(json!({
                    "podSelector": selector, "policyTypes": ["Ingress", "Egress"],
                    "ingress": [{}]
                })),
            )
            .await,
    );
    refused_by(
        "openab-egress-policies",
        "egress to every namespace's Pods",
        policies
            .create(
                &dry_run(),
                &allowance(json!({
                    "podSelector": selector, "policyTypes": ["Egress"],
                    "egress": [{"to": [{"namespaceSelector": {}}]}]
                })),
            )
            .await,
    );
    refused_by(
        "openab-egress-policies",
        "another installation's Pods",
        policies
            .create(
                &dry_run(),
                &allowance(json!({
                    "podSelector": {"matchLabels": {
                        "app.kubernetes.io/managed-by": "openab", "openab.dev/installation": "other",
                        "openab.dev/profile": "p"
                    }},
                    "policyTypes": ["Egress"]
                })),
            )
            .await,
    );

    // A session's ServiceAccount holds nothing.
    let accounts: Api<ServiceAccount> = Api::namespaced(cluster.broker(), namespace);
    let account = |automount: bool| -> ServiceAccount {
        serde_json::from_value(json!({
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": format!("oab-i-{session}-2"), "labels": labels("admission", session, "identity")},
            "automountServiceAccountToken": automount
        }))
        .expect("a ServiceAccount")
    };
    accounts
        .create(&dry_run(), &account(false))
        .await
        .expect("a session's account as the runtime makes it is admitted");
    refused_by(
        "openab-session-identities",
        "an account that mounts its token",
        accounts.create(&dry_run(), &account(true)).await,
    );
}

/// Objects an administrator made (a borrowed claim, an OabSession outside any installation) are
/// neither deleted nor adopted by the broker.
#[tokio::test]
#[ignore = "needs a cluster: scripts/cluster up (OPENAB_CLUSTER_NODE=0 is enough), then cargo test -- --ignored"]
async fn the_broker_never_deletes_or_adopts_an_administrators_objects() {
    let cluster = TestCluster::connect().await;
    let namespace = cluster.sessions_namespace();
    let (admin_claims, name) = administrators_claim(&cluster).await;
    let session_name = unique_name("oab-s-admin");
    let admin_sessions: Api<OabSession> = Api::namespaced(cluster.admin(), namespace);
    admin_sessions
        .create(&PostParams::default(), &session(&session_name))
        .await
        .expect("the administrator's OabSession");

    let dry_delete = DeleteParams {
        dry_run: true,
        ..DeleteParams::default()
    };
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(cluster.broker(), namespace);
    let deleted = claims.delete(&name, &dry_delete).await;
    let sessions: Api<OabSession> = Api::namespaced(cluster.broker(), namespace);
    let deleted_session = sessions.delete(&session_name, &dry_delete).await;
    let mut adopted = sessions
        .get(&session_name)
        .await
        .expect("the broker reads OabSessions");
    adopted.metadata.labels = Some(labels("admission", "aaaaaaaaaaaaaaaaaaaa", "anchor"));
    let adoption = sessions.replace(&session_name, &dry_run(), &adopted).await;
    let created = sessions
        .create(&dry_run(), &session(&unique_name("oab-s-unlabelled")))
        .await;

    let _ = admin_claims.delete(&name, &DeleteParams::default()).await;
    let _ = admin_sessions
        .delete(&session_name, &DeleteParams::default())
        .await;
    refused_by(
        "openab-installation-objects",
        "deleting an administrator's claim",
        deleted,
    );
    refused_by(
        "openab-installation-objects",
        "deleting an administrator's OabSession",
        deleted_session,
    );
    refused_by(
        "openab-installation-objects",
        "relabelling an administrator's OabSession as the installation's",
        adoption,
    );
    refused_by(
        "openab-installation-objects",
        "an OabSession without the installation",
        created,
    );
    // Its own labelled OabSession, by contrast, it may write (the positive control).
    let mut anchor = session(&unique_name("oab-s-own"));
    anchor.meta_mut().labels = Some(labels("admission", "aaaaaaaaaaaaaaaaaaaa", "anchor"));
    sessions
        .create(&dry_run(), &anchor)
        .await
        .expect("an OabSession of the installation is admitted");
}

/// An OabSession named `name` with no labels (no installation's).
fn session(name: &str) -> OabSession {
    OabSession::new(
        name,
        OabSessionSpec {
            installation: "admission".to_owned(),
            identity_digest: "ab".repeat(32),
        },
    )
}

/// Whether `address` lies in the IPv4 block `cidr`.
fn in_block(address: std::net::Ipv4Addr, cidr: &str) -> bool {
    let Some((network, bits)) = cidr.split_once('/') else {
        return false;
    };
    let (Ok(network), Ok(bits)) = (network.parse::<std::net::Ipv4Addr>(), bits.parse::<u32>()) else {
        return false;
    };
    let mask = u32::MAX.checked_shl(32 - bits).unwrap_or(0);
    u32::from(address) & mask == u32::from(network) & mask
}

/// Until the test cluster runs a NetworkPolicy engine, the policies are asserted as objects: the
/// namespace denies by default, and a seed Job's Pod (labelled as the runtime labels it) may reach
/// neither the API server nor the metadata address, nor accept any connection.
#[tokio::test]
#[ignore = "needs a cluster: scripts/cluster up (OPENAB_CLUSTER_NODE=0 is enough), then cargo test -- --ignored"]
async fn the_sessions_namespace_denies_by_default_and_seeds_reach_only_dns_and_public_addresses() {
    let cluster = TestCluster::connect().await;
    let policies: Api<NetworkPolicy> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let deny = policies
        .get("oab-default-deny")
        .await
        .expect("the default deny")
        .spec
        .expect("a spec");
    assert_eq!(
        deny.pod_selector.clone().unwrap_or_default(),
        Default::default(),
        "every Pod of the namespace"
    );
    assert_eq!(deny.policy_types, Some(vec!["Ingress".into(), "Egress".into()]));
    assert!(deny.ingress.is_none() && deny.egress.is_none(), "{deny:?}");

    let seeds = policies
        .get("oab-seeds")
        .await
        .expect("the seeds' policy")
        .spec
        .expect("a spec");
    let seed_labels = labels("admission", "aaaaaaaaaaaaaaaaaaaa", "seed");
    let selected = seeds
        .pod_selector
        .as_ref()
        .and_then(|s| s.match_labels.as_ref())
        .is_some_and(|wanted| wanted.iter().all(|(k, v)| seed_labels.get(k) == Some(v)));
    assert!(selected, "a seed Job's Pod is selected: {:?}", seeds.pod_selector);
    assert!(
        seeds.ingress.unwrap_or_default().is_empty(),
        "nothing reaches a seed"
    );
    let api_server: std::net::Ipv4Addr = cluster
        .admin_config()
        .cluster_url
        .host()
        .and_then(|host| host.parse().ok())
        .unwrap_or(std::net::Ipv4Addr::LOCALHOST);
    let metadata = std::net::Ipv4Addr::new(169, 254, 169, 254);
    for rule in seeds.egress.iter().flatten() {
        for peer in rule.to.iter().flatten() {
            let Some(block) = &peer.ip_block else {
                let dns = peer
                    .pod_selector
                    .as_ref()
                    .and_then(|s| s.match_labels.as_ref())
                    .and_then(|l| l.get("k8s-app"))
                    .map(String::as_str);
                assert_eq!(
                    dns,
                    Some("kube-dns"),
                    "a selector peer is only the cluster DNS: {peer:?}"
                );
                continue;
            };
            if block.cidr.contains(':') {
                continue;
            }
            let except = block.except.clone().unwrap_or_default();
            for address in [api_server, metadata] {
                assert!(
                    !in_block(address, &block.cidr) || except.iter().any(|e| in_block(address, e)),
                    "{address} is reachable through {block:?}"
                );
            }
        }
    }
}

/// The controller's own identity creates no worker and never execs (its Role), and is held to
/// the admission policy like the broker.
#[tokio::test]
#[ignore = "needs a cluster: scripts/cluster up (OPENAB_CLUSTER_NODE=0 is enough), then cargo test -- --ignored"]
async fn the_controller_creates_no_worker_never_execs_and_is_bounded_like_the_broker() {
    let cluster = TestCluster::connect().await;
    let namespace = cluster.sessions_namespace();
    let controller = cluster.controller().await;
    let pods: Api<Pod> = Api::namespaced(controller.clone(), namespace);
    let session = unique_session_id();
    match create_pod(&pods, worker_pod(&session)).await {
        Err(test_cluster::kube::Error::Api(status)) => assert!(
            status.code == 403 && status.message.contains("cannot create resource"),
            "RBAC refuses it: {}",
            status.message
        ),
        other => panic!("the controller must not create a worker: {other:?}"),
    }
    let exec = pods
        .exec(
            &format!("oab-w-{session}"),
            ["/usr/local/bin/oab-relay", "connect"],
            &test_cluster::kube::api::AttachParams::default()
                .stdout(true)
                .stderr(false),
        )
        .await;
    match exec {
        Err(error) => assert!(
            error.to_string().contains("403"),
            "RBAC refuses the exec: {error}"
        ),
        Ok(_) => panic!("the controller must never exec"),
    }
    // What its Role allows it, the policy still bounds: an administrator's claim stays.
    let (admin_claims, name) = administrators_claim(&cluster).await;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(controller, namespace);
    let deleted = claims
        .delete(
            &name,
            &DeleteParams {
                dry_run: true,
                ..DeleteParams::default()
            },
        )
        .await;
    let _ = admin_claims.delete(&name, &DeleteParams::default()).await;
    refused_by(
        "openab-installation-objects",
        "the controller deleting an administrator's claim",
        deleted,
    );
}

/// With the exec overlay (`deploy/kubernetes-exec`), the broker's exec reaches a worker only as
/// the relay's bridge: the runtime's own attach over exec works (the positive control), a shell
/// in the same Pod is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn the_brokers_exec_runs_only_the_relay_bridge() {
    use session_runtime::config::Reach;
    use session_runtime::testing::AcpClient;
    use session_runtime::{CloseReason, CreateOptions, SessionIdentity, SessionRuntime};

    let cluster = TestCluster::connect().await;
    let installation = unique_name("exec-bounded");
    let profile = common::AdminObject::profile(&cluster, &installation, common::WORKER_PROFILE).await;
    let runtime = common::runtime(&cluster, &profile, Reach::Exec, &installation);
    let identity = SessionIdentity::new(&installation, "agent", "test", "exec").expect("identity");
    let id = identity.id();
    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    let client = AcpClient::new(runtime.attach(&id).await.expect("attach over the relay bridge"));
    client.initialize().await.expect("the agent answers over exec");

    let pods: Api<Pod> = Api::namespaced(cluster.broker(), cluster.sessions_namespace());
    let shell = pods
        .exec(
            &format!("oab-w-{id}"),
            ["/bin/sh", "-c", "id"],
            &test_cluster::kube::api::AttachParams::default()
                .container("worker")
                .stdout(true)
                .stderr(false),
        )
        .await;
    drop(client);
    runtime.close(&id, CloseReason::Reset).await.expect("close");
    match shell {
        Err(error) => assert!(
            error.to_string().contains("403"),
            "the policy refuses a shell: {error}"
        ),
        Ok(_) => panic!("the broker must not get a shell in a worker"),
    }
}
