"""Autoscaling decisions, as pure functions (docs/autoscaling.md).

Two kinds of scheduler signals: Slurm's power saving says per slot what it
wants (``decide``); Kubernetes says which pods cannot be scheduled, and the
control plane works out the nodes they need and which nodes have been idle
long enough (``decide_demand``).

An autoscaled cluster has a fixed set of *slots*: the names its scheduler
knows for the GPU nodes it may have (``<cluster>-as1`` .. ``-asN`` for
``max_gpus / 8`` nodes). Every standard node of the cluster holds one slot
(``nodes.slot``). The scheduler decides: Slurm's power saving asks for a
slot to be powered up when work waits for it, and powers it down once it
has been idle for the cluster's idle time. The control plane follows what
the scheduler says, level-triggered (every pass reads the scheduler's
state again, so a lost call or a server restart loses nothing):

- a slot the scheduler wants up that holds no node gets one (bounded by
  ``max_gpus``; quotas, budgets and capacity may still refuse it, which is
  an event, not an error);
- a node whose slot the scheduler released goes, if nothing runs there (a
  job, a non-daemon pod) and the cluster stays at ``min_gpus`` or above.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gpuclusters.core.enums import GPUS_PER_NODE

DEFAULT_IDLE_S = 600


def slot_names(cluster_name: str, max_gpus: int) -> tuple[str, ...]:
    """The slots of a cluster that grows up to ``max_gpus``."""
    return tuple(f"{cluster_name}-as{i}" for i in range(1, max_gpus // GPUS_PER_NODE + 1))


def free_slots(all_slots: Sequence[str], taken: Iterable[str | None], count: int) -> list[str]:
    """The first ``count`` slots no live node holds (fewer if there are not so many)."""
    held = {s for s in taken if s}
    return [s for s in all_slots if s not in held][:count]


@dataclass(frozen=True, slots=True)
class SlotState:
    """What the scheduler says of one slot now."""

    name: str
    wants_up: bool  # power up asked for (work waits for it)
    released: bool  # powered down, or being powered down (idle past its time)
    busy: bool = False  # work runs there


@dataclass(frozen=True, slots=True)
class ScaleSignals:
    """A layer's view of its autoscaled cluster: every slot's state (Slurm),
    or the GPUs each unschedulable pod asks for (Kubernetes), and what waits
    (for the events' reasons)."""

    slots: tuple[SlotState, ...] = ()
    pending_jobs: tuple[str, ...] = ()
    # Kubernetes: the GPUs each pod that cannot be scheduled asks for.
    pending_gpus: tuple[int, ...] = ()
    by_pods: bool = False


@dataclass(frozen=True, slots=True)
class Decision:
    add: tuple[str, ...] = ()  # slots to give a new node
    remove: tuple[str, ...] = ()  # node names to release
    kept: Mapping[str, str] = field(default_factory=dict)  # node name -> why it stays
    why_removed: Mapping[str, str] = field(default_factory=dict)  # node name -> why it goes

    @property
    def empty(self) -> bool:
        return not self.add and not self.remove


def decide(
    signals: ScaleSignals,
    nodes: Mapping[str, str],
    *,
    held: Iterable[str] = (),
    min_gpus: int,
    max_gpus: int,
    busy_nodes: Iterable[str] = (),
) -> Decision:
    """What to do now. ``nodes`` maps the slot of each standard node that
    stays (not being released) to its name; ``held`` are the slots of every
    live node, leaving ones too (a slot is free again only once its node is
    gone); ``busy_nodes`` are nodes where other work (a pod, a job the
    scheduler did not list) runs."""
    by_slot = {s.name: s for s in signals.slots}
    taken = set(held) | set(nodes)
    max_nodes = max_gpus // GPUS_PER_NODE
    min_nodes = min_gpus // GPUS_PER_NODE
    room = max(0, max_nodes - len(taken))
    add = [s.name for s in signals.slots if s.wants_up and s.name not in taken][:room]
    busy = set(busy_nodes)
    remove: list[str] = []
    kept: dict[str, str] = {}
    left = len(nodes)
    for slot, name in sorted(nodes.items()):
        state = by_slot.get(slot)
        if state is None or not state.released or state.wants_up:
            continue
        if state.busy or name in busy:
            kept[name] = "work still runs there"
        elif left - 1 < min_nodes:
            kept[name] = f"the cluster stays at min_gpus ({min_gpus})"
        else:
            remove.append(name)
            left -= 1
    return Decision(add=tuple(add), remove=tuple(remove), kept=kept)


def nodes_for(pending_gpus: Sequence[int]) -> int:
    """How many 8-GPU nodes pods asking these GPUs need (first fit,
    largest first); a pod asking more than a node has fits nowhere."""
    free: list[int] = []
    for gpus in sorted((g for g in pending_gpus if 0 < g <= GPUS_PER_NODE), reverse=True):
        for i, room in enumerate(free):
            if room >= gpus:
                free[i] -= gpus
                break
        else:
            free.append(GPUS_PER_NODE - gpus)
    return len(free)


def decide_demand(
    *,
    pending_gpus: Sequence[int],
    joining: int,
    live: int,
    free: Sequence[str],
    idle_for: Mapping[str, float],
    idle_s: float,
    min_gpus: int,
    max_gpus: int,
) -> Decision:
    """Kubernetes: nodes for the pods that cannot be scheduled (less those
    already joining for them), up to ``max_gpus``; with nothing pending,
    nodes idle (no workload pod) for ``idle_s`` go, longest idle first,
    down to ``min_gpus``. ``live`` counts the standard nodes that stay,
    joining ones included; ``idle_for`` maps running nodes without work
    to how long they have been so."""
    max_nodes = max_gpus // GPUS_PER_NODE
    min_nodes = min_gpus // GPUS_PER_NODE
    want = max(0, nodes_for(pending_gpus) - joining)
    add = tuple(free[: max(0, min(want, max_nodes - live))])
    remove: list[str] = []
    why: dict[str, str] = {}
    if not pending_gpus:
        left = live
        for name, seconds in sorted(idle_for.items(), key=lambda kv: (-kv[1], kv[0])):
            if seconds < idle_s:
                continue
            if left - 1 < min_nodes:
                break  # min_gpus: the rest stay (no event: this is the steady state)
            remove.append(name)
            why[name] = f"idle for {idle_s:.0f} s: no pod but daemons ran there"
            left -= 1
    return Decision(add=add, remove=tuple(remove), why_removed=why)
