"""core/builds.py: the background builder's plan, its scheduling and the
texts users see."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpuclusters.core.builds import (
    BACKGROUND_PLAN,
    CLUSTER_ADDONS,
    BuildStatus,
    Slot,
    Step,
    StepState,
    blocked,
    check_plan,
    runnable,
    still_building,
    summary,
    waiting_message,
)
from gpuclusters.imagebuild.catalog import catalog

ROOT = Path(__file__).resolve().parents[2]
D, P, B, F = StepState.DONE, StepState.PENDING, StepState.BUILDING, StepState.FAILED


def test_the_plan_is_ordered_and_every_step_names_a_real_script_and_target() -> None:
    check_plan(BACKGROUND_PLAN)
    addons_script = (ROOT / "scripts/build-k8s-addons").read_text()
    known_addons = set(re.findall(r'^\s+"([a-z-]+)\|', addons_script, re.MULTILINE))
    images = set(catalog())
    for step in BACKGROUND_PLAN:
        assert (ROOT / step.argv[0]).is_file(), step
        target = step.argv[1]
        if step.argv[0] == "scripts/build-k8s-addons":
            assert target in known_addons, step
        else:
            assert target in images, step
    # Every add-on and image but the registry and the metrics database (built
    # before the server starts: it runs both from its first start).
    built = {s.argv[1] for s in BACKGROUND_PLAN if s.argv[0] == "scripts/build-k8s-addons"}
    assert built == known_addons - {"registry", "victoria-metrics"}
    assert {s.argv[1] for s in BACKGROUND_PLAN if s.argv[0] == "scripts/build-images"} == images
    assert [s.name for s in BACKGROUND_PLAN if s.for_clusters] == list(CLUSTER_ADDONS)


def test_check_plan_refuses_an_unknown_or_later_step() -> None:
    with pytest.raises(ValueError, match="comes after unknown"):
        check_plan([Step("a", ("x",), after=("b",)), Step("b", ("x",))])
    with pytest.raises(ValueError, match="twice"):
        check_plan([Step("a", ("x",)), Step("a", ("y",))])


PLAN = [
    Step("go1", ("x",), Slot.CPU),
    Step("go2", ("x",), Slot.CPU),
    Step("deb1", ("x",), Slot.IO, after=("go1",)),
    Step("deb2", ("x",), Slot.IO),
    Step("img", ("x",), Slot.CPU, after=("go2",)),
]


def test_one_step_per_slot_in_plan_order_once_its_predecessors_are_done() -> None:
    assert [s.name for s in runnable(PLAN, {}, [])] == ["go1", "deb2"]
    # deb1 waits for go1 although the io slot is free; deb2 is next in line.
    assert [s.name for s in runnable(PLAN, {"go1": B}, [Slot.CPU])] == ["deb2"]
    assert [s.name for s in runnable(PLAN, {"go1": D, "deb2": B}, [Slot.IO])] == ["go2"]
    assert [s.name for s in runnable(PLAN, {"go1": D, "deb2": D}, [])] == ["go2", "deb1"]
    assert runnable(PLAN, {n.name: D for n in PLAN}, []) == []


def test_a_failed_step_blocks_what_comes_after_it_transitively() -> None:
    plan = [*PLAN, Step("last", ("x",), Slot.IO, after=("img",))]
    assert blocked(plan, {"go2": F}) == ["img", "last"]
    assert blocked(plan, {"go2": D}) == []


def _status(states: dict[str, StepState], *, now: float = 1000.0) -> BuildStatus:
    status = BuildStatus.fresh(PLAN, pid=42, now=now - 100, log_dir="/logs")
    for name, state in states.items():
        s = status.step(name)
        s.state = state
        s.started_at = now - 30 if state is not P else None
        s.finished_at = now - 10 if state.finished else None
    return status


def test_still_building_only_while_the_builder_lives() -> None:
    status = _status({"go1": D, "go2": B})
    assert still_building(status, ["go1", "go2", "deb1"], alive=True) == ["go2", "deb1"]
    assert still_building(status, ["go2"], alive=False) == []
    assert still_building(None, ["go2"], alive=True) == []


def test_the_status_document_round_trips() -> None:
    status = _status({"go1": D, "go2": F})
    status.step("go2").error = "exit code 2"
    again = BuildStatus.from_json(status.as_json())
    assert again == status
    with pytest.raises(ValueError, match="version"):
        BuildStatus.from_json({**status.as_json(), "version": 99})


def test_texts_say_what_is_left_failed_or_abandoned() -> None:
    running = _status({"go1": D, "go2": B})
    line = summary(running, alive=True, now=1000.0)
    assert line.startswith("background builds: 1 of 5 built; building go2 (30 s); 3 waiting")
    assert "log /logs/go2.log" in waiting_message(running, ["go2", "deb1"])
    assert "waiting for go2, deb1" in waiting_message(running, ["go2", "deb1"])

    gone = summary(running, alive=False, now=1000.0)
    assert "stopped with 4 of 5 unfinished" in gone and "run scripts/setup" in gone

    finished = _status({n.name: D for n in PLAN})
    assert summary(finished, alive=False, now=1000.0) == "background builds finished: all 5 built"
    broken = _status({"go1": D, "go2": F, "deb1": D, "deb2": D, "img": StepState.SKIPPED})
    assert "FAILED: go2" in summary(broken, alive=False, now=1000.0)
