"""The vLLM table of ``conformance/README.md`` is no older than the KVManager suite.

``make conformance-vllm`` runs the suite's KV modules on vLLM's manager and writes the table
(it needs vLLM, which ``make test`` does not install). A test added to the suite after the
table was written, or an expected failure declared since, would leave the table describing
another suite, as happened when the suite's showcase failed unnoticed. So, without vLLM: every
test of the KV modules the run covers is named in the table's list of tests run, the list
names no test the suite no longer has, and every test vLLM's declared variants make fail is in
the table's failing tests. When this fails, run ``make conformance-vllm`` and commit the table.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

from pagedkv_conformance.suite_kv_manager import KVManagerSuite
from pagedkv_conformance.suite_kv_match import KVMatchSuite
from pagedkv_conformance.test_kv_state_machine import KVStateMachineSuite
from pagedkv_conformance.test_kv_variants import KVVariantSuite
from pagedkv_conformance.variants import declared_variants, expected_failures

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "conformance" / "README.md"
#: The example's declarations: plain data, loadable without vLLM.
VLLM_VARIANTS = ROOT / "examples" / "vllm_backend" / "pagedkv_vllm" / "variants.py"
BEGIN, END = "<!-- vllm-conformance:begin", "<!-- vllm-conformance:end -->"
#: The test classes of the modules ``make conformance-vllm`` runs (``pagedkv_vllm.run``), by
#: name, and the suites they run (imported as suites, so that pytest collects none here).
RUN_CLASSES: dict[str, type] = {
    "TestKVManager": KVManagerSuite,
    "TestKVMatch": KVMatchSuite,
    "TestKVVariants": KVVariantSuite,
    "TestKVStateMachine": KVStateMachineSuite,
}


def _section() -> str:
    text = README.read_text(encoding="utf-8")
    return text[text.index(BEGIN) : text.index(END)]


def _suite_tests() -> set[str]:
    """``Class::test`` of every test the covered modules hold now."""
    return {
        f"{name}::{test}"
        for name, suite in RUN_CLASSES.items()
        for test in dir(suite)
        if test.startswith("test_")
    }


def _vllm_variants() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_vllm_variants", VLLM_VARIANTS)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_the_table_names_every_test_of_the_suite() -> None:
    """The list of tests run equals the covered modules' tests today."""
    match = re.search(r"^Suite tests run \((\d+)\): (.*)\.$", _section(), re.MULTILINE)
    assert match, "the vLLM table has no list of the tests it ran: run make conformance-vllm"
    listed = set(re.findall(r"`([^`]+)`", match.group(2)))
    assert int(match.group(1)) == len(listed)
    newer = sorted(_suite_tests() - listed)
    assert not newer, f"tests newer than the vLLM table: {newer}; run make conformance-vllm"
    gone = sorted(listed - _suite_tests())
    assert not gone, f"the vLLM table names tests the suite no longer has: {gone}"


class _Declaring:
    """A backend's declarations, for :func:`declared_variants`."""

    def __init__(self, variants: dict[str, str]) -> None:
        self.variants = variants


def test_the_table_shows_every_declared_expected_failure() -> None:
    """Each test vLLM's declared variants make fail, on either backend, is among the table's
    failing tests."""
    variants = _vllm_variants()
    failing_rows = set(re.findall(r"^\| `([^`]+)` \|", _section(), re.MULTILINE))
    covered = _suite_tests()
    for declared in (variants.SCHEDULED_VARIANTS, variants.DEFERRED_VARIANTS):
        for node_id in expected_failures(declared_variants(_Declaring(declared))):
            name = node_id.partition("::")[2]
            if name in covered:
                assert name in failing_rows, f"{name} ({declared}) is not in the vLLM table"
