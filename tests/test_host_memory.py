"""ENG-114: once freed memory is retained, large temporaries stop page-faulting.

Each case runs in a fresh interpreter: the thresholds are the process's and cannot be put
back, and the pattern must meet glibc's defaults first.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedkv.accel.cpu.host_memory import can_retain_freed_memory

#: A layer's worth of temporaries, as a 16-bit decode step makes them: two 16-bit gathers,
#: their float32 copies and a sum, all freed; minor page faults per round, before and after
#: ``retain_freed_memory``. The blocks are 8 and 16 MB, and 20 and 40 MB where the mmap
#: threshold set is above them.
PROBE = """
import json, resource, sys, torch
from pagedkv.accel.cpu.host_memory import retain_freed_memory

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def rounds(elements, n=10):
    def one():
        k = torch.ones(elements, dtype=torch.bfloat16)
        v = torch.ones(elements, dtype=torch.bfloat16)
        (k.float() + v.float()).sum()
    for _ in range(3):
        one()
    start = faults()
    for _ in range(n):
        one()
    return (faults() - start) / n

small, large = 4 << 20, 10 << 20
before = {"small": rounds(small), "large": rounds(large)}
threshold = retain_freed_memory()
after = {"small": rounds(small), "large": rounds(large) if threshold > 64 << 20 else None}
print(json.dumps({"before": before, "threshold": threshold, "after": after}))
"""


@pytest.mark.spec("ENG-114")
@pytest.mark.skipif(not can_retain_freed_memory(), reason="the C library is not glibc")
def test_retained_memory_is_not_faulted_in_again() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120
    )
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["threshold"] >= 32 << 20
    # Under glibc's defaults the 40 MB blocks, above its largest dynamic mmap threshold (32 MB),
    # are mapped afresh every round: tens of thousands of pages. (Whether the smaller ones
    # fault depends on the heap's layout.) Retained, most rounds fault none.
    faulted = figures["before"]["large"]
    assert faulted > 10_000, figures
    for after in figures["after"].values():
        if after is not None:
            assert after < faulted / 10, figures
