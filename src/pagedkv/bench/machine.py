"""Describe the machine a run measured: CPU, cores, load, library versions."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else ``platform.processor()``)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    """CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def physical_cores() -> int:
    """Physical cores this process may run on (hyper-threads of one core counted once).

    From ``/proc/cpuinfo``'s ``physical id`` and ``core id`` of the usable processors on Linux;
    elsewhere, or when those fields are absent, the usable logical CPUs.
    """
    cpuinfo = Path("/proc/cpuinfo")
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if usable is None or not cpuinfo.is_file():
        return usable_cores()
    cores: set[tuple[str, str]] = set()
    for block in cpuinfo.read_text(encoding="utf-8", errors="replace").split("\n\n"):
        fields = dict(
            (key.strip(), value.strip())
            for key, _, value in (line.partition(":") for line in block.splitlines())
        )
        if "processor" not in fields or int(fields["processor"]) not in usable:
            continue
        if "core id" not in fields:
            return usable_cores()
        cores.add((fields.get("physical id", "0"), fields["core id"]))
    return len(cores) or usable_cores()


#: CPU features that decide which matrix kernels run (AVX-512, its bfloat16 dot products, AMX).
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_flags() -> list[str]:
    """Which of :data:`KERNEL_FLAGS` the CPU reports (``/proc/cpuinfo``; empty elsewhere)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return []
    for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("flags"):
            present = set(line.split(":", 1)[1].split())
            return [flag for flag in KERNEL_FLAGS if flag in present]
    return []


def load_average() -> list[float] | None:
    """1, 5 and 15-minute load averages, or ``None`` where the platform has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info(threads: int) -> dict[str, Any]:
    """The machine section of results.json (load is sampled again at the end of a run)."""
    import transformers

    return {
        "cpu_model": cpu_model(),
        "cores": usable_cores(),
        "physical_cores": physical_cores(),
        "cpu_flags": cpu_flags(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "torch_threads": threads,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_average_start": load_average(),
    }
