"""Active health checks, run on a node: ``python -m gpuclusters.agent.checks
CHECK [--duration S] [--gpu-type T] [--thresholds JSON]`` prints one JSON
result ``{check, state, reason, metrics, output}`` where state is
``passed``, ``failed`` or ``skipped``.

GPU checks use PyTorch where it is installed and a GPU is visible, and end
``skipped`` with the reason ``no GPU`` otherwise:

* ``gpu-burn``: BF16 matmuls on every GPU for ``--duration`` seconds;
  TFLOPS per GPU must reach the GPU type's expected figure (scaled by
  ``burn_fraction``) and be within 10% of the node's best GPU.
* ``gpu-memory-bandwidth``: device-to-device copies, GB/s per GPU.
* ``host-device``: pinned host<->device copies (GB/s) and small-copy
  latency (ns); contract thresholds >= 30 GB/s and <= 2000 ns.
* ``nccl``: single-node all-reduce over every GPU with
  ``torch.distributed`` (NCCL), bus bandwidth >= 300 GB/s.

Node checks:

* ``storage``: sequential write and read throughput of local NVMe
  (``/scratch``) with ``fio`` when installed; otherwise a documented
  fallback: a 1 GiB file written in 16 MiB blocks with ``fsync``, dropped
  from the page cache (``posix_fadvise(DONTNEED)``) and read back.
  Contract thresholds: read >= 10 GiB/s, write >= 5 GiB/s.
* ``ib-write``: ``ib_write_bw`` (perftest) against the node's own HCA where
  InfiniBand devices and the tool exist, >= 320 Gb/s; skipped otherwise.

Thresholds are overridable per call (the server passes its per-GPU-type
settings).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpuclusters.core.catalog import GPU_TYPES
from gpuclusters.core.health.catalog import ACTIVE_CHECKS, GPU_CHECKS

DEFAULT_THRESHOLDS: dict[str, float] = {
    "burn_fraction": 0.7,  # of the GPU type's expected BF16 TFLOPS
    "burn_spread": 0.10,  # within 10% of the node's best GPU
    "h2d_gbps": 30.0,
    "latency_ns": 2000.0,
    "nccl_busbw_gbps": 300.0,
    "storage_read_gibps": 10.0,
    "storage_write_gibps": 5.0,
    "ib_write_gbps": 320.0,
    "memory_bandwidth_gbps": 1500.0,
}


def result(
    check: str,
    state: str,
    reason: str = "",
    metrics: dict[str, Any] | None = None,
    output: str = "",
) -> dict[str, Any]:
    return {
        "check": check,
        "state": state,
        "reason": reason,
        "metrics": metrics or {},
        "output": output[-20000:],
    }


def _torch() -> Any | None:
    try:
        import torch  # type: ignore[import-not-found]
    except ImportError:
        return None
    return torch if torch.cuda.is_available() and torch.cuda.device_count() > 0 else None


def gpu_burn(torch: Any, duration: float, gpu_type: str, t: dict[str, float]) -> dict[str, Any]:
    n = 8192
    per_gpu: dict[str, float] = {}
    for i in range(torch.cuda.device_count()):
        dev = torch.device("cuda", i)
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        torch.matmul(a, b)
        torch.cuda.synchronize(dev)
        iters, start = 0, time.perf_counter()
        while time.perf_counter() - start < duration / torch.cuda.device_count():
            for _ in range(10):
                torch.matmul(a, b)
            torch.cuda.synchronize(dev)
            iters += 10
        elapsed = time.perf_counter() - start
        per_gpu[str(i)] = round(2 * n**3 * iters / elapsed / 1e12, 1)
    best = max(per_gpu.values())
    spec = GPU_TYPES.get(gpu_type)
    floor = spec.expected_bf16_tflops * t["burn_fraction"] if spec else 0.0
    slow = {i: v for i, v in per_gpu.items() if v < floor or v < best * (1 - t["burn_spread"])}
    metrics = {"tflops_per_gpu": per_gpu, "best_tflops": best, "floor_tflops": floor}
    if slow:
        return result("gpu-burn", "failed", f"GPU(s) {', '.join(sorted(slow))} too slow", metrics)
    return result("gpu-burn", "passed", metrics=metrics)


def memory_bandwidth(torch: Any, t: dict[str, float]) -> dict[str, Any]:
    per_gpu = {}
    size = 1 << 30
    for i in range(torch.cuda.device_count()):
        dev = torch.device("cuda", i)
        src = torch.empty(size, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        dst.copy_(src)
        torch.cuda.synchronize(dev)
        start = time.perf_counter()
        for _ in range(20):
            dst.copy_(src)
        torch.cuda.synchronize(dev)
        per_gpu[str(i)] = round(2 * size * 20 / (time.perf_counter() - start) / 1e9, 1)
    low = [i for i, v in per_gpu.items() if v < t["memory_bandwidth_gbps"]]
    metrics = {"gbps_per_gpu": per_gpu}
    if low:
        return result("gpu-memory-bandwidth", "failed", f"GPU(s) {', '.join(low)} slow", metrics)
    return result("gpu-memory-bandwidth", "passed", metrics=metrics)


def host_device(torch: Any, t: dict[str, float]) -> dict[str, Any]:
    size = 256 << 20
    host = torch.empty(size, dtype=torch.uint8).pin_memory()
    h2d: dict[str, float] = {}
    d2h: dict[str, float] = {}
    lat: dict[str, float] = {}
    for i in range(torch.cuda.device_count()):
        dev = torch.device("cuda", i)
        buf = torch.empty(size, dtype=torch.uint8, device=dev)
        for name in ("h2d", "d2h"):
            src, dst = (host, buf) if name == "h2d" else (buf, host)
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(dev)
            start = time.perf_counter()
            for _ in range(10):
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(dev)
            (h2d if name == "h2d" else d2h)[str(i)] = round(
                size * 10 / (time.perf_counter() - start) / 1e9, 1
            )
        small_h = torch.empty(4, dtype=torch.uint8).pin_memory()
        small_d = torch.empty(4, dtype=torch.uint8, device=dev)
        start = time.perf_counter()
        for _ in range(1000):
            small_d.copy_(small_h)
            torch.cuda.synchronize(dev)
        lat[str(i)] = round((time.perf_counter() - start) / 1000 * 1e9)
    metrics = {"h2d_gbps": h2d, "d2h_gbps": d2h, "latency_ns": lat}
    bad = [i for i in h2d if min(h2d[i], d2h[i]) < t["h2d_gbps"] or lat[i] > t["latency_ns"]]
    if bad:
        return result("host-device", "failed", f"GPU(s) {', '.join(bad)} below threshold", metrics)
    return result("host-device", "passed", metrics=metrics)


NCCL_WORKER = r"""
import os, sys, time, json
import torch, torch.distributed as dist
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", rank=rank, world_size=world)
x = torch.ones(256 << 20, dtype=torch.float32, device="cuda")
for _ in range(5):
    dist.all_reduce(x)
