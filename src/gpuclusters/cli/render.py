"""Output helpers: JSON for scripts, Rich tables for people.

``emit`` is the single switch between the two. JSON is written with plain
``typer.echo`` (no Rich wrapping or highlighting can corrupt it). Tables go
through a Rich console on stdout; when stdout is not a terminal the console is
made wide (unless ``COLUMNS`` says otherwise) so piped tables are not folded.
Empty lists print nothing on stdout and a short note on stderr, like kubectl.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime

from pydantic import BaseModel
from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

from gpuclusters.cli.context import OutputFormat, stderr_console
from gpuclusters.core.enums import ClusterStatus, NodePhase, VolumeStatus
from gpuclusters.core.models import Node

_PIPE_WIDTH = 200

_GOOD = frozenset(
    {ClusterStatus.READY, NodePhase.RUNNING, VolumeStatus.AVAILABLE, VolumeStatus.BOUND}
)
_BAD = frozenset({ClusterStatus.FAILED, NodePhase.FAILED})
_WARN = frozenset(
    {
        ClusterStatus.DEGRADED,
        ClusterStatus.PAUSED,
        ClusterStatus.SUSPENDED,
        ClusterStatus.DELETING,
        NodePhase.DRAINING,
        NodePhase.RELEASING,
        VolumeStatus.DELETING,
    }
)


def stdout_console() -> Console:
    width = None
    if not sys.stdout.isatty() and not os.environ.get("COLUMNS"):
        width = _PIPE_WIDTH
    return Console(highlight=False, width=width)


def to_jsonable(value: BaseModel | Sequence[BaseModel]) -> object:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return [item.model_dump(mode="json") for item in value]


def print_json(value: BaseModel | Sequence[BaseModel]) -> None:
    print(json.dumps(to_jsonable(value), indent=2), file=sys.stdout)


def emit(
    output: OutputFormat,
    value: BaseModel | Sequence[BaseModel],
    *,
    render: Callable[[], RenderableType],
    empty: str = "nothing found",
) -> None:
    """Print ``value`` as JSON, or ``render()`` as a table (``empty`` if no items)."""
    if output is OutputFormat.JSON:
        print_json(value)
    elif not isinstance(value, BaseModel) and not value:
        stderr_console().print(empty, style="dim")
    else:
        stdout_console().print(render())


def table(*columns: str) -> Table:
    """A borderless, kubectl-like table with the given upper-case headers."""
    t = Table(box=None, header_style="bold", pad_edge=False, show_edge=False)
    for column in columns:
        t.add_column(column, no_wrap=column in ("NAME", "STATUS", "PHASE"))
    return t


def details(rows: Iterable[tuple[str, RenderableType]]) -> Table:
    """Key/value view of one object."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for key, value in rows:
        grid.add_row(key, value)
    return grid


def state(value: ClusterStatus | NodePhase | VolumeStatus) -> Text:
    """A status or phase, coloured green (good), red (failed), yellow (attention)."""
    style = (
        "green"
        if value in _GOOD
        else "red"
        if value in _BAD
        else "yellow"
        if value in _WARN
        else ""
    )
    return Text(value.value, style=style)


def _aware(ts: datetime) -> datetime:
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)


def age(ts: datetime, *, now: datetime | None = None) -> str:
    """kubectl-style age: 42s, 5m, 3h12m, 2d4h."""
    seconds = max(0, int(((now or datetime.now(UTC)) - _aware(ts)).total_seconds()))
    if seconds < 60:
        return f"{seconds}s"
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if minutes < 60:
        return f"{minutes}m"
    if hours < 24:
        rest = minutes % 60
        return f"{hours}h{rest}m" if rest and hours < 10 else f"{hours}h"
    rest = hours % 24
    return f"{days}d{rest}h" if rest and days < 10 else f"{days}d"


def clock(ts: datetime) -> str:
    """Local wall-clock time of ``ts``."""
    return _aware(ts).astimezone().strftime("%Y-%m-%d %H:%M:%S")


def until(ts: datetime, *, now: datetime | None = None) -> str:
    """``2026-12-07 03:10:00 (in 42s)``, or ``(2m ago)`` once past."""
    now = now or datetime.now(UTC)
    when = _aware(ts)
    if when >= now:
        return f"{clock(ts)} (in {age(now, now=when)})"
    return f"{clock(ts)} ({age(when, now=now)} ago)"


def attempt_rows(
    *,
    retries: int,
    last_error: str | None,
    next_attempt_at: datetime | None,
    phase_deadline_at: datetime | None,
) -> list[tuple[str, RenderableType]]:
    """How the controllers are getting on with a node or cluster: failed
    attempts in a row, the last error, the next attempt and the deadline."""
    return [
        ("retries", str(retries)),
        ("last error", Text(last_error, style="red") if last_error else Text("-")),
        ("next attempt", until(next_attempt_at) if next_attempt_at else "-"),
        ("deadline", until(phase_deadline_at) if phase_deadline_at else "-"),
    ]


def optional(value: object) -> str:
    return "-" if value is None or value == "" else str(value)


def live_nodes(nodes: Iterable[Node]) -> list[Node]:
    return [n for n in nodes if n.phase is not NodePhase.DELETED]


def node_summary(nodes: Iterable[Node]) -> str:
    """``2/3 nodes running (1 booting)``; ``no nodes yet`` before the first."""
    live = live_nodes(nodes)
    if not live:
        return "no nodes yet"
    running = sum(1 for n in live if n.phase is NodePhase.RUNNING)
    others: dict[str, int] = {}
    for n in live:
        if n.phase is not NodePhase.RUNNING:
            others[n.phase.value] = others.get(n.phase.value, 0) + 1
    text = f"{running}/{len(live)} nodes running"
    if others:
        text += " (" + ", ".join(f"{count} {phase}" for phase, count in others.items()) + ")"
    return text
