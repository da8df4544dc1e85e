"""The tools the product names, unchanged, on a real cluster of the embedded
fleet (docs/ecosystem/*.md): a distributed PyTorch job (torchrun, gloo,
rendezvous at a headless Service name) across two 8-GPU pods in an
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
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gpuclusters.layers.kubernetes.config import DEFAULT_BIN_DIR
from gpuclusters.server.settings import Settings
from support.servers import wait_for

if TYPE_CHECKING:
    from support.servers import ServerHandle, Servers

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
        # Static rendezvous, as Kubeflow's PyTorchJob does: node 0 hosts the
        # store, node 1 finds it by the headless Service name. (The c10d
        # backend would host it only on a node whose own name equals the
        # endpoint's host: "train-0.trainers" is neither the pod's hostname
        # nor its FQDN, so no node would.)
        command:
        - torchrun
        - --nnodes=2
        - --nproc_per_node=1
        - --node_rank=$(JOB_COMPLETION_INDEX)
        - --master_addr=train-0.trainers
        - --master_port=29500
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


def _install(cluster: Cluster, tool: str) -> None:
    """A tool's release manifest, images rewritten, applied as its docs say."""
    from gpuclusters.layers.kubernetes import ecosystem

    cluster.ok("apply", "--server-side", "-f", "-", stdin=ecosystem.render(tool), timeout=300)


# -- MPI Operator ----------------------------------------------------------------

# The upstream example (examples/v2beta1/pi/pi.yaml) with our image and a
# program that says where each rank runs; workers ask for 8 GPUs each, so
# they land on different nodes, and the launcher finds them through the
# hostfile's DNS names (<job>-worker-<i>.<job>.<namespace>.svc).
MPIJOB = """\
apiVersion: kubeflow.org/v2beta1
kind: MPIJob
metadata: {name: ranks}
spec:
  slotsPerWorker: 1
  # Workers stay until the job is deleted, so the test can look at them.
  runPolicy: {cleanPodPolicy: None}
  sshAuthMountPath: /home/mpiuser/.ssh
  mpiReplicaSpecs:
    Launcher:
      replicas: 1
      template:
        spec:
          containers:
          - image: localhost/mpi:bookworm
            name: mpi-launcher
            securityContext: {runAsUser: 1000}
            command: [mpirun]
            args:
            - -n
            - "2"
            - python3
            - -c
            - |
              from mpi4py import MPI
              c = MPI.COMM_WORLD
              total = c.allreduce(c.rank + 1)
              print(f"rank {c.rank}/{c.size} on {MPI.Get_processor_name()} sum={total}",
                    flush=True)
    Worker:
      replicas: 2
      template:
        spec:
          containers:
          - image: localhost/mpi:bookworm
            name: mpi-worker
            securityContext: {runAsUser: 1000}
            command: [/usr/sbin/sshd]
            args: [-De, -f, /home/mpiuser/.sshd_config]
            resources:
              limits: {nvidia.com/gpu: 8}
"""


def test_mpijob_across_two_nodes_prints_both_ranks(cluster: Cluster) -> None:
    _install(cluster, "mpi-operator")
    cluster.ok("-n", "mpi-operator", "wait", "deployment/mpi-operator", "--for=condition=Available",
               "--timeout=180s", timeout=200)  # fmt: skip
    # The CRD is established before the operator is Available; the job now.
    cluster.ok("apply", "-f", "-", stdin=MPIJOB)
    try:
        done = cluster.kubectl("wait", "--for=condition=Succeeded", "mpijob/ranks",
                               "--timeout=300s", timeout=320)  # fmt: skip
        logs = cluster.kubectl("logs", "-l", "training.kubeflow.org/job-role=launcher",
                               "--tail=-1").stdout  # fmt: skip
        if done.returncode != 0:
            pytest.fail(f"mpijob ranks: {done.stderr}\n{logs}\n{cluster.describe('pods')}")
        lines = sorted(line for line in logs.splitlines() if line.startswith("rank "))
        assert len(lines) == 2, logs
        role = "training.kubeflow.org/job-role=worker"
        workers = json.loads(cluster.ok("get", "pods", "-l", role, "-o", "json"))
        hosts = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in workers["items"]}
        assert len(set(hosts.values())) == 2, hosts
        for rank, line in enumerate(lines):
            assert line.startswith(f"rank {rank}/2 on ranks-worker-"), line
            assert line.endswith("sum=3"), line
        assert {line.split()[3] for line in lines} == set(hosts), (lines, hosts)
        # Each worker has its node's 8 GPUs (ranks started over SSH do not
        # inherit the container's environment; the container has them).
        for worker in hosts:
            env = cluster.ok("exec", worker, "--", "printenv", "CUDA_VISIBLE_DEVICES")
            assert env.strip() == "0,1,2,3,4,5,6,7", (worker, env)
    finally:
        cluster.kubectl("delete", "mpijob/ranks", "--cascade=foreground", "--timeout=90s")


