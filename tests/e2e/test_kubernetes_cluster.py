"""Real Kubernetes clusters on the embedded fleet (netns provider), end to
end, through the real server, CLI and kubectl: the issue's acceptance
steps (2 Ready nodes with 8 allocatable GPUs each, a Job on 8 GPUs in a
real container writing to the shared PVC, a 16-GPU Pod that stays
Pending), pod and Service networking across nodes, per-user RBAC, and a
delete that leaves nothing behind but the volume's data.

Needs root, containerd/runc/CNI plugins and the Kubernetes binaries that
``scripts/setup`` builds (``scripts/build-k8s``).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import ssl
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import jwt
import pytest
import yaml

from gpuclusters.layers.kubernetes.config import DEFAULT_BIN_DIR
from gpuclusters.server.security.cluster_tokens import (
    DISCOVERY_PATH,
    KEY_DIR,
    KEY_FILE,
    TokenIssuer,
    ensure_signing_key,
)

if TYPE_CHECKING:
    from support.servers import ServerHandle, Servers

KUBECTL = DEFAULT_BIN_DIR / "kubectl"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the embedded fleet needs root"),
    pytest.mark.skipif(
        not KUBECTL.exists() or shutil.which("containerd") is None,
        reason="run scripts/setup first (Kubernetes binaries, containerd)",
    ),
]

JOB = """\
apiVersion: batch/v1
kind: Job
metadata: {name: gpu-job}
spec:
  backoffLimit: 0
  template:
    spec:
      restartPolicy: Never
      containers:
      - name: main
        image: localhost/gpuclusters-base:latest
        command: ["sh", "-c", "echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES; \
echo NVIDIA_VISIBLE_DEVICES=$NVIDIA_VISIBLE_DEVICES; ls /dev | grep -c '^nvidia[0-9]'; \
echo $CUDA_VISIBLE_DEVICES > /data/from-k8s.txt"]
        resources:
          limits: {nvidia.com/gpu: 8}
        volumeMounts: [{name: shared, mountPath: /data}]
      volumes:
      - name: shared
        persistentVolumeClaim: {claimName: shared-volume}
"""

TOO_BIG = """\
apiVersion: v1
kind: Pod
metadata: {name: too-big}
spec:
  containers:
  - name: main
    image: localhost/gpuclusters-base:latest
    command: ["sleep", "3600"]
    resources:
      limits: {nvidia.com/gpu: 16}
"""

WEB = """\
apiVersion: v1
kind: Pod
metadata: {name: web, labels: {app: web}}
spec:
  nodeName: {server_node}
  containers:
  - name: web
    image: localhost/gpuclusters-base:latest
    command: ["sh", "-c", "mkdir -p /www && echo hello-from-web > /www/index.html && \
httpd -f -p 8080 -h /www"]
---
apiVersion: v1
kind: Service
metadata: {name: web}
spec:
  selector: {app: web}
  ports: [{port: 80, targetPort: 8080}]
---
apiVersion: v1
kind: Pod
metadata: {name: client}
spec:
  nodeName: {client_node}
  restartPolicy: Never
  containers:
  - name: main
    image: localhost/gpuclusters-base:latest
    command: ["sh", "-c", "for i in 1 2 3 4 5 6 7 8 9 10; do \
printf 'GET / HTTP/1.0\\\\r\\\\n\\\\r\\\\n' | nc -w 3 $WEB_SERVICE_HOST 80 && exit 0; \
sleep 1; done; exit 1"]
"""


HOLD = """\
apiVersion: v1
kind: Pod
metadata: {{name: hold}}
spec:
  nodeName: {node}
  terminationGracePeriodSeconds: 0
  containers:
  - name: main
    image: localhost/gpuclusters-base:latest
    command: ["sleep", "600"]
    resources:
      limits: {{nvidia.com/gpu: 8}}
