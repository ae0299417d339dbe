"""TorchPagedStore.copy_pages: a fork's partial page becomes the new sequence's own (PST-006),
and the model runner makes a plan's copies before the step writes anything."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import StoreConfig
from pagedkv.store.paged_store import TorchPagedStore

CONFIG = StoreConfig(num_layers=3, num_kv_heads=2, head_dim=4, page_size=4, num_pages=6)
CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is false"
)


def filled_store(device: str = "cpu") -> TorchPagedStore:
    """A store whose every slot of every layer holds distinct random K and V."""
    store = TorchPagedStore(dataclasses.replace(CONFIG, device=device))
    slots = torch.arange(CONFIG.num_pages * CONFIG.page_size, device=device)
    generator = torch.Generator().manual_seed(0)
    for layer in range(CONFIG.num_layers):
        shape = (len(slots), CONFIG.num_kv_heads, CONFIG.head_dim)
        key = torch.randn(shape, generator=generator).to(device)
        value = torch.randn(shape, generator=generator).to(device)
        store.write(layer, slots, key, value)
    return store


def pages(store: TorchPagedStore) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every page's K and V of every layer, ``[(key, value)]`` by page, on the CPU."""
    size = CONFIG.page_size
    out = []
    for page in range(CONFIG.num_pages):
        slots = torch.arange(page * size, (page + 1) * size)
        reads = [store.read(layer, slots) for layer in range(CONFIG.num_layers)]
        out.append(
            (torch.stack([k for k, _ in reads]).cpu(), torch.stack([v for _, v in reads]).cpu())
        )
    return out


@pytest.mark.spec("PST-006")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_copy_pages_copies_every_layer_and_nothing_else(device: str) -> None:
    store = filled_store(device)
    before = pages(store)
    store.copy_pages(torch.tensor([1, 4], device=device), torch.tensor([3, 0], device=device))
    after = pages(store)
    expected = {3: 1, 0: 4}
    for page in range(CONFIG.num_pages):
        source = before[expected.get(page, page)]
        assert torch.equal(after[page][0], source[0]), page
        assert torch.equal(after[page][1], source[1]), page


@pytest.mark.spec("PST-006")
def test_a_swap_reads_the_pages_as_they_were() -> None:
    """Sources are read before any target is written."""
    store = filled_store()
    before = pages(store)
    store.copy_pages(torch.tensor([2]), torch.tensor([5]))
    store.copy_pages(torch.tensor([5, 2]), torch.tensor([1, 0]))
    after = pages(store)
    assert torch.equal(after[1][0], before[2][0])
    assert torch.equal(after[0][0], before[2][0])


@pytest.mark.spec("PST-006")
@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ([1, 2], [3]),  # lengths differ
        ([6], [0]),  # source outside the pool
        ([0], [-1]),  # target outside the pool
        ([1, 2], [3, 3]),  # a target twice
        ([1, 2], [2, 3]),  # a target among the sources
        ([[1]], [[2]]),  # not 1-D
    ],
)
def test_bad_copies_raise_and_change_nothing(src: list[int], dst: list[int]) -> None:
    store = filled_store()
    before = pages(store)
    with pytest.raises(InvalidRequest):
        store.copy_pages(torch.tensor(src), torch.tensor(dst))
    after = pages(store)
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        for a, b in zip(after, before, strict=True)
    )
