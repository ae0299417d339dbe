"""``python -m pagedkv``: the ``pagedkv`` command line."""

from __future__ import annotations

import sys

from pagedkv.entrypoints.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
