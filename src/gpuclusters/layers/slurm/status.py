"""Reading Slurm's state: ``sinfo --json``, ``squeue --json``, ``sacct --json``; pure.

Slurm 22.05 (data_parser v0.0.38) quirks these parsers absorb:

- ``sinfo --json`` and ``squeue --json`` ignore filters such as ``-n``/``-w``/``-t``
  and always return everything; we filter here. ``sacct --json -j`` does filter.
- A node's ``state`` is the base state in lower case (``idle``, ``mixed``,
  ``allocated``, ``down``, ...); DRAIN, NOT_RESPONDING, DYNAMIC_NORM, ... are in
  ``state_flags``. "draining" = DRAIN with jobs, "drained" = DRAIN and idle.
- ``squeue`` keeps finished jobs for MinJobAge (300 s); job node lists are
  hostlist expressions (``gpct-n[1-2]``), expanded by :func:`expand_hostlist`.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from typing import Any

from gpuclusters.layers.base import LayerError

# Job states in which a job still occupies (or is about to occupy) its nodes.
ACTIVE_JOB_STATES = frozenset(
    {
        "RUNNING",
        "COMPLETING",
        "CONFIGURING",
        "SUSPENDED",
        "STOPPED",
        "SIGNALING",
        "STAGE_OUT",
        "RESIZING",
    }
)


@dataclass(frozen=True, slots=True)
class SlurmNode:
    name: str
    state: str  # base state, lower case
    flags: frozenset[str]
    reason: str
    reason_set_by: str
    gres: str
    gres_used: str
    features: tuple[str, ...]
    address: str
    slurmd_start_time: int

    @property
    def drain(self) -> bool:
        return "DRAIN" in self.flags

    @property
    def responding(self) -> bool:
        return "NOT_RESPONDING" not in self.flags and self.state not in {"down", "unknown"}

    @property
    def busy(self) -> bool:
        return self.state in {"allocated", "mixed", "completing"} or "COMPLETING" in self.flags

    # Power saving (autoscaled clusters' State=CLOUD slots).
    @property
    def powered_down(self) -> bool:
        return "POWERED_DOWN" in self.flags

    @property
    def powering_up(self) -> bool:
        return bool({"POWERING_UP", "POWER_UP"} & self.flags)

    @property
    def powering_down(self) -> bool:
        return bool({"POWERING_DOWN", "POWER_DOWN"} & self.flags)

    @property
    def schedulable(self) -> bool:
        """Up, responding, not drained: new jobs can land here."""
        return self.responding and not self.drain and "FAIL" not in self.flags


@dataclass(frozen=True, slots=True)
class SlurmJob:
    job_id: int
    state: str
    reason: str
    nodes: tuple[str, ...]
    user: str
    restarts: int
    batch: bool

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_JOB_STATES


@dataclass(frozen=True, slots=True)
class AccountedJob:
    job_id: int
    state: str
    user: str
    nodes: tuple[str, ...]
    exit_code: int | None


def _load(text: str, what: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise LayerError(f"{what}: not JSON: {text[:200]!r}") from exc
    if not isinstance(data, dict):
        raise LayerError(f"{what}: unexpected JSON: {text[:200]!r}")
    errors = data.get("errors") or []
    if errors:
        raise LayerError(f"{what}: {errors}")
    return data


def expand_hostlist(expr: str) -> tuple[str, ...]:
    """``"n[1-3,5],x[01-02]-[a]"`` style hostlists to names (zero padding kept)."""
    names: list[str] = []
    for token in _split_top_level(expr):
        parts = re.split(r"(\[[^\]]*\])", token)
        choices: list[list[str]] = []
        for part in parts:
            if part.startswith("[") and part.endswith("]"):
                choices.append(_expand_range(part[1:-1]))
            elif part:
                choices.append([part])
        names.extend("".join(p) for p in itertools.product(*choices))
    return tuple(names)


def _split_top_level(expr: str) -> list[str]:
    out: list[str] = []
    depth = 0
    cur = ""
    for ch in expr.strip():
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            if cur:
                out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        out.append(cur)
    return out


def _expand_range(spec: str) -> list[str]:
    out: list[str] = []
    for item in spec.split(","):
        lo, sep, hi = item.partition("-")
        if not sep:
            out.append(lo)
            continue
        width = len(lo)
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def parse_sinfo_json(text: str) -> list[SlurmNode]:
    data = _load(text, "sinfo --json")
    nodes: list[SlurmNode] = []
    for n in data.get("nodes", []):
        features = str(n.get("active_features") or n.get("features") or "")
        nodes.append(
            SlurmNode(
                name=str(n["name"]),
                state=str(n.get("state", "unknown")).lower(),
                flags=frozenset(str(f).upper() for f in n.get("state_flags") or ()),
                reason=str(n.get("reason") or ""),
                reason_set_by=str(n.get("reason_set_by_user") or ""),
                gres=str(n.get("gres") or ""),
                gres_used=str(n.get("gres_used") or ""),
                features=tuple(f for f in features.split(",") if f),
                address=str(n.get("address") or ""),
                slurmd_start_time=int(n.get("slurmd_start_time") or 0),
            )
        )
    return nodes


def parse_squeue_json(text: str) -> list[SlurmJob]:
    data = _load(text, "squeue --json")
    return [
        SlurmJob(
            job_id=int(j["job_id"]),
            state=str(j.get("job_state", "")).upper(),
            reason=str(j.get("state_reason") or ""),
            nodes=expand_hostlist(str(j.get("nodes") or "")),
            user=str(j.get("user_name") or ""),
            restarts=int(j.get("restart_cnt") or 0),
            batch=bool(j.get("batch_flag")),
        )
        for j in data.get("jobs", [])
    ]


def parse_sacct_json(text: str) -> list[AccountedJob]:
    data = _load(text, "sacct --json")
    out: list[AccountedJob] = []
    for j in data.get("jobs", []):
        state = j.get("state") or {}
        code = (j.get("exit_code") or {}).get("return_code")
        out.append(
            AccountedJob(
                job_id=int(j["job_id"]),
                state=str(state.get("current", "") if isinstance(state, dict) else state),
                user=str(j.get("user") or ""),
                nodes=expand_hostlist(str(j.get("nodes") or "")),
                exit_code=int(code) if code is not None else None,
            )
        )
    return out


def active_jobs_on(jobs: list[SlurmJob], node_name: str) -> list[SlurmJob]:
    return [j for j in jobs if j.active and node_name in j.nodes]
