"""``pagedkv.certify`` certifies servers as a black box: it imports none of the engine it
certifies (CRT-005), checked on every import statement of its source."""

from __future__ import annotations

import pytest
from test_layout import SRC, offences


@pytest.mark.spec("CRT-005")
def test_certify_imports_none_of_the_engine() -> None:
    paths = sorted((SRC / "certify").rglob("*.py"))
    assert len(paths) >= 10
    forbidden = (
        "pagedkv.engine",
        "pagedkv.kv",
        "pagedkv.store",
        "pagedkv.model",
        "pagedkv.backend",
        "pagedkv.accel",
        "pagedkv.entrypoints",
        "pagedkv.testing",
        "pagedkv.interfaces",
    )
    assert offences(paths, forbidden) == []
