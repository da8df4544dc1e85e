"""The tools the product names, unchanged, on a real cluster of the embedded
fleet (docs/ecosystem/*.md): a distributed PyTorch job (torchrun, gloo,
rendezvous through a headless Service name) across two 8-GPU pods in an
image the test pushes as a user would, the MPI Operator's MPIJob across
two nodes, and Volcano's gang-scheduled vcjob. Each tool is installed
from its own release manifest with only image references rewritten
(``layers/kubernetes/ecosystem.py``).

One Kubernetes cluster (2 nodes, 16 GPUs) serves the module; each test
cleans up what it made, so the next one has both nodes' GPUs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gpuclusters.layers.kubernetes.config import DEFAULT_BIN_DIR
from gpuclusters.server.settings import Settings

if TYPE_CHECKING:
    from conftest import ServerHandle, Servers

KUBECTL = DEFAULT_BIN_DIR / "kubectl"
IMAGES = Settings().images_cache
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the embedded fleet needs root"),
    pytest.mark.skipif(
        not KUBECTL.exists() or shutil.which("skopeo") is None,
        reason="run scripts/setup first (Kubernetes binaries, skopeo)",
    ),
]


class Cluster:
    def __init__(self, server: ServerHandle, kubeconfig: Path, info: dict[str, Any]) -> None:
        self.server = server
        self.kubeconfig = kubeconfig
        self.info = info

    def kubectl(self, *args: str, stdin: str | None = None, timeout: float = 180) -> Any:
        return subprocess.run(
            [str(KUBECTL), "--kubeconfig", str(self.kubeconfig), *args],
            input=stdin if stdin is not None else "",
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def ok(self, *args: str, stdin: str | None = None, timeout: float = 180) -> str:
        r = self.kubectl(*args, stdin=stdin, timeout=timeout)
        assert r.returncode == 0, f"kubectl {' '.join(args)}\n{r.stdout}\n{r.stderr}"
        return str(r.stdout)

    def describe(self, *what: str) -> str:
        return str(self.kubectl("describe", *what).stdout)


@pytest.fixture(scope="module")
def cluster(module_servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    server = module_servers(provider="netns", start=False)
    server.env["GPUCLUSTERS_REGISTRY_SYSTEM_IMAGES"] = json.dumps(
        ["base", "pause", "mpi-operator", "mpi", "vc-scheduler", "vc-controller-manager",
         "vc-webhook-manager"]
    )  # fmt: skip
    server.start()
    out = server.cli("clusters", "create", "eco", "--type", "kubernetes", "--gpus", "16",
                     "--wait", "--output", "json", timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    kubeconfig = tmp_path_factory.mktemp("eco") / "kubeconfig"
    cred = server.cli("clusters", "credentials", "eco", "--file", str(kubeconfig))
    assert cred.returncode == 0, cred.stderr
    yield Cluster(server, kubeconfig, json.loads(out.stdout))


def _wait(what: str, check: Any, timeout_s: float = 180) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(1)


# -- torchrun -------------------------------------------------------------------

TRAIN = """\
import os, socket
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
# One step of data-parallel training: every rank's gradient, averaged.
model = torch.nn.Linear(4, 1)
torch.manual_seed(rank)
loss = model(torch.randn(8, 4)).pow(2).mean()
loss.backward()
for p in model.parameters():
    dist.all_reduce(p.grad)
    p.grad /= world
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
print(f"rank {rank}/{world} on {socket.gethostname()} "
      f"gpus={os.environ.get('CUDA_VISIBLE_DEVICES')} sum={total.item():g}", flush=True)
dist.destroy_process_group()
"""


def torch_job(image: str) -> str:
    script = "\n".join("    " + line for line in TRAIN.splitlines())
    return f"""
apiVersion: v1
kind: ConfigMap
metadata: {{name: train}}
data:
  train.py: |
{script}
---
apiVersion: v1
kind: Service
metadata: {{name: trainers}}
spec:
  clusterIP: None
  selector: {{job-name: train}}
  publishNotReadyAddresses: true
  ports: [{{name: rdzv, port: 29500}}]
---
apiVersion: batch/v1
kind: Job
metadata: {{name: train}}
spec:
  completionMode: Indexed
  completions: 2
  parallelism: 2
  backoffLimit: 0
  template:
    spec:
      subdomain: trainers
      restartPolicy: Never
      containers:
      - name: trainer
        image: {image}
        # torchrun of PyTorch 1.13 (Debian's) spells its options with '_'.
        command:
        - torchrun
        - --nnodes=2
        - --nproc_per_node=1
        - --node_rank=$(JOB_COMPLETION_INDEX)
        - --rdzv_backend=c10d
        - --rdzv_endpoint=train-0.trainers:29500
        - --rdzv_id=train
        - /train/train.py
        resources:
          limits: {{nvidia.com/gpu: 8}}
        volumeMounts: [{{name: train, mountPath: /train}}]
      volumes:
      - name: train
        configMap: {{name: train}}
"""


def test_torchrun_across_two_nodes_with_8_gpus_each(cluster: Cluster) -> None:
    archive = IMAGES / "torch_bookworm.tar"
    assert archive.is_file(), "run scripts/build-images (scripts/setup does)"
    # The user pushes their training image into their project's repository.
    registry = cluster.info["registry"]
    key = cluster.server.api_key
    ca_dir = cluster.kubeconfig.parent / "certs"
    ca_dir.mkdir(exist_ok=True)
    shutil.copy(cluster.server.home / "tls" / "ca.pem", ca_dir / "ca.crt")
    copy = subprocess.run(
        ["skopeo", "copy", "--quiet", "--dest-cert-dir", str(ca_dir),
         "--dest-creds", f"admin:{key}", f"oci-archive:{archive}",
         f"docker://{registry}/trainer:1"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert copy.returncode == 0, copy.stderr
    cluster.ok("apply", "-f", "-", stdin=torch_job(f"{registry}/trainer:1"))
    try:
        done = cluster.kubectl("wait", "--for=condition=complete", "job/train",
                               "--timeout=300s", timeout=320)  # fmt: skip
        logs = cluster.kubectl("logs", "-l", "job-name=train", "--prefix", "--tail=-1").stdout
        if done.returncode != 0:
            pytest.fail(f"job train: {done.stderr}\n{logs}\n{cluster.describe('pods')}")
        lines = sorted(line for line in logs.splitlines() if "rank " in line)
        assert len(lines) == 2, logs
        pods = json.loads(cluster.ok("get", "pods", "-l", "job-name=train", "-o", "json"))
        nodes = {p["spec"]["nodeName"] for p in pods["items"]}
        assert len(nodes) == 2, nodes  # 8 GPUs each: one pod per node
        for rank, line in enumerate(lines):
            assert f"rank {rank}/2" in line
            assert "gpus=0,1,2,3,4,5,6,7" in line, line
            assert "sum=3" in line  # (0 + 1) + (1 + 1): both ranks took part
    finally:
        cluster.kubectl("delete", "job/train", "service/trainers", "configmap/train",
                        "--wait=true", "--timeout=60s")  # fmt: skip