# -- Volcano ----------------------------------------------------------------------

VCJOB = """\
apiVersion: batch.volcano.sh/v1alpha1
kind: Job
metadata: {{name: {name}}}
spec:
  minAvailable: {tasks}
  schedulerName: volcano
  queue: default
  tasks:
  - replicas: {tasks}
    name: worker
    template:
      spec:
        restartPolicy: Never
        containers:
        - name: main
          image: localhost/gpuclusters-base:latest
          command:
          - sh
          - -c
          - 'echo "task $VC_TASK_INDEX on $(hostname) gpus=$CUDA_VISIBLE_DEVICES"; sleep {sleep}'
          resources:
            limits: {{nvidia.com/gpu: 8}}
"""


def test_volcano_gang_schedules_two_8_gpu_tasks(cluster: Cluster) -> None:
    _install(cluster, "volcano")
    for deployment in ("volcano-scheduler", "volcano-controllers", "volcano-admission"):
        cluster.ok("-n", "volcano-system", "wait", f"deployment/{deployment}",
                   "--for=condition=Available", "--timeout=240s", timeout=260)  # fmt: skip
    # Volcano's controller makes the queue `default` once it runs; jobs name it.
    wait_for(
        "Volcano's default queue",
        lambda: cluster.kubectl("get", "queue", "default").returncode == 0,
        timeout=180,
        interval=1,
    )
    # A gang of 3 x 8 GPUs cannot fit 16: none of its pods may start (a
    # scheduler placing pods one by one would start two and leave them idle).
    # A gang of 2 fits: both run, on the two nodes, and complete.
    big = VCJOB.format(name="too-big", tasks=3, sleep=600)
    fits = VCJOB.format(name="pair", tasks=2, sleep=2)
    try:
        cluster.ok("apply", "-f", "-", stdin=big)

        def big_group_judged() -> bool:
            groups = json.loads(cluster.ok("get", "podgroups", "-o", "json"))["items"]
            return any(
                g["metadata"]["name"].startswith("too-big")
                and g.get("status", {}).get("phase") in ("Pending", "Inqueue")
                for g in groups
            )

        wait_for(
            "the 3-task gang's PodGroup to be judged", big_group_judged, timeout=180, interval=1
        )
        cluster.ok("apply", "-f", "-", stdin=fits)
        done = cluster.kubectl("wait", "--for=jsonpath={.status.state.phase}=Completed",
                               "vcjob/pair", "--timeout=240s", timeout=260)  # fmt: skip
        logs = cluster.kubectl("logs", "-l", "volcano.sh/job-name=pair", "--tail=-1").stdout
        if done.returncode != 0:
            pytest.fail(f"vcjob pair: {done.stderr}\n{logs}\n{cluster.describe('pods')}")
        lines = sorted(line for line in logs.splitlines() if line.startswith("task "))
        assert len(lines) == 2, logs
        assert all("gpus=0,1,2,3,4,5,6,7" in line for line in lines), lines
        pods = json.loads(cluster.ok("get", "pods", "-l", "volcano.sh/job-name=pair", "-o", "json"))
        assert len({p["spec"]["nodeName"] for p in pods["items"]}) == 2
        # All along, the gang that cannot fit stayed whole and unplaced: its
        # PodGroup never ran, and not one of its pods (Volcano makes them
        # only once the group is enqueued) was bound to a node.
        groups = json.loads(cluster.ok("get", "podgroups", "-o", "json"))["items"]
        phases = {g["metadata"]["name"]: g.get("status", {}).get("phase") for g in groups}
        big_phase = [v for k, v in phases.items() if k.startswith("too-big")]
        assert big_phase and big_phase[0] in ("Pending", "Inqueue"), phases
        big_pods = json.loads(cluster.ok("get", "pods", "-l", "volcano.sh/job-name=too-big",
                                         "-o", "json"))["items"]  # fmt: skip
        assert all(not p["spec"].get("nodeName") for p in big_pods), [
            (p["metadata"]["name"], p["spec"].get("nodeName")) for p in big_pods
        ]
    finally:
        cluster.kubectl("delete", "vcjob/too-big", "vcjob/pair", "--wait=true", "--timeout=60s")
