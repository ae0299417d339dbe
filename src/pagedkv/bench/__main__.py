"""``python -m pagedkv.bench``: run the benchmarks (see :mod:`pagedkv.bench.cli`)."""

from __future__ import annotations

import sys

from pagedkv.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
