"""``capacity=auto``: measure this node's device and map it to a submodel share gamma.

The probe measures two things on the device the node trains on:

* memory: the device's total memory (CUDA: ``torch.cuda.mem_get_info``; CPU and
  MPS: physical RAM, capped by the container's cgroup limit, which is what a
  ``docker run --memory`` or compose ``mem_limit`` sets);
* throughput: sustained float32 matrix-multiply speed in GFLOP/s over about
  ``probe_seconds`` seconds (512x512 products, the shape of the layers' work).

The rule (:func:`capacity_from_probe`) takes the smaller of the two ratios to
reference figures, ``memory / reference_memory_gib`` and ``gflops /
reference_gflops``, caps it at 1, and rounds it *down* to a power of two between
1/16 and 1. Rounding down keeps a node's share on a short ladder (1, 1/2, ...,
1/16) so that nodes of similar hardware get the same submodel, and never above
what was measured. The references (8 GiB, 200 GFLOP/s: a recent 8-core x86
server) get gamma 1; a Raspberry Pi 4 class board (4 GiB, ~5 GFLOP/s) gets 1/16.

The result is cached in the node's cache folder (``FIBOS_CACHE_DIR``) because
Flower starts a fresh ClientApp process for every message and a node's
capacity must not drift between rounds.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REFERENCE_MEMORY_GIB = 8.0
REFERENCE_GFLOPS = 200.0
MIN_CAPACITY = 1.0 / 16.0


@dataclass(frozen=True)
class DeviceProbe:
    """What the probe measured.

    Parameters
    ----------
    device : str
        Torch device the probe ran on (``cpu``, ``cuda:0``, ``mps``).
    memory_gib : float
        Memory available to the node on that device, in GiB.
    gflops : float
        Sustained float32 matrix-multiply throughput, in GFLOP/s.
    capacity : float
        The share of the model :func:`capacity_from_probe` assigns, in [1/16, 1].
    """

    device: str
    memory_gib: float
    gflops: float
    capacity: float


def capacity_from_probe(
    memory_gib: float,
    gflops: float,
    reference_memory_gib: float = REFERENCE_MEMORY_GIB,
    reference_gflops: float = REFERENCE_GFLOPS,
) -> float:
    """Map measured memory (GiB) and throughput (GFLOP/s) to gamma in {1, 1/2, 1/4, 1/8, 1/16}.

    gamma = 2^floor(log2(min(1, memory/reference_memory, gflops/reference_gflops))),
    clamped to at least 1/16 (the smallest submodel the product trains).
    """
    for name, value in (("memory_gib", memory_gib), ("gflops", gflops)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive finite number, got {value}")
    ratio = min(1.0, memory_gib / reference_memory_gib, gflops / reference_gflops)
    return max(MIN_CAPACITY, 2.0 ** math.floor(math.log2(ratio) + 1e-9))


def _cgroup_limit_bytes() -> float:
    """The container's memory limit (cgroup v2, then v1); ``inf`` when unlimited or unknown."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            return float(text)
    return math.inf


def device_memory_gib(device: torch.device) -> float:
    """Memory the node may use on ``device``, in GiB."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1] / 2**30
    physical = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return min(physical, _cgroup_limit_bytes()) / 2**30


def matmul_gflops(device: torch.device, probe_seconds: float = 0.5, n: int = 512) -> float:
    """Sustained float32 ``n x n`` matrix-multiply throughput on ``device``, in GFLOP/s."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device)
    b = torch.randn(n, n, generator=gen).to(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elif device.type == "mps":
            torch.mps.synchronize()

    for _ in range(3):  # warm-up: kernels, caches, clocks
        a @ b
    sync()
    reps, start = 0, time.perf_counter()
    while True:
        for _ in range(8):
            a @ b
        reps += 8
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= probe_seconds:
            return 2.0 * n**3 * reps / elapsed / 1e9


def probe_device(device: torch.device, probe_seconds: float = 0.5) -> DeviceProbe:
    """Measure ``device`` and assign a capacity (see the module docstring for the rule)."""
    memory = device_memory_gib(device)
    gflops = matmul_gflops(device, probe_seconds)
    return DeviceProbe(str(device), memory, gflops, capacity_from_probe(memory, gflops))


def cached_probe(device: torch.device, cache_dir: Path, probe_seconds: float = 0.5) -> DeviceProbe:
    """:func:`probe_device`, measured once per node and device and then read from ``cache_dir``."""
    path = cache_dir / f"capacity-probe-{str(device).replace(':', '-')}.json"
    try:
        return DeviceProbe(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    probe = probe_device(device, probe_seconds)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(probe)))
    os.replace(tmp, path)
    return probe
