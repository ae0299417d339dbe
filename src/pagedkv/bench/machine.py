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
        "torch_threads": threads,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_average_start": load_average(),
    }
