"""Typed errors of pagedkv.

Every contract violation raises one of these, never a sentinel value or a bare ``assert``.
A call that raises has changed nothing (see KVM-001): callers may catch and retry.
"""

from __future__ import annotations

from typing import Any


class PagedKVError(Exception):
    """Base class of every error pagedkv raises on purpose.

    Every one crosses a process boundary whole (SRV-142): pickled, it comes back as the same
    class with the same message and attributes, whatever its ``__init__`` takes (an
    exception's default pickling calls ``__init__`` with its message alone, which fails for
    those that take other arguments).
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return _restore_error, (type(self), self.args, dict(self.__dict__))


def _restore_error(
    cls: type[PagedKVError], args: tuple[object, ...], state: dict[str, object]
) -> PagedKVError:
    """``cls`` with ``args`` and ``state``, built without calling its ``__init__``."""
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class InvalidRequest(PagedKVError, ValueError):
    """An argument is out of its documented range (negative count, bad page size, ...)."""


class RequestTooLong(InvalidRequest):
    """A request that could never fit: past ``max_model_len`` or the whole page pool (ENG-033)."""


class UnsupportedPriority(InvalidRequest):
    """A request priority other than 0 given to an engine that does not schedule by priority
    (ENG-189), as vLLM refuses it."""


class StaleMatch(InvalidRequest):
    """``allocate`` was given a prefix match that no longer describes the manager: taken by
    another manager, for another prompt or salt, or before a state change since (KVM-035)."""


class OutOfPages(PagedKVError):
    """An allocation needs more pages than are free or evictable right now.

    Attributes:
        needed: pages the allocation would have taken.
        available: pages that were free or evictable for it.
    """

    def __init__(self, needed: int, available: int) -> None:
        super().__init__(f"allocation needs {needed} pages but only {available} are available")
        self.needed = needed
        self.available = available


class UnknownSequence(PagedKVError, KeyError):
    """The sequence id was never allocated (or was freed long enough ago to be forgotten)."""

    def __init__(self, seq_id: int) -> None:
        super().__init__(f"unknown sequence id {seq_id}")
        self.seq_id = seq_id

    def __str__(self) -> str:
        return str(self.args[0])


class DoubleFree(UnknownSequence):
    """The sequence id was already freed: its pages were returned once and only once."""

    def __str__(self) -> str:
        return f"sequence id {self.seq_id} was already freed"


class DuplicateSequence(PagedKVError):
    """A sequence id is allocated while it still holds pages."""

    def __init__(self, seq_id: int) -> None:
        super().__init__(f"sequence id {seq_id} is already allocated")
        self.seq_id = seq_id


class PagesInUse(PagedKVError):
    """An operation that needs an idle pool (prefix-cache reset) found pages held by sequences."""

    def __init__(self, pages_in_use: int) -> None:
        super().__init__(f"{pages_in_use} pages are still held by sequences")
        self.pages_in_use = pages_in_use


class InvariantViolation(PagedKVError):
    """``check_invariants`` found the manager's state inconsistent: a bug in the backend."""


class CheckpointError(PagedKVError):
    """A model directory is missing a file, a tensor or a config field, or has the wrong shape."""


class UnsupportedModel(CheckpointError):
    """The checkpoint's architecture or a config option is not one pagedkv implements."""


class RunnerFailed(PagedKVError):
    """The model runner can run no further step: the engine ends with this error rather than
    retrying (TP-022). Every later step raises it again."""


class WorkerFailed(RunnerFailed):
    """A tensor-parallel worker died or stopped answering within the collective timeout.

    Attributes:
        rank: the rank that failed, when it is known.
        exitcode: its process's exit code (negative: killed by that signal), when this process
            started it and it has exited.
    """

    def __init__(self, message: str, rank: int | None = None, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
