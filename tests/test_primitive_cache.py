"""ENG-197: oneDNN's caches of per-shape products are capped, so memory does not grow with
every new shape a runner runs.

The caches read their capacity once per process, at oneDNN's first primitive: each case that
runs products runs in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pagedkv.accel.cpu.primitive_cache import (
    CAPACITY_VARIABLES,
    PRIMITIVE_CACHE_CAPACITY,
    cap_primitive_caches,
)
from pagedkv.assets import has_default_model

#: Products of one packed weight with 100 row counts not seen before, after a warm-up; the
#: resident memory they add, in bytes, with oneDNN's caches capped at 8 primitives or at their
#: defaults (1024).
PRODUCTS = """
import json, os, sys, torch
from pagedkv.accel.cpu.onednn import onednn_linear, onednn_pack
from pagedkv.accel.cpu.primitive_cache import cap_primitive_caches

if sys.argv[1] == "capped":
    cap_primitive_caches(8)

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

packed = onednn_pack(torch.randn(512, 256))
for rows in range(1, 17):
    onednn_linear(torch.randn(rows, 256), packed)
start = resident()
for rows in range(17, 117):
    onednn_linear(torch.randn(rows, 256), packed)
print(json.dumps(resident() - start))
"""

#: The capacities a process has once its first runner is built on the embedded model.
RUNNER = """
import json, os
from pagedkv.accel.cpu.primitive_cache import CAPACITY_VARIABLES
from pagedkv.assets import default_model_dir
from pagedkv.engine.runner import ModelRunner

ModelRunner.from_model_dir(default_model_dir(), num_pages=8, page_size=16)
print(json.dumps({name: os.environ.get(name) for name in CAPACITY_VARIABLES}))
"""


def _run(code: str, *args: str, env: dict[str, str] | None = None) -> object:
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
        env=env,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _clean_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in CAPACITY_VARIABLES}


@pytest.mark.spec("ENG-197")
def test_capping_sets_what_the_operator_did_not() -> None:
    """Catches a cap that overrides the operator's value, misses one of the two caches (each
    keeps its primitives alive on its own), or takes a capacity of 0 (ideep needs one)."""
    env = {"LRU_CACHE_CAPACITY": "7"}
    capacities = cap_primitive_caches(environ=env)
    assert env == {
        "LRU_CACHE_CAPACITY": "7",
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(PRIMITIVE_CACHE_CAPACITY),
    }
    assert capacities.values == env
    assert capacities.kept == frozenset({"LRU_CACHE_CAPACITY"})
    assert cap_primitive_caches(3, environ=env).values == env  # idempotent: set once
    with pytest.raises(ValueError, match="at least 1"):
        cap_primitive_caches(0, environ={})


@pytest.mark.spec("ENG-197")
@pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(),  # type: ignore[no-untyped-call]
    reason="torch has no oneDNN",
)
def test_capped_caches_stop_memory_growing_with_shapes() -> None:
    """Catches caches left at their defaults, or capped after oneDNN read them: every new row
    count then keeps its primitive, about 0.6 MB here, and 200 of them grow the process by
    over 50 MB."""
    env = _clean_environment()
    capped = _run(PRODUCTS, "capped", env=env)
    default = _run(PRODUCTS, "default", env=env)
    assert isinstance(capped, int)
    assert isinstance(default, int)
    assert default > 30 << 20, (capped, default)
    assert capped < default / 3, (capped, default)


@pytest.mark.spec("ENG-197")
@pytest.mark.skipif(not has_default_model(), reason="the embedded default model is not built")
def test_a_cpu_runner_caps_the_caches_before_its_first_product() -> None:
    """Catches a runner that does not cap the caches (a server's memory then grows with every
    prompt length it sees), and one that overrides a capacity the operator started it with."""
    env = _clean_environment()
    capacity = str(PRIMITIVE_CACHE_CAPACITY)
    assert _run(RUNNER, env=env) == dict.fromkeys(CAPACITY_VARIABLES, capacity)
    chosen = _run(RUNNER, env={**env, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "2048"})
    assert chosen == {
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "2048",
        "LRU_CACHE_CAPACITY": capacity,
    }
