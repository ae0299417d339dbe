"""The server's start-up heap is kept out of the collector's scans (SRV-140)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from pagedkv.entrypoints.server.startup_heap import freeze_startup_heap


@pytest.fixture
def thawed() -> Iterator[None]:
    """Automatic collections off while the test runs (so that only the code under test
    collects), and every frozen object given back to the generations after it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()


def _tracked(target: object) -> bool:
    return any(obj is target for generation in range(3) for obj in gc.get_objects(generation))


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.mark.spec("SRV-140")
def test_what_start_up_built_is_in_no_generation(thawed: None) -> None:
    """Catches the freeze left out: the start-up heap would stay in the oldest generation,
    scanned by every full collection."""
    kept = [object()]  # a list is tracked by the collector
    assert _tracked(kept)
    assert freeze_startup_heap() > 0
    assert not _tracked(kept)


@pytest.mark.spec("SRV-140")
def test_start_ups_garbage_is_collected_not_frozen(thawed: None) -> None:
    """Catches a freeze without the collection before it: the start-up's unreachable cycles
    would be frozen, never to be freed."""
    node = _Node()
    gone = weakref.ref(node)
    del node
    assert gone() is not None  # unreachable, but only a collection frees a cycle
    freeze_startup_heap()
    assert gone() is None


@pytest.mark.spec("SRV-140")
def test_serve_freezes_once_the_app_is_built_and_before_it_serves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Catches ``pagedkv serve`` not freezing, or freezing before the engine and app exist
    (they would stay in the generations, scanned)."""
    from pagedkv.entrypoints.cli import serve
    from pagedkv.entrypoints.cli.main import main
    from pagedkv.entrypoints.server import app, http

    calls: list[str] = []

    class Served:
        def __init__(self, *_: Any) -> None:
            pass

        def run(self, **_: Any) -> None:
            calls.append("serve")

    monkeypatch.setattr(serve, "load_engine", lambda *_: calls.append("load") or object())
    monkeypatch.setattr(app, "create_app", lambda *_, **__: calls.append("app") or object())
    monkeypatch.setattr(http, "Server", Served)
    monkeypatch.setattr(serve, "freeze_startup_heap", lambda: calls.append("freeze") or 1)
    assert main(["serve", "--port", "0"]) == 0
    assert calls == ["load", "app", "freeze", "serve"]
