"""The README's quickstart, run as written: the first ``bash`` block under
"## Quickstart", read from README.md itself, one line at a time, from the
project's root, against a server started with ``gpuclusters up`` (the
embedded fleet), with the CLI, kubectl and nothing else of this project on
PATH. A README edit that breaks one of its commands fails here, and so does
a change of the product that breaks the README.

What the fixture stands in for: the block's first two lines (``scripts/up &``
starts the server, ``export PATH=...`` puts the CLI on PATH). What the
comments promise is checked where it can be (``EXPECT``), and the scale to
24 GPUs is checked in Slurm after its line.

Needs root and everything scripts/setup builds (Kubernetes, the registry's
images, Slurm).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from gpuclusters.layers.kubernetes.config import DEFAULT_BIN_DIR

if TYPE_CHECKING:
    from support.servers import Servers

PROJECT_ROOT = Path(__file__).resolve().parents[2]
README = PROJECT_ROOT / "README.md"
KUBECTL = DEFAULT_BIN_DIR / "kubectl"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the embedded fleet needs root"),
    pytest.mark.skipif(
        not KUBECTL.exists() or shutil.which("slurmctld") is None,
        reason="run scripts/setup first (Kubernetes, Slurm)",
    ),
]
# The lines the fixture stands in for (the server, the PATH).
STAND_INS = ("scripts/up", "export PATH=")
_COMMENT = re.compile(r"\s+#(\s.*)?$")


def _two_ready(out: str) -> bool:
    rows = [line.split() for line in out.splitlines()[1:] if line.strip()]
    return len(rows) == 2 and all(r[1] == "Ready" for r in rows)


def _two_idle_gpu_nodes(out: str) -> bool:
    rows = [line.split() for line in out.splitlines() if line.strip()]
    return len(rows) == 2 and all(r[1:] == ["idle", "gpu:8"] for r in rows)


def _two_hostnames(out: str) -> bool:
    names = out.split()
    return len(names) == 2 and len(set(names)) == 2


# A piece of a quickstart line -> what its output must show.
EXPECT: dict[str, Callable[[str], bool]] = {
    "get nodes": _two_ready,
    "logs job/gpu-job": lambda out: "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in out,
    "sinfo -N -h": _two_idle_gpu_nodes,
    "cat /mnt/shared/out.txt": _two_hostnames,
    "sacct -n -X -o State": lambda out: out.split() == ["COMPLETED"],
    "volumes list": lambda out: "demo-shared" in out,
}


# After this line, the cluster has a third node, registered in Slurm.
SCALE = "clusters scale demo --gpus 24 --wait"
# Read-only lines whose answer comes from a record written asynchronously
# (slurmctld sends a finished job to slurmdbd a moment later): run again,
# until their expectation holds, for this long.
EVENTUAL = {"sacct -n -X -o State": 30.0}


def quickstart_lines(readme: str) -> list[str]:
    """The commands of the quickstart's first bash block, comments dropped."""
    section = readme.split("\n## Quickstart\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("\n```", 1)[0]
    lines = [_COMMENT.sub("", line).strip() for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_the_quickstart_is_what_this_test_runs() -> None:
    """The parser finds the block and every expectation still names a line
    of it (a README edit that drops one must change this test too)."""
    lines = quickstart_lines(README.read_text())
    assert lines[0].startswith(STAND_INS[0]) and lines[1].startswith(STAND_INS[1])
    for piece in EXPECT:
        assert any(piece in line for line in lines), piece
    assert any("examples/gpu-job.yaml" in line for line in lines)
    assert any(SCALE in line for line in lines)


def test_the_readme_quickstart_runs_as_written(server_factory: Servers) -> None:
    server = server_factory(provider="netns", start=False)
    server.use_up = True
    server.start()
    venv_bin = Path(sys.executable).parent  # the README's .venv/bin
    assert (venv_bin / "gpuclusters").exists()
    env = {
        "PATH": f"{venv_bin}:{KUBECTL.parent}:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": str(server.home.parent),
        "GPUCLUSTERS_HOME": str(server.home),
        "LANG": "C.UTF-8",
        "COLUMNS": "160",
    }
    lines = quickstart_lines(README.read_text())
    ran = []

    def run(line: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-euo", "pipefail", "-c", line],
            cwd=PROJECT_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=600,
        )

    for line in lines:
        if line.startswith(STAND_INS):
            continue
        done = run(line)
        for piece, wait_s in EVENTUAL.items():
            deadline = time.monotonic() + wait_s
            while piece in line and done.returncode == 0 and not EXPECT[piece](done.stdout):
                if time.monotonic() > deadline:
                    break
                time.sleep(1)
                done = run(line)
        ran.append(line)
        if done.returncode != 0:
            tail = server.log_path.read_text()[-3000:]
            pytest.fail(
                f"README quickstart line failed ({done.returncode}): {line}\n"
                f"stdout: {done.stdout}\nstderr: {done.stderr}\nserver log tail:\n{tail}"
            )
        for piece, check in EXPECT.items():
            if piece in line:
                assert check(done.stdout), f"{line}\nprinted:\n{done.stdout}"
        if SCALE in line:
            # "a third node registers in Slurm"
            sinfo = server.cli("clusters", "ssh", "demo", "--", "sinfo", "-N", "-h", "-o", "%N")
            assert len(sinfo.stdout.split()) == 3, sinfo.stdout + sinfo.stderr
    assert len(ran) == len(lines) - len(STAND_INS)
    assert not (PROJECT_ROOT / "demo.kubeconfig").exists()  # nothing written into the checkout
