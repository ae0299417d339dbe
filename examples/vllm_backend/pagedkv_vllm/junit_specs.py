"""A pytest plugin recording each test's requirement IDs in the JUnit XML report.

Load it with ``-p pagedkv_vllm.junit_specs``: every test carrying ``@pytest.mark.spec(...)``
gets a ``spec`` property (the IDs, space-separated), which :mod:`pagedkv_vllm.report` reads to
tell which requirements a passing or failing test speaks for.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        ids = [str(i) for marker in item.iter_markers("spec") for i in marker.args]
        if ids:
            item.user_properties.append(("spec", " ".join(dict.fromkeys(ids))))
