"""Parsing of Slurm 22.05 JSON output (captured from the prototype cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuclusters.layers.base import LayerError
from gpuclusters.layers.slurm.status import (
    active_jobs_on,
    expand_hostlist,
    parse_sacct_json,
    parse_sinfo_json,
    parse_squeue_json,
)

DATA = Path(__file__).parent / "data"


def test_sinfo_draining_node() -> None:
    nodes = {n.name: n for n in parse_sinfo_json((DATA / "sinfo-22.05.json").read_text())}
    n1, n2 = nodes["gpct-n1"], nodes["gpct-n2"]
    assert n1.state == "mixed" and n1.drain and n1.busy and n1.responding
    assert not n1.schedulable
    assert n1.reason == "user: broken fan" and n1.reason_set_by == "root"
    assert n1.gres == "gpu:8" and n1.gres_used == "gpu:8"
    assert n1.features == ("gpu", "h100") and n1.address == "10.232.0.11"
    assert n1.slurmd_start_time > 0
    assert n2.state == "idle" and n2.schedulable and not n2.busy


def test_squeue_active_jobs() -> None:
    jobs = parse_squeue_json((DATA / "squeue-22.05.json").read_text())
    by_id = {j.job_id: j for j in jobs}
    assert by_id[1].nodes == ("gpct-n1", "gpct-n2") and not by_id[1].active
    assert by_id[7].active and by_id[7].user == "alice" and by_id[7].batch
    assert [j.job_id for j in active_jobs_on(jobs, "gpct-n1")] == [7]
    assert active_jobs_on(jobs, "gpct-n2") == []


def test_sacct() -> None:
    jobs = parse_sacct_json((DATA / "sacct-22.05.json").read_text())
    states = [(j.job_id, j.state) for j in jobs]
    assert (1, "COMPLETED") in states and (5, "REQUEUED") in states
    assert next(j for j in jobs if j.job_id == 1).exit_code == 0


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("", ()),
        ("n1", ("n1",)),
        ("gpct-n[1-2]", ("gpct-n1", "gpct-n2")),
        ("a[1-2,5],b", ("a1", "a2", "a5", "b")),
        ("x[08-10]", ("x08", "x09", "x10")),
        ("r[1-2]-n[1-2]", ("r1-n1", "r1-n2", "r2-n1", "r2-n2")),
    ],
)
def test_expand_hostlist(expr: str, names: tuple[str, ...]) -> None:
    assert expand_hostlist(expr) == names


def test_errors_and_garbage() -> None:
    with pytest.raises(LayerError):
        parse_sinfo_json("slurm_load_node: Unable to contact slurm controller")
    with pytest.raises(LayerError, match="boom"):
        parse_squeue_json('{"errors": [{"error": "boom"}], "jobs": []}')
