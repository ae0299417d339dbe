"""K/V row gathers through a same-width integer view return exactly ``index_select``'s bits."""

from __future__ import annotations

import pytest
import torch

from pagedkv.store.gather import gather_rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gather_rows_is_index_select_bit_for_bit(dtype: torch.dtype) -> None:
    pool = torch.randn(64, 2, 8, generator=torch.Generator().manual_seed(0)).to(dtype)
    pool[3, 0, 0] = float("nan")
    pool[5, 1, 2] = float("-inf")
    pool[7] = -0.0
    index = torch.tensor([7, 3, 3, 0, 63, 5])
    got = gather_rows(pool, index)
    want = pool.index_select(0, index)
    assert got.dtype == dtype
    assert got.shape == want.shape
    width = {1: torch.int8, 2: torch.int16, 4: torch.int32}[pool.element_size()]
    assert torch.equal(got.view(width), want.view(width))


def test_gather_rows_refuses_an_index_out_of_range() -> None:
    with pytest.raises(IndexError):
        gather_rows(torch.zeros(4, 2, dtype=torch.bfloat16), torch.tensor([4]))
