"""Token-id prompts built to stress paging (CRT-010, CRT-012), drawn from a seeded generator so
every run sends the same ones."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: Tokens after the shared prefix that make each prompt of a pair its own.
TAIL_TOKENS = 3


@dataclass(frozen=True, slots=True)
class PromptPair:
    """Two prompts sharing a prefix that ends near a page boundary.

    Attributes:
        page_size: the page size whose boundary the prefix ends around.
        prefix_tokens: the shared prefix's length: a multiple of ``page_size``, or one less or
            one more.
        first: the prompt sent first (its pages may be cached).
        second: the prompt sent after it (it may reuse the first's pages).
    """

    page_size: int
    prefix_tokens: int
    first: tuple[int, ...]
    second: tuple[int, ...]


class PromptSource:
    """Seeded random token ids, never a special token.

    Args:
        vocab_size: ids are drawn below it.
        special_ids: ids never drawn (they may be skipped in texts).
        seed: the generator's seed.
    """

    def __init__(self, vocab_size: int, special_ids: Sequence[int], seed: int = 20) -> None:
        self._allowed = torch.tensor([i for i in range(vocab_size) if i not in set(special_ids)])
        self._generator = torch.Generator().manual_seed(seed)

    def tokens(self, count: int) -> tuple[int, ...]:
        """``count`` random ordinary token ids."""
        picks = torch.randint(0, len(self._allowed), (count,), generator=self._generator)
        return tuple(int(self._allowed[i]) for i in picks)

    def boundary_pairs(self, page_sizes: Sequence[int]) -> list[PromptPair]:
        """For each page size ``p``, three pairs whose shared prefix is ``2p - 1``, ``2p`` and
        ``2p + 1`` tokens long: ending one before, at and one after a page boundary."""
        pairs = []
        for page_size in page_sizes:
            for offset in (-1, 0, 1):
                length = 2 * page_size + offset
                prefix = self.tokens(length)
                pairs.append(
                    PromptPair(
                        page_size,
                        length,
                        prefix + self.tokens(TAIL_TOKENS),
                        prefix + self.tokens(TAIL_TOKENS),
                    )
                )
        return pairs