"""


def ok(server: ServerHandle, *args: str, env: dict[str, str] | None = None) -> str:
    r = server.cli(*args, env=env, timeout=300)
    assert r.returncode == 0, f"gpuclusters {' '.join(args)}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def kubectl(
    kubeconfig: Path, *args: str, stdin: str | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [str(KUBECTL), f"--kubeconfig={kubeconfig}", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if check:
        assert r.returncode == 0, f"kubectl {' '.join(args)}\n{r.stdout}\n{r.stderr}"
    return r


def kjson(kubeconfig: Path, *args: str) -> Any:
    return json.loads(kubectl(kubeconfig, *args, "-o", "json").stdout)


def forged_token(
    server: ServerHandle, *, audience: str | None = None, other_key: bool = False
) -> str:
    """A token for bob on k1 made with the server's own signing key (the
    boundary's control: it must pass), for another audience, or signed by
    another key."""
    issuer = httpx.get(f"{server.url}{DISCOVERY_PATH}", timeout=10).json()["issuer"]
    # The cluster's id, from the audience of a token the server issued.
    issued = json.loads(ok(server, "clusters", "token", "k1"))["status"]["token"]
    aud = jwt.decode(issued, options={"verify_signature": False})["aud"]
    cluster_id = str(aud).removeprefix("gpuclusters:")
    if other_key:
        key = ensure_signing_key(server.home / "another-issuer")
    else:
        key = (server.home / KEY_DIR / KEY_FILE).read_bytes()
    return TokenIssuer(key, issuer).mint(user="bob", cluster_id=audience or cluster_id).token


def apiserver_status(server: ServerHandle, kubeconfig: Path, token: str) -> int:
    """The apiserver's answer to bob listing pods with ``token``."""
    config = yaml.safe_load(kubeconfig.read_text())
    cluster = config["clusters"][0]["cluster"]
    ca = server.home / "k1-apiserver-ca.pem"
    ca.write_bytes(base64.b64decode(cluster["certificate-authority-data"]))
    r = httpx.get(
        f"{cluster['server']}/api/v1/namespaces/default/pods",
        headers={"Authorization": f"Bearer {token}"},
        verify=ssl.create_default_context(cafile=str(ca)),
        timeout=10,
    )
    return r.status_code


def wait(what: str, check: Any, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.5)


def node_cgroups(server: ServerHandle) -> list[str]:
    state = json.loads((server.home / "netns-provider.json").read_text())["nodes"]
    names = {f"gpc-{i[:12]}" for i in state}
    root = Path("/sys/fs/cgroup")
    return [str(d / n) for d in root.iterdir() for n in names if (d / n).exists()]


