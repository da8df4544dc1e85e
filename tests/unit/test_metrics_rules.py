"""The alert rules render to a file vmalert accepts (its own dry run), with
the thresholds from settings."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from gpuclusters.server.metrics_rules import render_rules, rules
from gpuclusters.server.settings import Settings

VMALERT = Settings().metrics_alert_bin


def test_rules_follow_settings() -> None:
    found = {
        r["alert"]: r for g in rules(interval_s=7, idle_gpu_h=1.5)["groups"] for r in g["rules"]
    }
    assert set(found) >= {"GpuXidError", "GpuEccDoubleBit", "GpuThermalThrottle",
                          "GpuAllocatedIdle", "NodeAgentDown", "HostsUnreachable",
                          "ReconcileLag"}  # fmt: skip
    assert found["GpuAllocatedIdle"]["for"] == "90m"
    assert (
        "bitmap_and(DCGM_FI_DEV_CLOCK_THROTTLE_REASONS, 96)" in found["GpuThermalThrottle"]["expr"]
    )
    assert all(g["interval"] == "7s" for g in rules(interval_s=7, idle_gpu_h=1)["groups"])


@pytest.mark.skipif(not VMALERT.is_file(), reason="run scripts/build-k8s-addons first")
def test_vmalert_accepts_the_rules(tmp_path: Path) -> None:
    path = tmp_path / "rules.yml"
    path.write_text(render_rules(interval_s=15, idle_gpu_h=4))
    ok = subprocess.run([str(VMALERT), f"-rule={path}", "-dryRun"], capture_output=True,
                        text=True, timeout=60, check=False)  # fmt: skip
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # and its dry run does reject a broken rule, so the check can fail
    broken = yaml.safe_load(path.read_text())
    broken["groups"][0]["rules"][0]["expr"] = "DCGM_FI_DEV_XID_ERRORS > > 0"
    path.write_text(yaml.safe_dump(broken))
    bad = subprocess.run([str(VMALERT), f"-rule={path}", "-dryRun"], capture_output=True,
                         text=True, timeout=60, check=False)  # fmt: skip
    assert bad.returncode != 0
