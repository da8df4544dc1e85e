"""Names shared by the API, the server and the node agent: the active
checks, which of them need a GPU, and the faults the embedded fleet can
simulate."""

from __future__ import annotations

ACTIVE_CHECKS = ("gpu-burn", "gpu-memory-bandwidth", "host-device", "nccl", "storage", "ib-write")
GPU_CHECKS = frozenset({"gpu-burn", "gpu-memory-bandwidth", "host-device", "nccl"})
FAULT_KINDS = ("xid", "ecc-dbe", "fell-off-bus", "thermal", "row-remap", "pcie-replay", "disk-ro")
