"""Static catalog of GPU types we know: memory and the figures health checks
compare against. Hosts may only declare a GPU type from this catalog."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuTypeSpec:
    name: str
    memory_gib: int
    # Dense BF16 matmul TFLOPS one GPU should reach in a burn test.
    expected_bf16_tflops: float


GPU_TYPES: dict[str, GpuTypeSpec] = {
    spec.name: spec
    for spec in (
        GpuTypeSpec("H100_SXM", 80, 700.0),
        GpuTypeSpec("H200_SXM", 141, 700.0),
        GpuTypeSpec("B200_SXM", 180, 1500.0),
        GpuTypeSpec("A100_SXM", 80, 250.0),
    )
}
