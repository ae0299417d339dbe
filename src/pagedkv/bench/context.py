"""What every workload of a run shares: mode, thread count, checkpoints and a progress log."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

#: Environment variable overriding where generated benchmark checkpoints are cached.
CACHE_ENV = "PAGEDKV_BENCH_CACHE"


def default_cache_dir() -> Path:
    """``$PAGEDKV_BENCH_CACHE``, else ``~/.cache/pagedkv/bench``."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "pagedkv" / "bench"


@dataclass
class BenchContext:
    """Settings of one benchmark run.

    Attributes:
        quick: the short CI mode: smaller workloads, no 0.6B-shaped checkpoint, no plots.
        threads: torch intra-op threads for every system measured.
        device: where pagedkv and transformers run (``cpu`` or ``cuda``).
        cache_dir: where generated checkpoints are kept between runs.
        seed: seed of every workload's request generator.
        verbose: print progress lines to stderr.
        started: ``time.perf_counter()`` at the start of the run, seconds.
        deadline: when the run's time budget ends (``time.perf_counter()`` seconds), or
            ``None`` for no budget (ENG-209).
    """

    quick: bool
    threads: int
    device: str = "cpu"
    cache_dir: Path = field(default_factory=default_cache_dir)
    seed: int = 0
    verbose: bool = True
    started: float = field(default_factory=time.perf_counter)
    deadline: float | None = None

    def log(self, message: str) -> None:
        """Print a progress line, prefixed by the seconds elapsed since the run started."""
        if self.verbose:
            elapsed = time.perf_counter() - self.started
            print(f"[bench {elapsed:7.1f}s] {message}", file=sys.stderr, flush=True)
