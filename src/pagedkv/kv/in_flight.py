"""Prompt pages that live sequences are computing but have not committed yet (KVM-036).

A sequence's prompt pages are *in flight* from its allocation until it commits them: their
K/V are being written, so they cannot be hit (KVM-021), but a request sharing them is better
off waiting a step than computing them a second time (ENG-026). This tracker answers "how many
of this prompt's pages, after its cached ones, are in flight?" in one walk of the prompt, whatever
the number and length of the live sequences: a tree of page token ids per salt, each node counting
the sequences that still have to commit that page.

Only sequences with pages still in flight are in the tree, so when every prompt is computed (the
steady state of decoding) it is empty and a lookup costs one dict probe.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class _Node:
    """One full page of the prompts of some live sequences.

    Attributes:
        key: the page's token ids (its key in the parent's children).
        children: the next page, by its token ids.
        holders: sequences whose tracked prompt goes through this page.
        in_flight: of those, sequences that have not committed it yet.
    """

    key: tuple[int, ...]
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    holders: int = 0
    in_flight: int = 0


@dataclass(slots=True)
class _Track:
    """One live sequence's path in the tree: its prompt's full pages, ``nodes[first:]`` in
    flight."""

    salt: str | None
    nodes: list[_Node]
    first: int


class InFlightPages:
    """The in-flight prompt pages of live sequences, by content.

    Args:
        page_size: token positions per page.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._roots: dict[str | None, _Node] = {}
        self._tracks: dict[int, _Track] = {}

    def __len__(self) -> int:
        """Sequences with pages in flight."""
        return len(self._tracks)

    def open(
        self, seq_id: int, token_ids: Sequence[int], salt: str | None, num_committed: int
    ) -> None:
        """Track a new sequence whose first ``num_committed`` pages are committed (its hits):
        its prompt's later full pages are in flight."""
        size = self.page_size
        num_full = len(token_ids) // size
        if num_full <= num_committed:
            return
        node = self._roots.setdefault(salt, _Node(()))
        nodes: list[_Node] = []
        for i in range(num_full):
            key = tuple(token_ids[i * size : (i + 1) * size])
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(key)
            child.holders += 1
            if i >= num_committed:
                child.in_flight += 1
            nodes.append(child)
            node = child
        self._tracks[seq_id] = _Track(salt, nodes, num_committed)

    def committed(self, seq_id: int, num_committed: int) -> None:
        """The sequence's first ``num_committed`` pages are committed: no longer in flight."""
        track = self._tracks.get(seq_id)
        if track is None:
            return
        end = min(num_committed, len(track.nodes))
        for node in track.nodes[track.first : end]:
            node.in_flight -= 1
        track.first = max(track.first, end)
        if track.first == len(track.nodes):
            self.close(seq_id)

    def close(self, seq_id: int) -> None:
        """Stop tracking the sequence (freed, done, or no longer publishing): none of its pages
        is in flight any more."""
        track = self._tracks.pop(seq_id, None)
        if track is None:
            return
        for node in track.nodes[track.first :]:
            node.in_flight -= 1
        root = self._roots[track.salt]
        parents = [root, *track.nodes[:-1]]
        for parent, node in zip(reversed(parents), reversed(track.nodes), strict=True):
            node.holders -= 1
            if node.holders == 0:
                del parent.children[node.key]
        if not root.children:
            del self._roots[track.salt]

    def count(
        self, token_ids: Sequence[int], salt: str | None, first_page: int, max_pages: int
    ) -> int:
        """How many of the prompt's pages ``first_page, first_page + 1, ...`` (below
        ``max_pages``) are in flight in some live sequence, counted until the first that is not.
        """
        node = self._roots.get(salt)
        size = self.page_size
        count = 0
        for i in range(max_pages):
            if node is None:
                break
            node = node.children.get(tuple(token_ids[i * size : (i + 1) * size]))
            if i < first_page:
                continue
            if node is None or node.in_flight == 0:
                break
            count += 1
        return count

    def check(self, live: Collection[int]) -> list[str]:
        """Inconsistencies between the tracks, the tree's counts and the ``live`` sequence ids
        (for ``check_invariants``)."""
        problems = [
            f"freed sequence {s} still has pages in flight" for s in self._tracks if s not in live
        ]
        holders: Counter[_Node] = Counter()
        in_flight: Counter[_Node] = Counter()
        for track in self._tracks.values():
            holders.update(track.nodes)
            in_flight.update(track.nodes[track.first :])
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            for child in node.children.values():
                if (child.holders, child.in_flight) != (holders[child], in_flight[child]):
                    problems.append(
                        f"in-flight page {child.key} counts {child.holders} holders and "
                        f"{child.in_flight} in flight, its tracks {holders[child]} and "
                        f"{in_flight[child]}"
                    )
                stack.append(child)
        return problems
