# The test cluster's one real node: containerd 2.x and gVisor built from their Go modules (see
# e2e/build-testbin), runc from Debian, the kubelet and kube-proxy built with the control plane,
# kube-router enforcing NetworkPolicy, a CNI bridge whose Pods reach nothing off the machine.
# Sourced by scripts/cluster, whose helpers (start, stop, wait_for, fail, kubeconfig, kubectl,
# say, die) and variables it uses.
# shellcheck shell=bash

node_name=$(hostname)
node_dir="$state/node"
containerd_socket="$node_dir/containerd/containerd.sock"
kubelet_root="$node_dir/kubelet"
cni_network=openab-test
bridge=oab-br0
pod_subnet=10.244.0.0/24
# The bridge's own address: the Pods' gateway, the node's InternalIP, and where the API server
# listens, so that the `kubernetes` Service (through kube-proxy) reaches it from a Pod.
pod_gateway=10.244.0.1
rule_comment=openab-test-cluster
# The sysctls the kubelet rewrites at start, and the two the Pod network sets; `up` records them
# and `down` puts them back.
node_sysctls="vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops kernel.keys.root_maxkeys kernel.keys.root_maxbytes net.ipv4.ip_forward net.bridge.bridge-nf-call-iptables net.ipv4.icmp_ratelimit"

containerd_dir="$testbin/containerd-$CONTAINERD_VERSION"
gvisor_dir="$testbin/gvisor-$GVISOR_VERSION"
# gVisor's runtime handler, and the RuntimeClass that names it (unless OPENAB_CLUSTER_GVISOR=0).
gvisor_handler=runsc
with_gvisor=${OPENAB_CLUSTER_GVISOR:-1}
ctr_() { "$containerd_dir/ctr" --address "$containerd_socket" -n k8s.io "$@"; }

