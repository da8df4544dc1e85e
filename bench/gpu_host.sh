#!/usr/bin/env bash
# End to end on a real GPU host: the host's GPUs reach a node, Slurm, Kubernetes
# and the health checks. Never run in CI (it needs NVIDIA GPUs and root).
#
#   GPUCLUSTERS_URL=https://ctl:8470 GPUCLUSTERS_API_KEY=gpc_... bench/gpu_host.sh
#   bench/gpu_host.sh                      # the CLI's own config (gpuclusters login / up)
#
# Needs a running server whose fleet has this host (a host agent joined, or
# `gpuclusters up` here with real devices configured). The script does not
# start one: say which server with GPUCLUSTERS_URL/GPUCLUSTERS_API_KEY or
# the CLI's config file.
#
# Environment (all optional):
#   CLUSTER=gpu-host-bench  name of the throwaway cluster (type slurm: Slurm
#                           and Kubernetes both run on it)
#   GPU_TYPE=...            catalog GPU type (default: from this host's inventory)
#   GPUS=8                  GPUs to ask for (a multiple of 8)
#   BURN_S=60               gpu-burn duration
#   POD_IMAGE=...           an image with nvidia-smi and CUDA (default: the
#                           nodes' busybox, which can only list devices)
#   KEEP=1                  keep the cluster afterwards
#
# Every step prints what it runs and what it saw; a failed expectation is
# reported as FAIL and the script goes on, exiting 1 at the end if any failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
GPC="${GPC:-$(dirname "$PY")/gpuclusters}"
[[ -x "$GPC" ]] || GPC=gpuclusters
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/src"
CLUSTER="${CLUSTER:-gpu-host-bench}"
GPUS="${GPUS:-8}"
BURN_S="${BURN_S:-60}"
FAILED=0
WORK="$(mktemp -d /tmp/gpu-host-bench.XXXXXX)"

step() { printf '\n=== %s\n' "$*"; }
run() { printf '$ %s\n' "$*"; "$@"; }
ok() { printf 'OK   %s\n' "$*"; }
fail() { printf 'FAIL %s\n' "$*"; FAILED=1; }
json() { "$PY" -c "import json,sys; d=json.load(sys.stdin); $1"; }
in_node() { "$GPC" clusters ssh "$CLUSTER" --node "$NODE" --as-root -- "$@"; }
in_login() { "$GPC" clusters ssh "$CLUSTER" --as-root -- "$@"; }