torch.cuda.synchronize()
iters, start = 20, time.perf_counter()
for _ in range(iters):
    dist.all_reduce(x)
torch.cuda.synchronize()
elapsed = (time.perf_counter() - start) / iters
algbw = x.numel() * 4 / elapsed / 1e9
if rank == 0:
    print(json.dumps({"busbw_gbps": round(algbw * 2 * (world - 1) / world, 1),
                      "algbw_gbps": round(algbw, 1)}))
dist.destroy_process_group()
"""


def nccl(torch: Any, t: dict[str, float]) -> dict[str, Any]:
    world = torch.cuda.device_count()
    if world < 2:
        return result("nccl", "skipped", "fewer than 2 GPUs")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", WORLD_SIZE=str(world))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", NCCL_WORKER],
            env=dict(env, RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        return result("nccl", "failed", "a worker failed", output="\n".join(outs))
    metrics = json.loads(outs[0].strip().splitlines()[-1])
    if metrics["busbw_gbps"] < t["nccl_busbw_gbps"]:
        return result("nccl", "failed", "bus bandwidth below threshold", metrics)
    return result("nccl", "passed", metrics=metrics)


def storage(scratch: Path, t: dict[str, float], size_mib: int = 1024) -> dict[str, Any]:
    if shutil.which("fio"):
        return _fio(scratch, t, size_mib)
    block = 16 << 20
    data = os.urandom(block)
    with tempfile.NamedTemporaryFile(dir=scratch, prefix=".gpc-storage-", delete=False) as f:
        path = Path(f.name)
    try:
        start = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
        try:
            for _ in range(size_mib * (1 << 20) // block):
                os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        write_s = time.perf_counter() - start
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            while os.read(fd, block):
                pass
            read_s = time.perf_counter() - start
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    gib = size_mib / 1024
    metrics = {
        "method": "python fallback (fio not installed)",
        "write_gibps": round(gib / write_s, 2),
        "read_gibps": round(gib / read_s, 2),
        "size_mib": size_mib,
    }
    return _storage_verdict(metrics, t)


def _fio(scratch: Path, t: dict[str, float], size_mib: int) -> dict[str, Any]:
    metrics: dict[str, Any] = {"method": "fio"}
    out = []
    for rw in ("write", "read"):
        r = subprocess.run(
            [
                "fio",
                "--name=gpc",
                f"--directory={scratch}",
                f"--rw={rw}",
                "--bs=1M",
                f"--size={size_mib}M",
                "--direct=1",
                "--numjobs=4",
                "--group_reporting",
                "--output-format=json",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        out.append(r.stdout[-4000:] + r.stderr[-2000:])
        if r.returncode != 0:
            return result("storage", "failed", f"fio {rw} failed", metrics, "\n".join(out))
        job = json.loads(r.stdout)["jobs"][0][rw]
        metrics[f"{rw}_gibps"] = round(job["bw_bytes"] / (1 << 30), 2)
    return _storage_verdict(metrics, t, "\n".join(out))


def _storage_verdict(
    metrics: dict[str, Any], t: dict[str, float], output: str = ""
) -> dict[str, Any]:
    low = []
    if metrics["read_gibps"] < t["storage_read_gibps"]:
        low.append(f"read {metrics['read_gibps']} < {t['storage_read_gibps']} GiB/s")
    if metrics["write_gibps"] < t["storage_write_gibps"]:
        low.append(f"write {metrics['write_gibps']} < {t['storage_write_gibps']} GiB/s")
    if low:
        return result("storage", "failed", "; ".join(low), metrics, output)
    return result("storage", "passed", metrics=metrics, output=output)


def ib_write(t: dict[str, float]) -> dict[str, Any]:
    devices = sorted(p.name for p in Path("/sys/class/infiniband").glob("*"))
    if not devices:
        return result("ib-write", "skipped", "no InfiniBand device")
    if not shutil.which("ib_write_bw"):
        return result("ib-write", "skipped", "ib_write_bw (perftest) not installed")
    server = subprocess.Popen(
        ["ib_write_bw", "-d", devices[0], "--report_gbits"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    time.sleep(1)
    client = subprocess.run(
        ["ib_write_bw", "-d", devices[0], "--report_gbits", "127.0.0.1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    server.wait(timeout=30)
    lines = [ln.split() for ln in client.stdout.splitlines() if ln.strip()[:1].isdigit()]
    if client.returncode != 0 or not lines:
        return result(
            "ib-write", "failed", "ib_write_bw failed", output=client.stdout + client.stderr
        )
    gbps = float(lines[-1][3])
    metrics = {"bw_gbps": gbps, "device": devices[0]}
    if gbps < t["ib_write_gbps"]:
        return result("ib-write", "failed", "below threshold", metrics, client.stdout)
    return result("ib-write", "passed", metrics=metrics, output=client.stdout)


def run(
    check: str,
    *,
    duration: float,
    gpu_type: str,
    thresholds: dict[str, float],
    scratch: Path = Path("/scratch"),
) -> dict[str, Any]:
    t = {**DEFAULT_THRESHOLDS, **thresholds}
    if check not in ACTIVE_CHECKS:
        return result(check, "failed", f"unknown check; known: {', '.join(ACTIVE_CHECKS)}")
    try:
        if check in GPU_CHECKS:
            torch = _torch()
            if torch is None:
                return result(check, "skipped", "no GPU")
            if check == "gpu-burn":
                return gpu_burn(torch, duration, gpu_type, t)
            if check == "gpu-memory-bandwidth":
                return memory_bandwidth(torch, t)
            if check == "host-device":
                return host_device(torch, t)
            return nccl(torch, t)
        if check == "storage":
            return storage(scratch, t)
        return ib_write(t)
    except Exception as exc:  # a check that crashes has failed, with the reason
        return result(check, "failed", f"{type(exc).__name__}: {exc}")


def main() -> None:
    parser = argparse.ArgumentParser(description="Run one active health check; print JSON.")
    parser.add_argument("check", choices=ACTIVE_CHECKS)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--gpu-type", default="")
    parser.add_argument("--thresholds", default="{}", help="JSON overrides")
    parser.add_argument("--scratch", default="/scratch")
    args = parser.parse_args()
    out = run(
        args.check,
        duration=args.duration,
        gpu_type=args.gpu_type,
        thresholds=json.loads(args.thresholds),
        scratch=Path(args.scratch),
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
