"""``python -m pagedkv_bench.isolated NAME RESULT [options]``: one workload of the project's
table in a fresh interpreter (SRV-049; see :mod:`pagedkv.bench.isolated`)."""

from __future__ import annotations

import sys

from pagedkv.bench.isolated import main
from pagedkv_bench.workloads import PROJECT_WORKLOADS

if __name__ == "__main__":
    sys.exit(main(table=PROJECT_WORKLOADS))
