"""What ``scripts/setup`` builds after the server can start, and in which
order: the plan, the state of each step, and what a waiting cluster says.

Set-up builds in two parts (docs/operators.md "Install"). Before the server
starts: the system packages, the virtual environment, Kubernetes, the image
registry and the node image, which every node and the API need. The rest
is built by a *background builder* (``gpuclusters.builds.runner``) while
the server already serves: the add-ons a cluster's control plane runs
(CoreDNS, metrics-server: first, since a cluster waits for them), then the
ecosystem tools and their images, which users install themselves.

Each step is one run of a build script that is idempotent on its own (a
stamp check when its output is current), so the builder simply runs them
all. Two *slots* bound what runs at once: ``cpu`` for Go builds, which keep
every core busy (two at once finish no sooner), and ``io`` for the Debian
images, which mostly wait on downloads and dpkg; one of each runs at a
time, so an image downloads while a Go build compiles. A step starts once
the steps it comes ``after`` are done; a failed step fails the steps after
it.

The builder writes its progress to one JSON file (``StatusFile``) that the
server (a cluster waiting for a build) and ``gpuclusters up`` read. This
module is the pure part: the plan, the scheduling decision, the status
document and the texts shown to users; ``gpuclusters.builds`` does the I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

STATUS_VERSION = 1


class Slot(StrEnum):
    CPU = "cpu"
    IO = "io"


class StepState(StrEnum):
    PENDING = "pending"
    BUILDING = "building"
    DONE = "done"
    FAILED = "failed"
    SKIPPED = "skipped"  # a step it comes after failed

    @property
    def finished(self) -> bool:
        return self in (StepState.DONE, StepState.FAILED, StepState.SKIPPED)


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    argv: tuple[str, ...]  # relative to the checkout's root
    slot: Slot = Slot.CPU
    after: tuple[str, ...] = ()
    # A cluster's control plane waits for it (``waiting_for_build``).
    for_clusters: bool = False


def _addon(name: str, *, for_clusters: bool = False, after: tuple[str, ...] = ()) -> Step:
    return Step(
        name, ("scripts/build-k8s-addons", name), Slot.CPU, after, for_clusters=for_clusters
    )


def _image(name: str, slot: Slot, after: tuple[str, ...]) -> Step:
    return Step(f"image {name}", ("scripts/build-images", name), slot, after)


# What clusters need comes first; the images that download Debian packages
# wait for it, so the cluster add-ons get the machine to themselves.
CLUSTER_ADDONS = ("coredns", "metrics-server")
BACKGROUND_PLAN: tuple[Step, ...] = (
    _addon("coredns", for_clusters=True),
    _addon("metrics-server", for_clusters=True),
    _addon("kueue"),
    _addon("mpi-operator"),
    _addon("volcano"),
    _addon("dex"),
    _image("pause", Slot.CPU, ()),
    _image("base", Slot.CPU, ()),
    _image("kueue", Slot.CPU, ("kueue",)),
    _image("mpi-operator", Slot.CPU, ("mpi-operator",)),
    _image("vc-scheduler", Slot.CPU, ("volcano",)),
    _image("vc-controller-manager", Slot.CPU, ("volcano",)),
    _image("vc-webhook-manager", Slot.IO, ("volcano",)),
    _image("mpi", Slot.IO, CLUSTER_ADDONS),
    _image("torch", Slot.IO, CLUSTER_ADDONS),
    _image("skypilot", Slot.IO, CLUSTER_ADDONS),
)


def check_plan(plan: Sequence[Step]) -> None:
    """Names unique, every ``after`` names an earlier step (so no cycle)."""
    seen: set[str] = set()
    for step in plan:
        if step.name in seen:
            raise ValueError(f"build plan: step {step.name!r} twice")
        missing = [a for a in step.after if a not in seen]
        if missing:
            raise ValueError(f"build plan: {step.name!r} comes after unknown {missing}")
        seen.add(step.name)


def runnable(
    plan: Sequence[Step], states: Mapping[str, StepState], busy: Iterable[Slot]
) -> list[Step]:
    """The steps to start now: pending, every ``after`` done, one per free
    slot, in plan order."""
    taken = set(busy)
    start: list[Step] = []
    for step in plan:
        if states.get(step.name, StepState.PENDING) is not StepState.PENDING:
            continue
        if step.slot in taken:
            continue
        if all(states.get(a) is StepState.DONE for a in step.after):
            start.append(step)
            taken.add(step.slot)
    return start


def blocked(plan: Sequence[Step], states: Mapping[str, StepState]) -> list[str]:
    """Pending steps that can never run: a step they come after failed or
    was skipped (marked ``skipped`` by the builder)."""
    dead = {n for n, s in states.items() if s in (StepState.FAILED, StepState.SKIPPED)}
    out: list[str] = []
    for step in plan:
        if states.get(step.name, StepState.PENDING) is StepState.PENDING and (
            dead.intersection(step.after)
        ):
            out.append(step.name)
            dead.add(step.name)
    return out


@dataclass(slots=True)
class StepStatus:
    name: str
    state: StepState = StepState.PENDING
    started_at: float | None = None
    finished_at: float | None = None
    log: str = ""
    error: str = ""

    @property
    def seconds(self) -> float | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.started_at

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state.value,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "seconds": None if self.seconds is None else round(self.seconds, 1),
            "log": self.log,
            "error": self.error,
        }


@dataclass(slots=True)
class BuildStatus:
    """The background builder's status document."""

    runner_pid: int
    started_at: float
    steps: list[StepStatus] = field(default_factory=list)
    finished_at: float | None = None
    log_dir: str = ""

    @classmethod
    def fresh(cls, plan: Sequence[Step], *, pid: int, now: float, log_dir: str) -> BuildStatus:
        return cls(
            runner_pid=pid,
            started_at=now,
            steps=[StepStatus(s.name, log=f"{log_dir}/{_file_name(s.name)}.log") for s in plan],
            log_dir=log_dir,
        )

    def step(self, name: str) -> StepStatus:
        for s in self.steps:
            if s.name == name:
                return s
        raise KeyError(name)

    def states(self) -> dict[str, StepState]:
        return {s.name: s.state for s in self.steps}

    def unfinished(self) -> list[StepStatus]:
        return [s for s in self.steps if not s.state.finished]

    def failed(self) -> list[StepStatus]:
        return [s for s in self.steps if s.state is StepState.FAILED]

    def as_json(self) -> dict[str, Any]:
        return {
            "version": STATUS_VERSION,
            "runner_pid": self.runner_pid,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "log_dir": self.log_dir,
            "steps": [s.as_json() for s in self.steps],
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> BuildStatus:
        if doc.get("version") != STATUS_VERSION:
            raise ValueError(f"build status version {doc.get('version')!r}")
        steps = [
            StepStatus(
                name=str(s["name"]),
                state=StepState(s["state"]),
                started_at=s.get("started_at"),
                finished_at=s.get("finished_at"),
                log=str(s.get("log") or ""),
                error=str(s.get("error") or ""),
            )
            for s in doc.get("steps", [])
        ]
        return cls(
            runner_pid=int(doc["runner_pid"]),
            started_at=float(doc["started_at"]),
            steps=steps,
            finished_at=doc.get("finished_at"),
            log_dir=str(doc.get("log_dir") or ""),
        )


def _file_name(step: str) -> str:
    return step.replace(" ", "-")


def still_building(status: BuildStatus | None, names: Iterable[str], *, alive: bool) -> list[str]:
    """Which of ``names`` a running builder has yet to finish. A builder
    that is gone (killed, machine rebooted) builds nothing: its unfinished
    steps are not waited for."""
    if status is None or not alive:
        return []
    wanted = set(names)
    return [s.name for s in status.steps if s.name in wanted and not s.state.finished]


def waiting_message(status: BuildStatus, waiting: Sequence[str]) -> str:
    """A waiting cluster's status message: what, and where to look."""
    building = [s for s in status.steps if s.name in waiting and s.state is StepState.BUILDING]
    log = building[0].log if building else status.log_dir
    return (
        f"waiting for {', '.join(waiting)}: built in the background by scripts/setup "
        f"(progress: gpuclusters up, log {log})"
    )


def summary(status: BuildStatus, *, alive: bool, now: float) -> str:
    """One line for ``gpuclusters up``: what the background builder has
    left, or that it is done."""
    total = len(status.steps)
    done = sum(1 for s in status.steps if s.state is StepState.DONE)
    failed = status.failed()
    unfinished = status.unfinished()
    if not unfinished:
        if failed:
            names = ", ".join(s.name for s in failed)
            return (
                f"background builds finished: {done} of {total} built, FAILED: {names} "
                f"(logs in {status.log_dir}; run scripts/setup again)"
            )
        return f"background builds finished: all {total} built"
    if not alive:
        return (
            f"background builds stopped with {len(unfinished)} of {total} unfinished "
            f"({', '.join(s.name for s in unfinished)}): run scripts/setup to finish them"
        )
    building = [s for s in unfinished if s.state is StepState.BUILDING]
    parts = []
    for s in building:
        since = f" ({now - s.started_at:.0f} s)" if s.started_at is not None else ""
        parts.append(f"{s.name}{since}")
    now_text = f"; building {', '.join(parts)}" if parts else ""
    return (
        f"background builds: {done} of {total} built{now_text}; "
        f"{len(unfinished) - len(building)} waiting (logs in {status.log_dir})"
    )
