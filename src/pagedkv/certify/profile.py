"""How much a certify run asks of a server: the quick profile and the full one (CRT-004)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Profile:
    """The sizes of a certify run.

    Attributes:
        name: ``quick`` or ``full``.
        page_sizes: page sizes whose boundaries the shared prefixes end around (tokens).
        new_tokens: tokens generated per greedy request.
        same_prompt_clients: clients sending one prompt at once.
        long_requests: concurrent long requests (meant to make a small server preempt).
        long_prompt_tokens: prompt length of each long request (meant to be prefilled in
            chunks).
        concurrency: requests in flight at once, at most.
        settle_s: seconds the KV usage gets to come back to idle after clients leave.
    """

    name: str
    page_sizes: tuple[int, ...]
    new_tokens: int
    same_prompt_clients: int
    long_requests: int
    long_prompt_tokens: int
    concurrency: int
    settle_s: float


QUICK = Profile(
    name="quick",
    page_sizes=(1, 16),
    new_tokens=8,
    same_prompt_clients=4,
    long_requests=4,
    long_prompt_tokens=96,
    concurrency=8,
    settle_s=5.0,
)

FULL = Profile(
    name="full",
    page_sizes=(1, 2, 4, 8, 16, 32, 64),
    new_tokens=32,
    same_prompt_clients=16,
    long_requests=16,
    long_prompt_tokens=384,
    concurrency=16,
    settle_s=15.0,
)
