"""The reference's in-flight tracker checks itself (KVM-031, KVM-036): ``check_invariants``
finds a tree whose counts disagree with the sequences it tracks, and a track left behind by a
freed sequence. The suite sees only healthy managers; these corrupt the reference on purpose."""

from __future__ import annotations

import pytest

from pagedkv.errors import InvariantViolation
from pagedkv.interfaces import KVManagerConfig
from pagedkv.kv.in_flight import InFlightPages
from pagedkv.kv.manager import ReferenceKVManager

PROMPT = list(range(1, 10))  # two full pages of 4, and one token


def tracker() -> InFlightPages:
    pages = InFlightPages(4)
    pages.open(1, PROMPT, None, 0)
    pages.open(2, PROMPT, None, 0)
    return pages


@pytest.mark.spec("KVM-031", "KVM-036")
def test_a_healthy_tree_checks_clean_and_counts() -> None:
    pages = tracker()
    assert pages.check({1, 2}) == []
    assert pages.count(PROMPT, None, 0, 2) == 2
    pages.committed(2, 1)
    pages.close(1)
    assert pages.check({2}) == []
    assert pages.count(PROMPT, None, 0, 2) == 0  # the first page is committed: counting stops
    assert pages.count(PROMPT, None, 1, 2) == 1


@pytest.mark.spec("KVM-036")
def test_the_tree_empties_once_every_page_is_committed() -> None:
    """A sequence whose last in-flight page is committed leaves the tracker at once, not when it
    is freed: once every prompt is computed (while decoding) the tree is empty and a lookup
    costs one dict probe."""
    pages = tracker()
    pages.committed(1, 2)
    assert len(pages) == 1
    pages.committed(2, 1)
    pages.committed(2, 2)
    assert len(pages) == 0
    assert not pages._roots
    assert pages.check({1, 2}) == []


@pytest.mark.spec("KVM-031", "KVM-036")
def test_a_miscounted_page_is_found() -> None:
    pages = tracker()
    root = next(iter(pages._roots.values()))
    first = next(iter(root.children.values()))
    second = next(iter(first.children.values()))
    second.in_flight = 1  # two sequences still compute it
    problems = pages.check({1, 2})
    assert len(problems) == 1
    assert "in-flight page (5, 6, 7, 8)" in problems[0]
    assert "1 in flight, its tracks 2" in problems[0]


@pytest.mark.spec("KVM-031", "KVM-036")
def test_a_freed_sequence_left_in_the_tree_is_found() -> None:
    assert tracker().check({1}) == ["freed sequence 2 still has pages in flight"]


@pytest.mark.spec("KVM-031")
def test_check_invariants_raises_on_a_corrupted_tracker() -> None:
    kv = ReferenceKVManager(KVManagerConfig(8, 4))
    kv.allocate(1, PROMPT, len(PROMPT))
    kv.check_invariants()
    root = next(iter(kv.in_flight._roots.values()))
    next(iter(root.children.values())).holders += 1
    with pytest.raises(InvariantViolation, match="in-flight page"):
        kv.check_invariants()
