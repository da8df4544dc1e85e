"""GPU telemetry: the server's bounded history (core/telemetry.py) and the
simulated backend's samples (agent/gpus.py)."""

from __future__ import annotations

from pathlib import Path

from gpuclusters.agent.gpus import SimulatedGpus
from gpuclusters.core.telemetry import METRICS, GpuSample, TelemetryHistory


def _s(index: int, util: float) -> GpuSample:
    return GpuSample(index, util, util / 10, 30 + util / 2)


def test_history_is_bounded_ordered_and_columnar() -> None:
    h = TelemetryHistory(max_samples=3)
    for t in range(5):
        h.record("n1", float(t), [_s(1, t), _s(0, 10 * t)])
    h.record("n1", 2.0, [_s(0, 99)])  # older than the last: ignored
    series = h.series("n1")
    assert series["t"] == [2.0, 3.0, 4.0]  # only the last three
    assert series["gpus"] == [0, 1]
    assert series["utilization_pct"] == [[20, 30, 40], [2, 3, 4]]
    assert set(METRICS) <= set(series)
    # A GPU missing from a sample is a gap, not a shifted column.
    h.record("n1", 5.0, [_s(0, 50)])
    assert h.series("n1")["utilization_pct"][1][-1] is None
    assert h.series("other") == {"t": [], "gpus": [], **{m: [] for m in METRICS}}
    h.forget("n1")
    assert len(h) == 0


def test_nodes_not_heard_from_are_forgotten() -> None:
    h = TelemetryHistory(forget_after_s=100)
    h.record("gone", 0.0, [_s(0, 1)])
    h.record("alive", 50.0, [_s(0, 1)])
    h.record("alive", 120.0, [_s(0, 2)])
    assert h.series("gone")["t"] == [] and h.series("alive")["t"] == [50.0, 120.0]
    assert len(h) == 1


def test_sample_from_a_heartbeat() -> None:
    d = {"index": 2, "utilization_pct": 51, "memory_used_gib": "40.5", "temperature_c": 60}
    assert GpuSample.from_dict(d) == GpuSample(2, 51.0, 40.5, 60.0)


def test_simulated_samples_are_plausible_and_follow_present_gpus(tmp_path: Path) -> None:
    for i in range(8):
        (tmp_path / f"nvidia{i}").touch()
    gpus = SimulatedGpus("H100_SXM", dev_dir=tmp_path, node_id="node-a")
    samples = gpus.telemetry(now=1_000_000.0)
    assert [s.index for s in samples] == list(range(8))
    for s in samples:
        assert 0 <= s.utilization_pct <= 100
        assert 0 < s.memory_used_gib <= 80
        assert 30 <= s.temperature_c <= 75
    # Deterministic for a node and a time; different GPUs differ.
    assert gpus.telemetry(now=1_000_000.0) == samples
    assert len({s.utilization_pct for s in samples}) > 1
    # Over five minutes the load varies (a wave, not a constant).
    loads = {gpus.telemetry(now=1_000_000.0 + 30 * k)[0].utilization_pct for k in range(10)}
    assert max(loads) - min(loads) > 20
    # A GPU that falls off the bus reports nothing.
    (tmp_path / "nvidia3").unlink()
    assert 3 not in [s.index for s in gpus.telemetry(now=1_000_000.0)]
