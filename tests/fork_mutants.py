"""Deliberately broken forks, each behind a backend factory, to prove the fork suite
(``pagedkv_conformance.test_kv_fork``, KVM-037..039) can fail.

Each mutant is the reference KVManager with one plausible bug in ``fork``; its
``check_invariants`` is blind, so the suite must see the bug through the Protocol alone.
``tests/test_fork_mutants.py`` runs the suite against each (``--backend fork_mutants:<name>``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedkv.interfaces import Fork, KVManager, KVManagerConfig
from pagedkv.kv.manager import ReferenceKVManager, SequenceState


class _Mutant(ReferenceKVManager):
    def check_invariants(self) -> None:
        """Blind, like the bug it hides."""


class SharePartialPage(_Mutant):
    """(a) the partial last page is shared like a full one: no copy, both write into it."""

    def fork(self, seq_id: int, new_seq_id: int) -> Fork:
        state = self._sequence(seq_id)
        for page in state.pages:
            self.pool.hold(page)
        self.sequences[new_seq_id] = SequenceState(list(state.pages), state.num_tokens, None)
        self._changed()
        return Fork(self.page_table(new_seq_id), ())


class ForgetHolders(_Mutant):
    """(b) the shared pages get no extra holder: freeing the parent frees pages the fork
    still holds."""

    def fork(self, seq_id: int, new_seq_id: int) -> Fork:
        counts = {p: self.pool.ref_count(p) for p in self._sequence(seq_id).pages}
        fork = super().fork(seq_id, new_seq_id)
        for page, count in counts.items():
            self.pool._ref_counts[page] = count
        return fork


class TakePageFirst(_Mutant):
    """(c) the copy's page is taken before the new id is checked: a refused fork leaks it."""

    def fork(self, seq_id: int, new_seq_id: int) -> Fork:
        state = self._sequence(seq_id)
        if state.num_tokens % self.page_size:
            self._take_fresh(1)
        return super().fork(seq_id, new_seq_id)


@dataclass(frozen=True)
class ForkMutantBackend:
    """A backend whose KVManager forks like one mutant."""

    name: str
    manager: type[ReferenceKVManager]
    capabilities: frozenset[str] = frozenset({"prefix_caching", "eviction", "reset", "fork"})

    def create_kv_manager(self, config: KVManagerConfig) -> KVManager:
        return self.manager(config)


def share_partial_page() -> ForkMutantBackend:
    return ForkMutantBackend("mutant: fork shares the partial page", SharePartialPage)


def forget_holders() -> ForkMutantBackend:
    return ForkMutantBackend("mutant: fork adds no holder", ForgetHolders)


def take_page_first() -> ForkMutantBackend:
    return ForkMutantBackend("mutant: fork takes its page before checking", TakePageFirst)


#: Every fork mutant factory, by the name ``--backend fork_mutants:<name>`` takes.
FORK_MUTANTS: dict[str, Callable[[], ForkMutantBackend]] = {
    f.__name__: f for f in (share_partial_page, forget_holders, take_page_first)
}