node_packages() {
  local missing=() tool
  for tool in runc:runc iptables:iptables ipset:ipset; do
    command -v "${tool%%:*}" >/dev/null || missing+=("${tool#*:}")
  done
  [ -x /usr/lib/cni/bridge ] || missing+=(containernetworking-plugins)
  [ -x /bin/busybox ] || missing+=(busybox-static)
  command -v git >/dev/null || missing+=(git)
  command -v cc >/dev/null || missing+=(gcc libc6-dev)
  [ ${#missing[@]} -eq 0 ] && return 0
  say "installing ${missing[*]} (the real node)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null ||
    die "could not install ${missing[*]}"
}

# Nothing a Pod sends leaves this machine, nothing from elsewhere reaches a Pod, and of this
# host Pods reach only the API server's port (which NetworkPolicy then narrows to the Pods allowed
# it); the host's own connections into Pods (and their replies) pass. The rules live in the
# mangle table, which the kernel walks around the filter table where kube-proxy and kube-router
# ACCEPT what Services and policies allow: what a Pod sends off the bridge is dropped in
# POSTROUTING, after the policy engine has judged it (so a test sees the engine's REJECT), and a
# policy that allows a public address still lets nothing leave. IPv6 (the bridge has link-local
# addresses, Pods get none routable, the engine runs for IPv4 only) is dropped on the way in.
firewalls="iptables ip6tables"

# TOOL: the rules, inserted in reverse (each goes first), so they apply in this order.
node_network_rules() {
  if [ "$1" = iptables ]; then
    # (The host's own address is in the Pod subnet too: its traffic is not a Pod's.)
    printf '%s\n' "POSTROUTING -s $pod_subnet ! -o $bridge -m addrtype ! --src-type LOCAL -j DROP"
  else
    printf '%s\n' "FORWARD -i $bridge ! -o $bridge -j DROP"
  fi
  printf '%s\n' "FORWARD -o $bridge ! -i $bridge -j DROP" "INPUT -i $bridge -j DROP"
  if [ "$1" = iptables ]; then
    printf '%s\n' "INPUT -i $bridge -d $pod_gateway -p tcp --dport $apiserver_port -j ACCEPT"
    # The bridge's address (the API server's) answers only this host and its Pods, whatever
    # another machine routes to it.
    printf '%s\n' "INPUT ! -i $bridge -d $pod_gateway -m addrtype ! --src-type LOCAL -j DROP"
  fi
  printf '%s\n' "INPUT -i $bridge -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT"
}

node_network_up() {
  local rule tool
  for tool in $firewalls; do
    while read -r rule; do
      # shellcheck disable=SC2086
      "$tool" -t mangle -C $rule -m comment --comment "$rule_comment" 2>/dev/null ||
        "$tool" -t mangle -I $rule -m comment --comment "$rule_comment" || die "could not add $tool rule: $rule"
    done <<<"$(node_network_rules "$tool")"
  done
}

# TOOL: our rules, as `-A ...` lines.
node_rules() { "$1" -t mangle -S 2>/dev/null | grep -F -- "--comment $rule_comment" || true; }

node_network_check() {
  local rules tool wanted
  for tool in $firewalls; do
    rules=$(node_rules "$tool")
    for wanted in "-A FORWARD ! -i $bridge -o $bridge" "-A INPUT -i $bridge -m comment"; do
      grep -qF -- "$wanted" <<<"$rules" || die "the Pod network's $tool drop rule is missing ($wanted): no Pod may start"
    done
  done
  grep -qF -- "-A POSTROUTING -s $pod_subnet ! -o $bridge" <<<"$(node_rules iptables)" ||
    die "the Pod network's iptables drop rule of what leaves is missing: no Pod may start"
  grep -qF -- "-A FORWARD -i $bridge ! -o $bridge" <<<"$(node_rules ip6tables)" ||
    die "the Pod network's ip6tables drop rule of what leaves is missing: no Pod may start"
}

# The bridge and its rules exist before the API server, which listens on its address. (The CNI
# plugin finds the bridge and keeps it.) Bridged traffic between Pods must pass iptables for
# NetworkPolicy to apply.
node_bridge_up() {
  node_packages
  if ! ip link show "$bridge" >/dev/null 2>&1; then
    ip link add "$bridge" type bridge || die "could not create bridge $bridge"
  fi
  ip -4 addr show dev "$bridge" | grep -qF "inet $pod_gateway/" ||
    ip addr add "$pod_gateway/${pod_subnet#*/}" dev "$bridge" || die "could not address bridge $bridge"
  ip link set "$bridge" up || die "could not bring bridge $bridge up"
  local name
  if [ ! -s "$node_dir/sysctls" ]; then
    mkdir -p "$node_dir"
    for name in $node_sysctls; do printf '%s=%s\n' "$name" "$(sysctl -n "$name")"; done > "$node_dir/sysctls.tmp"
    mv "$node_dir/sysctls.tmp" "$node_dir/sysctls"
  fi
  sysctl -qw net.bridge.bridge-nf-call-iptables=1 ||
    die "could not set net.bridge.bridge-nf-call-iptables (br_netfilter): NetworkPolicy would not see traffic between Pods"
  # The policy engine refuses with REJECT, whose ICMP errors the kernel rate-limits per peer (about
  # 6 at once, then 1 a second): a Pod probed for many refusals in a row would see some as
  # silence. Unlimited here, so that a test tells the engine's refusal from a drop.
  sysctl -qw net.ipv4.icmp_ratelimit=0 || die "could not set net.ipv4.icmp_ratelimit"
  node_network_up
  node_network_check
}

write_node_config() {
  mkdir -p "$node_dir/containerd" "$node_dir/cni/net.d" "$node_dir/cni/ipam" "$kubelet_root"
  cat > "$node_dir/containerd/config.toml" <<TOML
version = 2
root = "$node_dir/containerd/root"
state = "$node_dir/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "$containerd_socket"
[ttrpc]
  address = "$node_dir/containerd/containerd.sock.ttrpc"
[debug]
  level = "warn"
[plugins."io.containerd.internal.v1.opt"]
  path = "$node_dir/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "openab.dev/pause:test"
  tolerate_missing_hugetlb_controller = true
  disable_apparmor = true
  # This machine withholds CAP_SYS_RESOURCE even from root, so runc cannot lower a sandbox's
  # oom_score_adj below containerd's own (the kubelet asks for -998): keep it at or above ours.
  restrict_oom_score_adj = true
  enable_selinux = false
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
    # gVisor: its shim (containerd-shim-runsc-v1, found on containerd's PATH) runs runsc.
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.$gvisor_handler]
      runtime_type = "io.containerd.runsc.v1"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.$gvisor_handler.options]
        TypeUrl = "io.containerd.runsc.v1.options"
        ConfigPath = "$node_dir/containerd/runsc.toml"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$node_dir/cni/net.d"
    max_conf_num = 1
TOML
  # systrap: gVisor's platform that needs no virtualization (ptrace is its slow predecessor; runsc's
  # kvm platform did not run on this VM, although /dev/kvm exists).
  cat > "$node_dir/containerd/runsc.toml" <<TOML
binary_name = "$gvisor_dir/runsc"
root = "$node_dir/runsc"
[runsc_config]
  platform = "systrap"
TOML
  cat > "$node_dir/cni/net.d/10-$cni_network.conflist" <<JSON
{
  "cniVersion": "0.4.0",
  "name": "$cni_network",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$bridge",
      "isGateway": true,
      "isDefaultGateway": true,
      "ipMasq": false,
      "hairpinMode": false,
      "ipam": {
        "type": "host-local",
        "ranges": [[{ "subnet": "$pod_subnet" }]],
        "dataDir": "$node_dir/cni/ipam"
      }
    }
  ]
}
JSON
  # Eviction at 0% and no image GC: a test machine's disk and memory never evict a test Pod.
  cat > "$node_dir/kubelet.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: $kubelet_port
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $kubelet_healthz_port
tlsCertFile: $pki/kubelet.crt
tlsPrivateKeyFile: $pki/kubelet.key
authentication:
  anonymous: { enabled: false }
  webhook: { enabled: true }
  x509: { clientCAFile: $pki/ca.crt }
