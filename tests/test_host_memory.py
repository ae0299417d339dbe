"""ENG-114: once freed memory is retained, large temporaries stop page-faulting.

Each case runs in a fresh interpreter: the thresholds are the process's and cannot be put
back, and the pattern must meet glibc's defaults first.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedkv.engine.host_memory import can_retain_freed_memory

#: A layer's worth of temporaries, as a 16-bit decode step makes them: two 8 MB 16-bit
#: gathers, their float32 copies (16 MB each) and a sum, all freed; minor page faults per
#: round, before and after ``retain_freed_memory``.
PROBE = """
import json, resource, torch
from pagedkv.engine.host_memory import retain_freed_memory

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def rounds(n=10):
    for _ in range(3):
        one()
    start = faults()
    for _ in range(n):
        one()
    return (faults() - start) / n

def one():
    k = torch.ones(4 << 20, dtype=torch.bfloat16)
    v = torch.ones(4 << 20, dtype=torch.bfloat16)
    (k.float() + v.float()).sum()

before = rounds()
retained = retain_freed_memory()
print(json.dumps({"before": before, "retained": retained, "after": rounds()}))
"""


@pytest.mark.spec("ENG-114")
@pytest.mark.skipif(not can_retain_freed_memory(), reason="the C library is not glibc")
def test_retained_memory_is_not_faulted_in_again() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120
    )
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["retained"] is True
    # glibc's defaults give the freed blocks back: thousands of pages a round.
    assert figures["before"] > 2_000, figures
    assert figures["after"] < 100, figures
