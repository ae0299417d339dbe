"""A run's time budget split into parts (ENG-209): each part may run until its share is
spent, and one that finishes early leaves its time to the parts after it.

Part ``k`` of weights ``w`` ends at ``start + (deadline - start) x (w_1 + ... + w_k) / sum(w)``.
A part checks :meth:`Share.spent` between its units of work (a repetition, a row, an engine
step) and, once spent, stops and records what it left out (:func:`cut_note`), so a run that
would overrun says where, and what it measured before is kept. Times are seconds on the
``time.perf_counter`` clock.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class Share:
    """One part's share of a budget.

    Attributes:
        name: the part's name.
        deadline: when its share ends (``time.perf_counter`` seconds); ``None``: no budget.
    """

    name: str
    deadline: float | None

    def left(self, now: float | None = None) -> float:
        """Seconds left of the share (infinite without a budget, never below 0)."""
        if self.deadline is None:
            return math.inf
        return max(0.0, self.deadline - (time.perf_counter() if now is None else now))

    def spent(self, now: float | None = None) -> bool:
        """Whether the share's time is over."""
        return self.left(now) <= 0.0


def split(
    parts: Sequence[tuple[str, float]], start: float, deadline: float | None
) -> dict[str, Share]:
    """Each part's share of the time from ``start`` to ``deadline``, in proportion to its
    weight, cumulatively (see the module docstring); without a deadline, none ends.

    Raises:
        InvalidRequest: a weight that is not positive.
    """
    for name, weight in parts:
        if not weight > 0:
            raise InvalidRequest(f"the weight of part {name!r} must be > 0, got {weight}")
    total = sum(weight for _, weight in parts)
    shares: dict[str, Share] = {}
    so_far = 0.0
    for name, weight in parts:
        so_far += weight
        end = None if deadline is None else start + (deadline - start) * so_far / total
        shares[name] = Share(name, end)
    return shares


def cut_note(part: str, done: int, total: int, unit: str) -> str:
    """The note of a part cut by its share: what it measured and what it left out."""
    return (
        f"cut: {part} spent its share of the time budget after {done} of {total} {unit}; "
        "the rest was not measured"
    )
