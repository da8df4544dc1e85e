"""GPU telemetry from node agents' heartbeats, and the bounded history the
server keeps of it for the console's charts (pure: no I/O).

Each heartbeat carries one sample per GPU (utilisation %, memory used GiB,
temperature °C). The server keeps the last ``MAX_SAMPLES`` heartbeats per
node in memory (about 30 minutes at the agents' 5 s interval): enough to
see a job start or a GPU heat up, bounded however long the server runs,
and gone on restart by design (it is a view, not a record; health alerts
and runs are the record). ``series`` turns a node's history into the
column layout uPlot draws: timestamps, then one column per GPU.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

MAX_SAMPLES = 360
# A node not heard from for this long (deleted, or its host gone) is
# forgotten, so the history stays bounded in nodes too, not only per node.
FORGET_AFTER_S = 3600.0
METRICS = ("utilization_pct", "memory_used_gib", "temperature_c")
# NVML's clocks-event-reason bits for thermal slowdown (software 0x20 and
# hardware 0x40): the metrics' DCGM_FI_DEV_CLOCK_THROTTLE_REASONS and the
# alert on throttling look for these.
THERMAL_THROTTLE_MASK = 0x20 | 0x40


@dataclass(frozen=True, slots=True)
class GpuSample:
    index: int
    utilization_pct: float
    memory_used_gib: float
    temperature_c: float

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GpuSample:
        return cls(
            index=int(d["index"]),
            utilization_pct=float(d["utilization_pct"]),
            memory_used_gib=float(d["memory_used_gib"]),
            temperature_c=float(d["temperature_c"]),
        )


class TelemetryHistory:
    """The last ``max_samples`` heartbeats' GPU samples of every node."""

    def __init__(
        self, max_samples: int = MAX_SAMPLES, forget_after_s: float = FORGET_AFTER_S
    ) -> None:
        self.max_samples = max_samples
        self.forget_after_s = forget_after_s
        self._nodes: dict[str, deque[tuple[float, tuple[GpuSample, ...]]]] = {}
        self._swept_at = 0.0

    def record(self, node_id: str, at: float, samples: list[GpuSample]) -> None:
        history = self._nodes.setdefault(node_id, deque(maxlen=self.max_samples))
        if history and at <= history[-1][0]:
            return  # a repeated or reordered heartbeat adds nothing
        history.append((at, tuple(sorted(samples, key=lambda s: s.index))))
        if at - self._swept_at >= self.forget_after_s / 10:
            self._swept_at = at
            cutoff = at - self.forget_after_s
            for stale in [n for n, h in self._nodes.items() if h[-1][0] < cutoff]:
                del self._nodes[stale]

    def forget(self, node_id: str) -> None:
        self._nodes.pop(node_id, None)

    def series(self, node_id: str) -> dict[str, Any]:
        """``{"t": [...], "gpus": [0, 1, ...], METRIC: [[gpu0...], [gpu1...]]}``;
        a GPU missing from a sample is ``None`` there (a gap in its line)."""
        history = list(self._nodes.get(node_id, ()))
        gpus = sorted({s.index for _, samples in history for s in samples})
        out: dict[str, Any] = {"t": [at for at, _ in history], "gpus": gpus}
        for metric in METRICS:
            columns: list[list[float | None]] = []
            for g in gpus:
                column: list[float | None] = []
                for _, samples in history:
                    hit = next((s for s in samples if s.index == g), None)
                    column.append(getattr(hit, metric) if hit is not None else None)
                columns.append(column)
            out[metric] = columns
        return out

    def __len__(self) -> int:
        return len(self._nodes)
