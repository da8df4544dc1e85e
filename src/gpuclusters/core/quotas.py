"""Project quotas (docs/users.md "Quotas"): what a project may hold at once,
set by organization admins, and the check every create, scale and resize
makes before it changes anything. Pure: the caller counts the use.

A quota of ``None`` is no limit. A change is refused when it would take the
use *above* the limit; a project already above a lowered limit keeps what it
has, and can only shrink (a scale down or a delete is never refused).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

# The quotas, in the order they are checked and shown, with their words.
WHAT = {
    "standard_gpus": "standard GPUs",
    "preemptible_gpus": "preemptible GPUs",
    "clusters": "clusters",
    "volume_tib": "TiB of volumes",
}


@dataclass(frozen=True, slots=True)
class Amounts:
    standard_gpus: int = 0
    preemptible_gpus: int = 0
    clusters: int = 0
    volume_tib: int = 0


@dataclass(frozen=True, slots=True)
class Limits:
    standard_gpus: int | None = None
    preemptible_gpus: int | None = None
    clusters: int | None = None
    volume_tib: int | None = None


@dataclass(frozen=True, slots=True)
class Excess:
    quota: str  # a field name of Limits
    limit: int
    use: int
    wanted: int  # what the use would become

    @property
    def message(self) -> str:
        what = WHAT[self.quota]
        return (
            f"quota {self.quota} exceeded: the project may hold {self.limit} {what}, "
            f"holds {self.use}, and this would make it {self.wanted}"
        )


def excess(limits: Limits, use: Amounts, add: Amounts) -> Excess | None:
    """The first quota ``add`` on top of ``use`` would exceed; None if none.
    Only growth is checked: a quota already exceeded does not refuse a
    change that does not grow that amount."""
    for f in fields(Limits):
        limit = getattr(limits, f.name)
        grow = getattr(add, f.name)
        if limit is None or grow <= 0:
            continue
        now = getattr(use, f.name)
        if now + grow > limit:
            return Excess(quota=f.name, limit=limit, use=now, wanted=now + grow)
    return None
