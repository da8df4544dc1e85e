"""Preemption on a real Kubernetes cluster (netns provider, real server,
CLI and kubectl): the checkpointing Job runs on a preemptible node; an
admin reclaims its host; the node gets a Warning event ``PreemptionNotified``
and a taint, the pod is evicted (grace capped), checkpoints on SIGTERM, the
node is released once the pod is gone, and the Job's next pod resumes from
the checkpoint on the replacement node the pool brings up on spare capacity.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gpuclusters.layers.kubernetes.config import DEFAULT_BIN_DIR

if TYPE_CHECKING:
    from support.servers import ServerHandle, Servers

KUBECTL = DEFAULT_BIN_DIR / "kubectl"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "checkpointing" / "k8s-job.yaml"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the embedded fleet needs root"),
    pytest.mark.skipif(
        not KUBECTL.exists() or shutil.which("containerd") is None,
        reason="run scripts/setup first (Kubernetes binaries, containerd)",
    ),
]


def ok(server: ServerHandle, *args: str) -> str:
    r = server.cli(*args, timeout=300)
    assert r.returncode == 0, f"gpuclusters {' '.join(args)}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def kjson(kubeconfig: Path, *args: str) -> Any:
    r = subprocess.run(
        [str(KUBECTL), f"--kubeconfig={kubeconfig}", *args, "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(r.stdout)


def get(server: ServerHandle, name: str) -> dict[str, Any]:
    return dict(json.loads(ok(server, "clusters", "get", name, "--output", "json")))


def test_preempted_pod_checkpoints_and_the_job_resumes(
    server_factory: Servers, tmp_path: Path
) -> None:
    server = server_factory(provider="netns", start=False)
    server.env["GPUCLUSTERS_PREEMPTION_GRACE_S"] = "120"
    server.start()
    ok(server, "clusters", "create", "k1", "--type", "kubernetes", "--gpus", "8",
       "--preemptible-gpus", "8", "--wait")  # fmt: skip
    k1 = server.wait_for(
        "8 preemptible GPUs allocated",
        lambda: (c := get(server, "k1"))["allocated_preemptible_gpus"] == 8 and c,
        timeout=180,
    )
    victim = next(n for n in k1["nodes"] if n["compute_class"] == "preemptible")
    kubeconfig = tmp_path / "k1.kubeconfig"
    ok(server, "clusters", "credentials", "k1", "--file", str(kubeconfig))

    def ready_preemptible() -> bool:
        nodes = kjson(kubeconfig, "get", "nodes", "-l", "gpuclusters.io/compute-class=preemptible")
        return any(n["metadata"]["name"] == victim["name"] for n in nodes["items"])

    server.wait_for("the preemptible node in Kubernetes", ready_preemptible, timeout=60)
    subprocess.run(
        [str(KUBECTL), f"--kubeconfig={kubeconfig}", "apply", "-f", str(EXAMPLE)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    log = next((server.home / "volumes").glob("*/data")) / "checkpoints" / "ckpt-demo-k8s" / "log"
    server.wait_for("the Job's pod to start", lambda: log.exists() and "start" in log.read_text(),
                    timeout=120)  # fmt: skip
    pods = kjson(kubeconfig, "get", "pods", "-l", "job-name=ckpt-demo")["items"]
    assert [p["spec"]["nodeName"] for p in pods] == [victim["name"]]

    def progressed() -> bool:
        # The Job prints each step it finishes: reclaim once it is past 2.
        logs = subprocess.run(
            [str(KUBECTL), f"--kubeconfig={kubeconfig}", "logs", "job/ckpt-demo"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        return "step=2" in logs.stdout.split()

    server.wait_for("the Job's second step", progressed, timeout=60)

    ok(server, "hosts", "reclaim", victim["host"])

    def preempted() -> dict[str, Any] | None:
        events = json.loads(ok(server, "events", "--cluster", "k1", "--output", "json"))
        return next((e for e in events if e["reason"] == "Preempted"), None)

    released = server.wait_for("the node's release", preempted, timeout=120)
    assert released["node"] == victim["name"]
    assert "its workloads exited" in released["message"], released

    # The Warning event on the Node, as a watch on node events sees it.
    node_events = kjson(kubeconfig, "get", "events", "-A",
                        "--field-selector", "reason=PreemptionNotified")["items"]  # fmt: skip
    assert [(e["type"], e["involvedObject"]["kind"], e["involvedObject"]["name"])
            for e in node_events] == [("Warning", "Node", victim["name"])]  # fmt: skip

    # The Job resumes from its checkpoint on the replacement node.
    def resumed() -> str | None:
        text = log.read_text()
        return text if "resume" in text else None

    text = server.wait_for("the Job to resume", resumed, timeout=240)
    lines = text.splitlines()
    sigterm = next(ln for ln in lines if ln.startswith("sigterm"))
    resume = next(ln for ln in lines if ln.startswith("resume"))
    step = sigterm.split()[1]
    assert resume.split()[1] == step and step != "step=0", text
    job = kjson(kubeconfig, "get", "job", "ckpt-demo")
    assert job["status"].get("failed", 0) == 0  # the eviction did not count as a failure

    def running() -> list[dict[str, Any]]:
        pods = kjson(kubeconfig, "get", "pods", "-l", "job-name=ckpt-demo")["items"]
        return [p for p in pods if p["status"]["phase"] == "Running"]

    # (the kubelet reports the phase a moment after the container writes)
    (pod,) = server.wait_for("the resumed pod to read Running", running, timeout=30)
    assert pod["spec"]["nodeName"] != victim["name"]
    k1 = get(server, "k1")
    assert k1["allocated_preemptible_gpus"] == 8
    assert victim["name"] not in {n["name"] for n in k1["nodes"]}

    ok(server, "clusters", "delete", "k1", "--wait")
