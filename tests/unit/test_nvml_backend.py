"""The NVML GPU backend against a stand-in ``pynvml`` module (no GPU here):
inventory from NVML's answers, a GPU that stops answering stays listed as
absent with its identity, and backend selection falls back to simulated."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest

from gpuclusters.agent.gpus import SimulatedGpus
from gpuclusters.agent.nvml import NvmlGpus, detect_backend


class FakeNvmlError(Exception):
    pass


def fake_nvml(count: int = 2, *, init_error: bool = False) -> Any:
    state: dict[str, Any] = {"lost": set(), "shutdown": False}
    m: Any = types.ModuleType("pynvml")
    m.NVMLError = FakeNvmlError
    m.state = state

    def init() -> None:
        if init_error:
            raise FakeNvmlError("NVML Shared Library Not Found")

    def handle(i: int) -> int:
        if i in state["lost"]:
            raise FakeNvmlError("GPU is lost")
        return i

    m.nvmlInit = init
    m.nvmlShutdown = lambda: state.update(shutdown=True)
    m.nvmlDeviceGetCount = lambda: count
    m.nvmlDeviceGetHandleByIndex = handle
    m.nvmlDeviceGetMinorNumber = lambda h: h + 4
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H200"
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        total=141 * 1024**3, used=(10 + h) * 1024**3
    )
    m.NVML_TEMPERATURE_GPU = 0
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=40 + h, memory=5)
    m.nvmlDeviceGetTemperature = lambda h, sensor: 50 + h if sensor == 0 else -1
    m.nvmlDeviceGetUUID = lambda h: f"GPU-0000000{h}-aaaa-bbbb-cccc-dddddddddddd"
    return m


def test_inventory_comes_from_nvml() -> None:
    gpus = NvmlGpus(fake_nvml(2), dev_dir=Path("/dev"))
    inv = gpus.inventory()
    assert [(g.index, g.name, g.memory_gib, g.device, g.present) for g in inv] == [
        (0, "NVIDIA H200", 141, "/dev/nvidia4", True),
        (1, "NVIDIA H200", 141, "/dev/nvidia5", True),
    ]
    assert inv[1].uuid == "GPU-00000001-aaaa-bbbb-cccc-dddddddddddd"


def test_a_gpu_that_stops_answering_is_absent_but_keeps_its_identity() -> None:
    nvml = fake_nvml(2)
    gpus = NvmlGpus(nvml)
    before = gpus.inventory()
    nvml.state["lost"].add(1)
    after = gpus.inventory()
    assert after[0] == before[0]
    assert after[1].present is False
    assert (after[1].uuid, after[1].device) == (before[1].uuid, before[1].device)
    gpus.close()
    assert nvml.state["shutdown"] is True


def test_telemetry_comes_from_nvml_and_skips_a_lost_gpu() -> None:
    nvml = fake_nvml(3)
    gpus = NvmlGpus(nvml)
    samples = gpus.telemetry()
    assert [(s.index, s.utilization_pct, s.memory_used_gib, s.temperature_c) for s in samples] == [
        (0, 40.0, 10.0, 50.0),
        (1, 41.0, 11.0, 51.0),
        (2, 42.0, 12.0, 52.0),
    ]
    nvml.state["lost"].add(1)
    assert [s.index for s in gpus.telemetry()] == [0, 2]


def test_detect_backend_prefers_nvml_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake_nvml(8))
    assert isinstance(detect_backend("H200_SXM", node_id="n1"), NvmlGpus)
    assert isinstance(detect_backend("H200_SXM", node_id="n1", choice="simulated"), SimulatedGpus)

    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake_nvml(init_error=True))
    assert isinstance(detect_backend("H100_SXM", node_id="n1"), SimulatedGpus)
    with pytest.raises(RuntimeError, match="NVML unavailable"):
        detect_backend("H100_SXM", choice="nvml")

    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake_nvml(0))
    assert isinstance(detect_backend("H100_SXM"), SimulatedGpus)
    with pytest.raises(RuntimeError, match="no GPU"):
        detect_backend("H100_SXM", choice="nvml")
    with pytest.raises(ValueError, match="auto, nvml or simulated"):
        detect_backend("H100_SXM", choice="cuda")
