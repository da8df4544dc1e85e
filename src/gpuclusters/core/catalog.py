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
    # SkyPilot's name for it, as the `skypilot.co/accelerator` node label
    # wants it: lowercase, `--gpus H100:8` matching `h100` (docs/ecosystem/skypilot.md).
    skypilot_accelerator: str


GPU_TYPES: dict[str, GpuTypeSpec] = {
    spec.name: spec
    for spec in (
        GpuTypeSpec("H100_SXM", 80, 700.0, "h100"),
        GpuTypeSpec("H200_SXM", 141, 700.0, "h200"),
        GpuTypeSpec("B200_SXM", 180, 1500.0, "b200"),
        # SkyPilot's catalog tells the 80 GB A100 from the 40 GB one;
        # `--gpus A100:8` still matches `A100-80GB` (its prefix rule).
        GpuTypeSpec("A100_SXM", 80, 250.0, "a100-80gb"),
    )
}