cleanup() {
    if [[ "${KEEP:-0}" != 1 && "${CREATED:-0}" == 1 ]]; then
        step "cleanup: deleting cluster $CLUSTER (KEEP=1 keeps it)"
        "$GPC" clusters delete "$CLUSTER" >/dev/null 2>&1 || echo "(delete failed; remove it by hand)"
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT

# -- 0. this host ---------------------------------------------------------------------------
step "0. this host's GPUs (nvidia-smi on the host)"
if ! command -v nvidia-smi >/dev/null; then
    echo "no nvidia-smi on this machine: this script is for a GPU host"; exit 2
fi
run nvidia-smi -L | tee "$WORK/host-gpus.txt"
HOST_UUIDS="$(grep -o 'GPU-[0-9a-f-]*' "$WORK/host-gpus.txt" | sort)"
echo "host GPU UUIDs: $(echo "$HOST_UUIDS" | wc -l)"

step "0b. what a node of this host gets (linux.devices.host_devices) and the host inventory"
command -v nvidia-ctk >/dev/null && echo "nvidia-ctk: $(nvidia-ctk --version 2>&1 | head -1)" \
    || echo "nvidia-ctk: not installed (devices are discovered)"
"$PY" - <<'EOF' || fail "device discovery raised"
from gpuclusters.linux.devices import host_devices
from gpuclusters.agent.inventory import collect
ds = host_devices()
if ds is None:
    print("no GPU or fabric devices found")
else:
    print(f"source={ds.source} gpus={ds.gpu_count} device nodes={len(ds.device_nodes)} "
          f"mounts={len(ds.mounts)} library dirs={list(ds.library_dirs)}")
    for path in ds.device_nodes:
        print("  device", path)
inv = collect()
print(f"inventory: {inv.gpu_count} x {inv.gpu_model} driver {inv.driver_version}, "
      f"{inv.nvme_gib} GiB NVMe, {len(inv.infiniband)} IB ports, {inv.cpus} CPUs, "
      f"{inv.memory_gib} GiB, {inv.os}, kernel {inv.kernel}")
EOF
GPU_TYPE="${GPU_TYPE:-$("$PY" -c 'from gpuclusters.agent.inventory import collect; print(collect().gpu_model or "H100_SXM")')}"
echo "GPU type for the cluster: $GPU_TYPE"

# -- 1. the server and its hosts --------------------------------------------------------------
step "1. the server's hosts"
if ! run "$GPC" hosts list; then
    echo "cannot reach the server: set GPUCLUSTERS_URL and GPUCLUSTERS_API_KEY (or gpuclusters login)"
    exit 2
fi

# -- 2. a cluster on it -------------------------------------------------------------------------
step "2. cluster $CLUSTER: $GPUS x $GPU_TYPE, Slurm + Kubernetes"
if "$GPC" clusters get "$CLUSTER" -o json >/dev/null 2>&1; then
    echo "cluster $CLUSTER exists already: using it"
else
    run "$GPC" clusters create "$CLUSTER" --type slurm --gpus "$GPUS" --gpu-type "$GPU_TYPE" \
        --wait --wait-timeout 1800 || { fail "cluster did not become ready"; exit 1; }
    CREATED=1
fi
"$GPC" clusters get "$CLUSTER" -o json >"$WORK/cluster.json"
NODE="$(json 'print(next(n["name"] for n in d.get("nodes", []) if n.get("state", n.get("phase")) == "running"))' \
    <"$WORK/cluster.json" 2>/dev/null)"
[[ -n "$NODE" ]] || { fail "no running node in the cluster"; exit 1; }
echo "GPU node: $NODE"

# -- 3. inside the node ---------------------------------------------------------------------------
step "3. nvidia-smi inside node $NODE"
in_node nvidia-smi -L | tee "$WORK/node-gpus.txt" || fail "nvidia-smi failed in the node"
NODE_UUIDS="$(grep -o 'GPU-[0-9a-f-]*' "$WORK/node-gpus.txt" | sort)"
[[ -n "$NODE_UUIDS" && "$NODE_UUIDS" == "$HOST_UUIDS" ]] \
    && ok "the node sees the host's $(echo "$NODE_UUIDS" | wc -l) GPUs" \
    || fail "the node's GPUs differ from the host's"
echo "--- /run/gpuclusters/devices (what the boot bound, saw, skipped):"
in_node cat /run/gpuclusters/devices || fail "no device report: the node has simulated devices?"
MEMLOCK="$(in_node sh -c 'ulimit -l')"
[[ "$MEMLOCK" == unlimited ]] && ok "memlock unlimited in the node" || fail "memlock in the node: $MEMLOCK"
in_node sh -c 'ls -l /dev/infiniband 2>/dev/null || echo "(no /dev/infiniband)"'

# -- 4. Kubernetes: the device plugin ---------------------------------------------------------------
step "4. nvidia.com/gpu advertised to Kubernetes with the real UUIDs"
export KUBECONFIG="$WORK/kubeconfig"
run "$GPC" clusters credentials "$CLUSTER" || fail "no kubeconfig"
if command -v kubectl >/dev/null; then
    kubectl get nodes -o json >"$WORK/nodes.json" && json '
for n in d["items"]:
    print(n["metadata"]["name"], "allocatable nvidia.com/gpu =",
          n["status"].get("allocatable", {}).get("nvidia.com/gpu"))' <"$WORK/nodes.json"
else
    echo "(no kubectl on this machine: allocatable not shown)"
fi
# kubelet records the IDs ListAndWatch sent in its checkpoint.
in_node cat /var/lib/kubelet/device-plugins/kubelet_internal_checkpoint >"$WORK/checkpoint.json" \
    || fail "no kubelet device-plugin checkpoint in the node"
PLUGIN_UUIDS="$(json '
ids = set()
for e in d.get("Data", {}).get("RegisteredDevices", {}).get("nvidia.com/gpu", []): ids.add(e)
print("\n".join(sorted(ids)))' <"$WORK/checkpoint.json" 2>/dev/null)"
echo "device plugin IDs:"; echo "$PLUGIN_UUIDS"
[[ -n "$PLUGIN_UUIDS" && "$PLUGIN_UUIDS" == "$HOST_UUIDS" ]] \
    && ok "ListAndWatch advertises the host's GPU UUIDs" || fail "advertised IDs are not the host's UUIDs"

step "4b. a pod asking for all $GPUS GPUs"
if command -v kubectl >/dev/null; then
    IMAGE="${POD_IMAGE:-localhost/gpuclusters-base:latest}"
    if [[ -n "${POD_IMAGE:-}" ]]; then CMD='nvidia-smi -L'; else
        CMD='echo NVIDIA_VISIBLE_DEVICES=$NVIDIA_VISIBLE_DEVICES; ls /dev/nvidia*'; fi
    cat >"$WORK/pod.yaml" <<EOF
apiVersion: v1
kind: Pod
metadata: {name: gpu-host-bench}
spec:
  restartPolicy: Never
  containers:
  - name: gpus
    image: $IMAGE
    command: ["sh", "-c", "$CMD"]
    resources: {limits: {nvidia.com/gpu: $GPUS}}
EOF
    kubectl delete pod gpu-host-bench --ignore-not-found >/dev/null 2>&1
    run kubectl apply -f "$WORK/pod.yaml"
    kubectl wait --for=jsonpath='{.status.phase}'=Succeeded pod/gpu-host-bench --timeout=300s \
        && ok "pod ran" || fail "pod did not succeed: $(kubectl get pod gpu-host-bench -o wide 2>&1)"
    kubectl logs gpu-host-bench | tee "$WORK/pod.log"
    kubectl delete pod gpu-host-bench --ignore-not-found >/dev/null 2>&1
else
    echo "(no kubectl: pod skipped)"
fi

# -- 5. Slurm ---------------------------------------------------------------------------------------
step "5. a Slurm job asking for $GPUS GPUs"
in_login sinfo -N -o '%N %G %T' || fail "sinfo failed"
in_login srun -N1 --gres="gpu:$GPUS" sh -c 'echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES; nvidia-smi -L; ulimit -l' \
    | tee "$WORK/slurm.log" || fail "srun failed"
JOB_UUIDS="$(grep -o 'GPU-[0-9a-f-]*' "$WORK/slurm.log" | sort)"
[[ -n "$JOB_UUIDS" && "$JOB_UUIDS" == "$HOST_UUIDS" ]] \
    && ok "the Slurm job sees the host's GPUs" || fail "the Slurm job's GPUs differ from the host's"

# -- 6. health ---------------------------------------------------------------------------------------
step "6. gpu-burn health check (${BURN_S}s)"
"$GPC" health run "$CLUSTER" --check gpu-burn --node "$NODE" --duration "$BURN_S" -o json \
    | tee "$WORK/burn.json" || fail "health run failed"
STATE="$(json '
runs = d if isinstance(d, list) else [d]
states = [r.get("state") or r.get("status") for r in runs]
results = [x for r in runs for x in r.get("results", [])]
print(",".join(sorted({str(x.get("state")) for x in results} or set(map(str, states)))))' \
    <"$WORK/burn.json" 2>/dev/null)"
echo "gpu-burn: $STATE"
[[ "$STATE" == passed ]] && ok "gpu-burn passed" || fail "gpu-burn: $STATE"

step "done: $([[ $FAILED == 0 ]] && echo 'all steps passed' || echo 'some steps FAILED (above)')"
exit "$FAILED"