def test_kubernetes_cluster_end_to_end(server_factory: Servers, tmp_path: Path) -> None:
    server = server_factory(provider="netns")
    created = json.loads(
        ok(server, "clusters", "create", "k1", "--type", "kubernetes", "--gpus", "16", "--wait",
           "--output", "json")
    )  # fmt: skip
    assert created["status"] == "ready" and len(created["nodes"]) == 2
    names = sorted(n["name"] for n in created["nodes"])
    assert all("-standard-" in n for n in names)  # node names show the class

    kubeconfig = tmp_path / "k1.kubeconfig"
    ok(server, "clusters", "credentials", "k1", "--file", str(kubeconfig))
    assert kubeconfig.stat().st_mode & 0o777 == 0o600
    # No credential of the user's in it: kubectl asks the CLI for a token of
    # minutes at each run (docs/identity.md).
    (entry,) = yaml.safe_load(kubeconfig.read_text())["users"]
    assert set(entry["user"]) == {"exec"}, entry
    assert entry["user"]["exec"]["args"][:3] == ["clusters", "token", "k1"]
    assert Path(entry["user"]["exec"]["command"]).is_absolute()

    # 2 Ready nodes, 8 allocatable GPUs each, labelled with class, GPU type, island.
    nodes = kjson(kubeconfig, "get", "nodes")["items"]
    assert sorted(n["metadata"]["name"] for n in nodes) == names
    for n in nodes:
        ready = {c["type"]: c["status"] for c in n["status"]["conditions"]}["Ready"]
        assert ready == "True"
        assert n["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        labels = n["metadata"]["labels"]
        assert labels["gpuclusters.io/compute-class"] == "standard"
        assert labels["gpuclusters.io/gpu-type"] == created["gpu_type"]
        assert labels["gpuclusters.io/ib-island"].startswith("ib-")
        assert n["status"]["nodeInfo"]["kubeletVersion"] == "v1.34.4"

    # Storage: the shared volume's PVC is bound; local NVMe has its class and PVs.
    pvc = kjson(kubeconfig, "get", "pvc", "shared-volume")
    assert pvc["status"]["phase"] == "Bound" and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    classes = {c["metadata"]["name"] for c in kjson(kubeconfig, "get", "storageclass")["items"]}
    assert {"shared-volume", "local-storage-class"} <= classes
    local = [
        pv
        for pv in kjson(kubeconfig, "get", "pv")["items"]
        if pv["spec"]["storageClassName"] == "local-storage-class"
    ]
    assert len(local) == 2 and {pv["spec"]["local"]["path"] for pv in local} == {"/scratch"}

    # A Job on 8 GPUs runs a real container that writes to the shared PVC.
    kubectl(kubeconfig, "apply", "-f", "-", stdin=JOB)
    wait(
        "job complete",
        lambda: kjson(kubeconfig, "get", "job", "gpu-job").get("status", {}).get("succeeded"),
    )
    logs = kubectl(kubeconfig, "logs", "job/gpu-job").stdout.split()
    assert logs[0] == "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7"
    assert logs[1].startswith("NVIDIA_VISIBLE_DEVICES=GPU-") and logs[1].count("GPU-") == 8
    assert logs[2] == "8"  # the container sees exactly its 8 GPU devices
    data = next((server.home / "volumes").glob("*/data"))
    assert (data / "from-k8s.txt").read_text().strip() == "0,1,2,3,4,5,6,7"

    # 16 GPUs fit on no node: the Pod stays Pending, Unschedulable.
    kubectl(kubeconfig, "apply", "-f", "-", stdin=TOO_BIG)

    def unschedulable() -> bool:
        pod = kjson(kubeconfig, "get", "pod", "too-big")
        conds = {c["type"]: c for c in pod["status"].get("conditions", [])}
        sched = conds.get("PodScheduled", {})
        return pod["status"]["phase"] == "Pending" and sched.get("reason") == "Unschedulable"

    wait("too-big unschedulable", unschedulable, timeout=60)

    # Pods reach a ClusterIP Service whose pod runs on the other node.
    web = WEB.replace("{server_node}", names[0]).replace("{client_node}", names[1])
    kubectl(kubeconfig, "apply", "-f", "-", stdin=web)
    wait(
        "client done",
        lambda: (
            kjson(kubeconfig, "get", "pod", "client")["status"]["phase"] in ("Succeeded", "Failed")
        ),
    )
    assert kjson(kubeconfig, "get", "pod", "client")["status"]["phase"] == "Succeeded"
    assert "hello-from-web" in kubectl(kubeconfig, "logs", "client").stdout

    # Per-user certificates: admins get cluster-admin, editors `edit`.
    assert kubectl(kubeconfig, "auth", "can-i", "delete", "nodes").stdout.strip() == "yes"
    editor_key = json.loads(
        ok(server, "api-keys", "create", "--user", "bob", "--project", "default", "--output",
           "json")
    )["key"]  # fmt: skip
    bob = tmp_path / "bob.kubeconfig"
    bob_home = {"GPUCLUSTERS_HOME": str(tmp_path / "bob-home")}
    ok(server, "login", "--url", server.url, "--api-key", editor_key, env=bob_home)
    ok(server, "clusters", "credentials", "k1", "--file", str(bob), env=bob_home)
    assert kubectl(bob, "auth", "can-i", "create", "pods").stdout.strip() == "yes"
    assert kubectl(bob, "auth", "can-i", "delete", "nodes", check=False).stdout.strip() == "no"
    whoami = kjson(bob, "auth", "whoami")["status"]["userInfo"]
    assert whoami["username"] == "bob" and "gpuclusters:users" in whoami["groups"]
    # The apiserver takes the server's tokens for this cluster only, and no
    # one else's: a token of the same key for another audience, or one of
    # another key, is refused; the same request with a good token passes.
    assert apiserver_status(server, kubeconfig, forged_token(server, audience=None)) == 200
    assert apiserver_status(server, kubeconfig, forged_token(server, audience="x")) == 401
    assert apiserver_status(server, kubeconfig, forged_token(server, other_key=True)) == 401

    # Active checks hold the node through a placeholder Job asking for all
    # 8 GPUs: a pod holding GPUs on one node makes that node's check wait.
    kubectl(kubeconfig, "apply", "-f", "-", stdin=HOLD.format(node=names[0]))
    server.wait_for(
        "the GPU-holding pod to run",
        lambda: kjson(kubeconfig, "get", "pod", "hold")["status"]["phase"] == "Running",
        timeout=60,
    )
    r = server.cli("health", "run", "k1", "--check", "gpu-burn", "--duration", "5",
                   "--no-wait", "--output", "json", timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    runs = {h["node"]: h for h in json.loads(r.stdout)}
    server.wait_for(
        "the free node's check",
        lambda: json.loads(ok(server, "health", "show", runs[names[1]]["id"], "--output",
                              "json"))["state"] == "skipped",
        timeout=60,
    )  # fmt: skip
    busy = json.loads(ok(server, "health", "show", runs[names[0]]["id"], "--output", "json"))
    assert busy["state"] in ("pending", "running")  # queued behind the GPU pod
    kubectl(kubeconfig, "delete", "pod", "hold", "--grace-period=0", "--force")
    server.wait_for(
        "the busy node's check once its GPUs are free",
        lambda: (h := json.loads(ok(server, "health", "show", runs[names[0]]["id"], "--output",
                                    "json")))["state"] == "skipped" and h,
        timeout=90,
    )  # fmt: skip
    for h in json.loads(ok(server, "health", "list", "--output", "json")):
        assert (h["state"], h["reason"]) == ("skipped", "no GPU"), h
    server.wait_for(
        "the placeholder Jobs to go",
        lambda: (
            kjson(kubeconfig, "get", "jobs", "-l", "gpuclusters.io/exclusive-check")["items"] == []
        ),
        timeout=30,
    )

    # Delete: namespaces, cgroups and processes go; the volume's data stays.
    state = json.loads((server.home / "netns-provider.json").read_text())["nodes"]
    namespaces = {f"gpc-{node_id[:12]}" for node_id in state}
    cgroups = node_cgroups(server)
    assert len(namespaces) == 3 and len(cgroups) >= 2  # 2 GPU nodes + control plane
    ok(server, "clusters", "delete", "k1", "--wait")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert namespaces.isdisjoint(line.split()[0] for line in listed.splitlines() if line.strip())
    assert [c for c in cgroups if Path(c).exists()] == []
    # Killed processes may sit as zombies until PID 1 reaps them: not leaks.
    ps = subprocess.run(["ps", "-eo", "stat=,args="], capture_output=True, text=True).stdout
    leftovers = "\n".join(
        line.split(None, 1)[1] for line in ps.splitlines() if line.strip() and "Z" not in line[:2]
    )
    assert str(server.home) not in leftovers.replace(f"--port {server.port}", "")
    for daemon in ("kube-apiserver", "kubelet --config", "containerd --config", "etcd --name=k1"):
        assert daemon not in leftovers
    assert (data / "from-k8s.txt").exists()
