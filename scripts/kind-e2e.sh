#!/usr/bin/env bash
# The cluster suite on kind, for machines that have Docker (a workstation, GitHub Actions): the
# same #[ignore = "needs a cluster: ..."] tests that ./scripts/test runs against scripts/cluster,
# with the broker's narrow kubeconfig. It cannot run on the project's own machines (no container
# engine there); .github/workflows/kind-e2e.yml runs it.
#
# usage: scripts/kind-e2e.sh            (needs docker, kind, kubectl, helm, cargo on PATH)
#   KIND_CLUSTER   cluster name (default openab-e2e); KEEP_CLUSTER=1 leaves it running
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=../e2e/cluster/versions.env
. "$repo/e2e/cluster/versions.env"
cluster=${KIND_CLUSTER:-openab-e2e}
# kind's node image for the pinned Kubernetes version (kind publishes one per patch release).
node_image=${KIND_NODE_IMAGE:-kindest/node:$KUBERNETES_VERSION}
work=$(mktemp -d)
admin="$work/admin.kubeconfig"
broker="$work/broker.kubeconfig"

for tool in docker kind kubectl helm cargo; do
  command -v "$tool" >/dev/null || { echo "kind-e2e: $tool is not on PATH" >&2; exit 1; }
done

finish() {
  local status=$?
  if [ $status -ne 0 ]; then
    echo "kind-e2e: failed; exporting logs to $repo/target/kind-logs" >&2
    kind export logs --name "$cluster" "$repo/target/kind-logs" >/dev/null 2>&1 || true
  fi
  [ "${KEEP_CLUSTER:-}" = 1 ] || kind delete cluster --name "$cluster" >/dev/null 2>&1 || true
  rm -rf "$work"
  exit $status
}
trap finish EXIT

kind create cluster --name "$cluster" --image "$node_image" --kubeconfig "$admin" --wait 180s
export KUBECONFIG=$admin
# The same worker image the local cluster imports, written from local files.
kind load image-archive "$("$repo/e2e/images/build" worker)" --name "$cluster"
# The controller image, from the oab-runtime the kubernetes_cli test runs (same features).
(cd "$repo" && cargo build --locked -p openab-runtime --all-features --bin oab-runtime)
kind load image-archive "$("$repo/e2e/images/build" controller "${CARGO_TARGET_DIR:-$repo/target}/debug/oab-runtime")" --name "$cluster"

# The chart, as an operator installs it, with the test cluster's values.
helm upgrade --install openab "$repo/deploy/helm/openab-session-runtime" --namespace default \
  --values "$repo/e2e/manifests/test-values.yaml"
# The tests' StorageClass, here on kind's own local-path provisioner (its directories are
# world-writable, so the worker uid can write them).
kubectl apply --server-side --field-manager openab-e2e -f - <<'YAML'
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: openab-test-local
provisioner: rancher.io/local-path
reclaimPolicy: Delete
volumeBindingMode: WaitForFirstConsumer
YAML
kubectl -n openab-sessions wait --for=jsonpath='{.metadata.name}'=default serviceaccount/default --timeout=60s

# The broker's kubeconfig: its ServiceAccount's token, the admin file's server and CA.
token=$(kubectl -n openab create token openab-broker --duration 2h)
kubectl config view --raw --minify --flatten > "$broker"
user=$(kubectl config view --raw --minify -o jsonpath='{.contexts[0].context.user}')
kubectl --kubeconfig "$broker" config unset "users.$user" >/dev/null
kubectl --kubeconfig "$broker" config set-credentials "$user" --token "$token" >/dev/null

export OPENAB_BROKER_KUBECONFIG=$broker
export OPENAB_SESSIONS_NAMESPACE=openab-sessions
export OPENAB_KUBERNETES_VERSION=$KUBERNETES_VERSION
export OPENAB_KWOK_NODES=0
# kind's: images are loaded above, and Pods reach the API server through the kubernetes Service.
export OPENAB_CLUSTER_KIND=1
# Not on kind: its nodes are real (no kwok), its volumes are directories inside its node
# containers (not on this host, where the storage test looks), its Pod network lets Pods out (the
# no-egress bridge is ours), and its NetworkPolicy engine is not the one whose rules the packet
# tests wait for on this host (kube-router, scripts/cluster).
cargo test --locked -p runtime-kubernetes --all-features --tests -- --ignored \
  --skip a_pod_scheduled_onto_a_kwok_node_becomes_ready \
  --skip a_claim_of_the_test_storage_class_binds_on_its_first_pods_node_and_its_volume_goes_with_it \
  --skip the_host_reaches_the_relay_on_the_pod_ip_and_the_pod_reaches_nothing_off_the_bridge \
  --skip a_worker_reaches_no_other_pod_node_api_server_or_metadata_and_only_the_broker_reaches_relays \
  --skip a_profiles_egress_opens_exactly_what_it_lists_and_closes_for_the_next_worker \
  --skip deleting_the_policies_opens_a_relay_to_a_stranger_and_applying_them_closes_it
cargo test --locked -p openab-runtime --all-features --test kubernetes_cli -- --ignored
