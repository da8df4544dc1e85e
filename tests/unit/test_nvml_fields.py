"""The NVML backend's dcgm-exporter fields against a stand-in ``pynvml``
(no GPU here; the real path runs on GPU hosts): each field from the NVML
call DCGM makes for it, a call the GPU does not support leaves its field
out, a lost GPU is left out, and the last Xid health() saw is reported."""

from __future__ import annotations

import types
from typing import Any

from test_nvml_backend import FakeNvmlError, fake_nvml

from gpuclusters.agent.nvml import NvmlGpus


def _full(m: Any) -> Any:
    m.NVML_CLOCK_SM, m.NVML_CLOCK_MEM = 1, 2
    m.NVML_MEMORY_ERROR_TYPE_CORRECTED, m.NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 1
    m.NVML_VOLATILE_ECC = 0
    m.NVML_NVLINK_MAX_LINKS = 4
    m.NVML_NVLINK_ERROR_DL_CRC_FLIT = 2
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        total=141 * 1024**3, used=(10 + h) * 1024**3, free=(131 - h) * 1024**3
    )
    m.nvmlDeviceGetPowerUsage = lambda h: 350_500 + h  # mW
    m.nvmlDeviceGetTotalEnergyConsumption = lambda h: 9_000_000
    m.nvmlDeviceGetClockInfo = lambda h, clock: 1980 if clock == 1 else 2619
    m.nvmlDeviceGetTotalEccErrors = lambda h, kind, counter: 3 if kind == 0 else h
    m.nvmlDeviceGetPcieReplayCounter = lambda h: 7
    m.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: 0x40 if h == 1 else 0

    def nvlink(h: int, link: int, counter: int) -> int:
        if link >= 2:
            raise FakeNvmlError("Not Supported")  # a GPU with two links
        return 5

    m.nvmlDeviceGetNvLinkErrorCounter = nvlink
    m.nvmlEventSetCreate = lambda: object()
    m.nvmlDeviceRegisterEvents = lambda h, kinds, events: None
    m.nvmlEventTypeXidCriticalError = 8
    m.events = []

    def wait(events: Any, timeout: int) -> Any:
        if not m.events:
            raise FakeNvmlError("Timeout")
        return m.events.pop(0)

    m.nvmlEventSetWait_v2 = wait
    m.nvmlDeviceGetRemappedRows = lambda h: (0, 0, 0, 0)
    return m


def test_fields_come_from_nvml() -> None:
    m = _full(fake_nvml(2))
    gpus = NvmlGpus(m)
    f0, f1 = gpus.fields()
    assert (f0.index, f0.uuid, f0.device, f0.model) == (
        0, "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd", "nvidia4", "NVIDIA H200",
    )  # fmt: skip
    assert (f0.util_pct, f0.mem_copy_util_pct, f0.temp_c) == (40.0, 5.0, 50.0)
    assert (f0.fb_used_mib, f0.fb_free_mib) == (10 * 1024, 131 * 1024)
    assert f1.power_w == 350.501
    assert (f0.sm_clock_mhz, f0.mem_clock_mhz, f0.energy_mj) == (1980.0, 2619.0, 9_000_000.0)
    assert (f0.ecc_sbe_vol_total, f1.ecc_dbe_vol_total, f0.pcie_replay_total) == (3.0, 1.0, 7.0)
    assert f0.nvlink_crc_flit_errors_total == 10, "the links that answer, summed"
    assert (f0.throttle_reasons, f1.throttle_reasons) == (0, 0x40)
    assert f0.xid_last == 0


def test_unsupported_calls_leave_fields_out_and_a_lost_gpu_is_left_out() -> None:
    m = fake_nvml(2)  # no power, clocks, ECC, NVLink or throttle calls at all
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        total=141 * 1024**3, used=1024**3, free=140 * 1024**3
    )
    gpus = NvmlGpus(m)
    m.state["lost"].add(1)
    [f0] = gpus.fields()
    assert f0.util_pct == 40.0
    assert f0.power_w is None and f0.ecc_dbe_vol_total is None
    assert f0.nvlink_crc_flit_errors_total is None and f0.throttle_reasons is None


def test_the_last_xid_health_saw_is_reported() -> None:
    m = _full(fake_nvml(2))
    gpus = NvmlGpus(m)
    handle = m.nvmlDeviceGetHandleByIndex(1)
    m.events += [types.SimpleNamespace(device=handle, eventData=31),
                 types.SimpleNamespace(device=handle, eventData=43)]  # fmt: skip
    gpus.health()  # drains the events, as the heartbeat does
    f0, f1 = gpus.fields()
    assert (f0.xid_last, f1.xid_last) == (0, 43)
