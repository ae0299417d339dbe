"""Test-process settings that must precede every import of the code under test.

Triton decides when a kernel is defined (at the import of its module) whether it runs under
its interpreter; on a machine without CUDA the Triton kernels of ``pagedkv.accel.cuda`` can run
only there, so the tests ask for it before any test module imports them (PST-047). Nothing
else in the suite imports triton (the CPU's ``torch.compile`` generates C++), so no other test
runs differently. A value set from outside (``TRITON_INTERPRET=0`` on a GPU machine) is kept.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
