"""Torch at one thread for each test of a module that imports the fixture: the tensor-parallel
tests run several processes on the machine's cores, which oversubscribe them otherwise."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Run the test with ``torch.set_num_threads(1)``, restoring the count after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
