"""What every check is given: the server's client, the reference, the served model's name and
the profile."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, TypeVar

from pagedkv.certify.client import ServerClient
from pagedkv.certify.profile import Profile
from pagedkv.certify.reference import Reference
from pagedkv.certify.verdicts import CheckResult

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class CertifyContext:
    """The run's shared inputs; checks read it and change nothing of it.

    Attributes:
        client: requests to the server.
        reference: the checkpoint run by transformers.
        model: the name requests give as ``model``.
        profile: the run's sizes.
        fresh_seed: drawn anew for every run: the seed of prompts that must be new to the
            server (a prefix cache check cannot reuse a prompt an earlier run sent).
    """

    client: ServerClient
    reference: Reference
    model: str
    profile: Profile
    fresh_seed: int

    def in_parallel(self, work: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """``work`` on every item, at most ``profile.concurrency`` at once; results in order."""
        if not items:
            return []
        with ThreadPoolExecutor(max_workers=min(self.profile.concurrency, len(items))) as pool:
            return list(pool.map(work, items))


class Check(Protocol):
    """A check of a server: its name, the spec IDs it certifies, the capability it needs."""

    name: str
    spec_ids: tuple[str, ...]
    capability: str

    def run(self, context: CertifyContext) -> CheckResult: ...