authorization:
  mode: Webhook
containerRuntimeEndpoint: unix://$containerd_socket
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
resolvConf: ""
clusterDomain: ""
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
imageMinimumGCAge: 87600h
evictionHard:
  memory.available: "0%"
  nodefs.available: "0%"
  nodefs.inodesFree: "0%"
  imagefs.available: "0%"
serializeImagePulls: false
registerNode: true
# The kubelet's default: 30 sessions at once also run 30 helper Pods of the volume provisioner, and
# at 32 the scheduler held the rest back ("Too many pods") for its 10 s retry.
maxPods: 110
podPidsLimit: 1024
YAML
}

# Imports an image archive unless containerd already has that exact image.
import_image() {
  local archive=$1 tag=$2
  if [ "$(cat "$node_dir/images/${tag//[:\/]/_}" 2>/dev/null)" != "$archive" ]; then
    # (ctr relays containerd's notice that cgroup v1 is deprecated: true, and not news here.)
    ctr_ images import --no-unpack=false "$archive" 2> >(grep -v 'DEPRECATION: The support for cgroup v1' >&2) \
      >/dev/null || die "could not import $archive"
    mkdir -p "$node_dir/images"
    printf '%s' "$archive" > "$node_dir/images/${tag//[:\/]/_}"
    say "imported $tag"
  fi
}

node_up() {
  local started=$SECONDS
  node_network_check
  write_node_config
  kubeconfig "$node_dir/kubelet.kubeconfig" "system:node:$node_name" kubelet
  # Shims are found on containerd's PATH.
  PATH="$containerd_dir:$gvisor_dir:$PATH" \
    start containerd "$containerd_dir/containerd" --config "$node_dir/containerd/config.toml"
  wait_for containerd 60 ctr_ version
  local pause worker helper agent_worker
  pause=$("$repo/e2e/images/build" pause) || die "building the pause image failed"
  import_image "$pause" openab.dev/pause:test
  worker=$("$repo/e2e/images/build" worker) || die "building the worker image failed"
  import_image "$worker" openab.dev/worker:test
  helper=$("$repo/e2e/images/build" volume-helper) || die "building the volume helper image failed"
  import_image "$helper" openab.dev/volume-helper:test
  # deploy/worker/Dockerfile's image with real agents (and its probe variant), for the real-agent
  # tests: about 3 minutes and 550 MB the first time, cached after (e2e/images/build).
  agent_worker=$("$repo/e2e/images/build" agent-worker) || die "building the agent worker image failed"
  import_image "$agent_worker" openab.dev/agent-worker:test
  start kubelet "$bin/kubelet" --config "$node_dir/kubelet.yaml" \
    --kubeconfig "$node_dir/kubelet.kubeconfig" --root-dir "$kubelet_root" \
    --hostname-override "$node_name" --node-labels type=real --node-ip "$pod_gateway"
  wait_for kubelet 90 curl -fsS "http://127.0.0.1:$kubelet_healthz_port/healthz"
  local deadline=$((SECONDS + 120))
  until kubectl wait --for=condition=Ready "node/$node_name" --timeout=5s >/dev/null 2>&1; do
    pid_of kubelet >/dev/null || fail kubelet "kubelet exited before node $node_name was Ready"
    [ $SECONDS -lt $deadline ] || fail kubelet "node $node_name was not Ready within 120 s"
  done
  node_services_up
  node_policy_up
  node_runtime_classes
  say "node $node_name Ready in $((SECONDS - started)) s"
}

# The RuntimeClass a profile's runtime_class names to run its workers under gVisor.
node_runtime_classes() {
  if [ "$with_gvisor" = 1 ]; then
    kubectl apply -f - >/dev/null <<YAML || die "could not apply RuntimeClass gvisor"
apiVersion: node.k8s.io/v1
kind: RuntimeClass
metadata:
  name: gvisor
handler: $gvisor_handler
YAML
  else
    kubectl delete runtimeclass gvisor --ignore-not-found >/dev/null || die "could not delete RuntimeClass gvisor"
  fi
}

# kube-proxy in iptables mode: ClusterIP Services, the `kubernetes` one among them. It leaves
# conntrack and route_localnet as they are, and serves NodePorts only on the bridge's address.
node_services_up() {
  kubeconfig "$node_dir/kube-proxy.kubeconfig" system:kube-proxy kube-proxy
  start kube-proxy "$bin/kube-proxy" --kubeconfig "$node_dir/kube-proxy.kubeconfig" \
    --hostname-override "$node_name" --proxy-mode iptables --cluster-cidr "$pod_subnet" \
    --nodeport-addresses "$pod_gateway/32" --iptables-localhost-nodeports=false \
    --conntrack-max-per-core 0 --conntrack-tcp-timeout-established 0 --conntrack-tcp-timeout-close-wait 0 \
    --healthz-bind-address "127.0.0.1:$kube_proxy_healthz_port" \
    --metrics-bind-address "127.0.0.1:$kube_proxy_metrics_port"
  wait_for kube-proxy 60 curl -fsS "http://127.0.0.1:$kube_proxy_healthz_port/healthz"
  # Ready once the `kubernetes` Service's rule exists.
  wait_for kube-proxy 60 chain_mentions nat KUBE-SERVICES "-d $kubernetes_service_ip/32"
}

# chain_mentions TABLE CHAIN TEXT: whether a rule of CHAIN contains TEXT. (Read whole: under
# pipefail, grep -q leaving early could SIGPIPE iptables.)
chain_mentions() {
  local rules
  rules=$(iptables -t "$1" -S "$2" 2>/dev/null) || return 1
  grep -qF -- "$3" <<<"$rules"
}

# kube-router with only its firewall (no routing, no service proxy), the NetworkPolicy engine:
# no health or metrics port, so it listens on nothing.
node_policy_up() {
  kubeconfig "$node_dir/kube-router.kubeconfig" openab-test-kube-router kube-router
  start kube-router "$kube_router_dir/kube-router" --kubeconfig "$node_dir/kube-router.kubeconfig" \
    --run-firewall=true --run-router=false --run-service-proxy=false \
    --hostname-override "$node_name" --service-cluster-ip-range "$service_cidr" \
    --health-port 0 --metrics-port 0 --enable-ipv6=false
  wait_for kube-router 60 chain_mentions filter FORWARD "-j KUBE-ROUTER-FORWARD"
}

# Pods first (the kubelet tears down their sandboxes and networks), then the kubelet, then
# whatever outlived it: containers, shims, mounts, cgroups, network namespaces.
node_down() {
  if pid_of kubelet >/dev/null && pid_of kube-apiserver >/dev/null; then
    kubectl delete pods -A --field-selector "spec.nodeName=$node_name" --grace-period 0 --force \
      --wait=false >/dev/null 2>&1 || true
    local deadline=$((SECONDS + 60))
    while [ -n "$(ctr_ containers list -q 2>/dev/null)" ] && [ $SECONDS -lt $deadline ]; do sleep 0.5; done
  fi
  stop kube-router
  stop kube-proxy
  stop kubelet
  if pid_of containerd >/dev/null; then
    local task
    for task in $(ctr_ tasks list -q 2>/dev/null); do ctr_ tasks kill -s SIGKILL "$task" >/dev/null 2>&1 || true; done
  fi
  stop containerd
  # Shims outlive containerd by design; their command lines name our socket.
  local pid
  for pid in $(pgrep -f "containerd-shim.*$containerd_socket" || true); do kill -KILL "$pid" 2>/dev/null || true; done
  node_cgroups_down
  local mount
  for mount in $(findmnt -rn -o TARGET | grep -F -- "$node_dir" | sort -r); do
    umount "$mount" 2>/dev/null || umount -l "$mount" 2>/dev/null || true
  done
  local netns
  for netns in /var/run/netns/cni-*; do
    [ -e "$netns" ] || continue
    # A CNI namespace that holds an interface of our bridge's subnet is ours.
    # (Output read whole: under pipefail, grep -q leaving early could SIGPIPE the writer.)
    grep -q "inet ${pod_subnet%.*}\." <<<"$(ip netns exec "${netns##*/}" ip -4 addr 2>/dev/null)" &&
      ip netns delete "${netns##*/}" 2>/dev/null || true
  done
  rm -f /var/lib/cni/results/"$cni_network"-* 2>/dev/null || true
  if [ -s "$node_dir/sysctls" ]; then
    sysctl -q -p "$node_dir/sysctls" >/dev/null 2>&1 || say "could not restore $(tr '\n' ' ' < "$node_dir/sysctls")"
  fi
}

# The kubelet's cgroups (cgroupfs driver: kubepods under every controller): kill what is left in
# them, then remove them deepest first.
node_cgroups_down() {
  local dir cgroup
  for dir in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods; do
    [ -d "$dir" ] || continue
    find "$dir" -name cgroup.procs -exec cat {} + 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
  done
  sleep 0.2
  for dir in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods; do
    [ -d "$dir" ] || continue
    find "$dir" -depth -type d | while read -r cgroup; do rmdir "$cgroup" 2>/dev/null || true; done
  done
}

# The bridge and the rules outlive the state directory's removal, so `down` ends with them.
node_network_down() {
  if ip link show "$bridge" >/dev/null 2>&1; then ip link delete "$bridge" 2>/dev/null || true; fi
  local rule table chain chains firewall
  for firewall in $firewalls; do
    while read -r rule; do
      [ -n "$rule" ] || continue
      # shellcheck disable=SC2086
      "$firewall" -t mangle ${rule/-A /-D } 2>/dev/null || true
    done <<<"$(node_rules "$firewall")"
  done
  # The chains of the kubelet (KUBE-FIREWALL, KUBE-KUBELET-CANARY, KUBE-IPTABLES-HINT), kube-proxy
  # (KUBE-SERVICES, KUBE-SVC-..., ...) and kube-router (KUBE-ROUTER-..., KUBE-POD-FW-...,
  # KUBE-NWPLCY-...) and the jumps into them: nothing else on these machines runs Kubernetes, so
  # every KUBE- chain is theirs.
  local tool
  for tool in iptables ip6tables; do
    command -v "$tool" >/dev/null || continue
    for table in filter nat mangle; do
      # Jumps from the built-in chains, by number, last first (their comments hold spaces).
      for chain in PREROUTING INPUT FORWARD OUTPUT POSTROUTING; do
        for rule in $("$tool" -t "$table" -L "$chain" -n --line-numbers 2>/dev/null | awk '$2 ~ /^KUBE-/ { print $1 }' | sort -rn); do
          "$tool" -t "$table" -D "$chain" "$rule" 2>/dev/null || true
        done
      done
      # All flushed before any is deleted: kube-proxy's and kube-router's chains jump to each other.
      chains=$("$tool" -t "$table" -S 2>/dev/null | sed -n 's/^-N \(KUBE-[A-Z0-9-]*\)$/\1/p')
      for chain in $chains; do "$tool" -t "$table" -F "$chain" 2>/dev/null || true; done
      for chain in $chains; do "$tool" -t "$table" -X "$chain" 2>/dev/null || true; done
    done
  done
  # kube-router's ipsets, once no rule refers to them.
  local set
  for set in $(node_ipsets); do ipset destroy "$set" 2>/dev/null || true; done
  return 0
}

# kube-router's ipsets (named KUBE-SRC-..., KUBE-DST-..., kube-router-...).
node_ipsets() {
  command -v ipset >/dev/null || return 0
  local sets
  sets=$(ipset list -n 2>/dev/null) || return 0
  grep -E '^(KUBE-|kube-router)' <<<"$sets" || true
}

node_leftovers() {
  local found=""
  pgrep -f "containerd-shim.*$containerd_socket" >/dev/null && found+=" containerd shims;"
  ip link show "$bridge" >/dev/null 2>&1 && found+=" bridge $bridge;"
  [ -n "$(node_rules iptables)$(node_rules ip6tables)" ] && found+=" firewall rules ($rule_comment);"
  local table
  for table in filter nat mangle; do
    # Each output read whole: under pipefail, grep -q leaving early could SIGPIPE the writer
    # and hide what it found.
    grep -q KUBE- <<<"$(iptables -t "$table" -S 2>/dev/null)" && found+=" kubelet chains in iptables $table;"
    grep -q KUBE- <<<"$(ip6tables -t "$table" -S 2>/dev/null)" && found+=" kubelet chains in ip6tables $table;"
  done
  [ -n "$(node_ipsets)" ] && found+=" ipsets ($(node_ipsets | tr '\n' ' '));"
  grep -qF -- "$node_dir" <<<"$(findmnt -rn -o TARGET)" && found+=" mounts under $node_dir;"
  local dir
  for dir in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods; do
    [ -d "$dir" ] && found+=" cgroup $dir;"
  done
  printf '%s' "$found"
}
