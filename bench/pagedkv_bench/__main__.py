"""``python -m pagedkv_bench``: the project's benchmark run (see :mod:`pagedkv_bench.cli`)."""

from __future__ import annotations

import sys

from pagedkv_bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
