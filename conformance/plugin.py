"""The pytest plugin of the pagedkv conformance suite.

Installed through the ``pytest11`` entry point, so pytest loads it in every run of an
environment where pagedkv is installed. It therefore stays cheap: the backend is imported only
when the run targets the suite (``--backend``, or ``pagedkv_conformance`` / ``conformance/``
among the arguments) or a collected test asks for a backend fixture.

What it provides:

* ``--backend module:factory`` (else ``$PAGEDKV_BACKEND``, else pagedkv's reference backend);
* the backend's declared ``variants`` (:mod:`pagedkv_conformance.variants`): the oracles
  follow them, and the tests a declared choice makes fail run as strict expected failures
  naming it;
* ``--pagedkv-xfail=FILE`` (else ``$PAGEDKV_XFAIL``): test node ids, one a line, run as
  strict expected failures (known bugs; a deliberate departure is declared as a variant);
* the markers ``spec(*ids)`` and ``requires(*capabilities)``; a test requiring a capability
  the backend does not declare is skipped, the reason naming the capability;
* the Hypothesis profiles ``ci`` and ``dev``, chosen by ``$PAGEDKV_HYPOTHESIS_PROFILE``;
* ``--device`` (else ``$PAGEDKV_DEVICE``, else ``cpu``) for the model tests;
* the fixtures ``backend``, ``backend_capabilities``, ``backend_variants``,
  ``make_kv_manager``, ``make_paged_store``, ``model_device`` and ``golden_checkpoints``.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pagedkv.interfaces import CAPABILITIES, Backend

from .loading import (
    BACKEND_ENV,
    DEFAULT_BACKEND,
    BackendKVManagerFactory,
    BackendLoadError,
    BackendPagedStoreFactory,
    MakeKVManager,
    MakePagedStore,
    load_backend,
)
from .variants import declared_variants, departures, expected_failures

#: Environment variable choosing the Hypothesis profile; see :func:`register_hypothesis_profiles`.
PROFILE_ENV = "PAGEDKV_HYPOTHESIS_PROFILE"
#: Environment variable naming the expected-failures file when ``--pagedkv-xfail`` is not given.
XFAIL_ENV = "PAGEDKV_XFAIL"
DEFAULT_PROFILE = "ci"
#: Fixtures whose use makes the plugin load the backend at collection time.
BACKEND_FIXTURES = frozenset(
    {"backend", "backend_capabilities", "backend_variants", "make_kv_manager", "make_paged_store"}
)

if TYPE_CHECKING:
    from .golden_harness import GoldenCheckpoints

_SUITE_DIR = Path(__file__).resolve().parent


def _register_assert_rewrite() -> None:
    """Let pytest rewrite the asserts of the suite's helper modules (the test modules are
    rewritten anyway), under the package name and under the folder's name, which is how
    pytest imports them from a source checkout."""
    packages = {__package__ or "pagedkv_conformance", _SUITE_DIR.name}
    names = [
        f"{package}.{path.stem}"
        for path in sorted(_SUITE_DIR.glob("*.py"))
        if path.stem not in {"__init__", "plugin", "loading", "variants", "page_sizes"}
        and not path.stem.startswith("test_")
        for package in sorted(packages)
    ]
    pytest.register_assert_rewrite(*names)


_register_assert_rewrite()


def register_hypothesis_profiles() -> None:
    """Register the suite's Hypothesis profiles: the one place their settings live.

    * ``ci``: bounded and derandomized, so a run is reproducible and the whole conformance
      suite stays well under a minute on a small machine;
    * ``mutation``: like ``ci`` with fewer examples and no shrinking, for ``make mutation``,
      which runs the tests once per mutant and needs a failure, not its smallest example;
    * ``dev``: ten times the examples and longer state-machine runs, randomized, with the
      example database, for hunting bugs locally.
    """
    from hypothesis import HealthCheck, Phase, settings

    settings.register_profile(
        "ci",
        max_examples=100,
        stateful_step_count=30,
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.register_profile(
        "mutation",
        max_examples=30,
        stateful_step_count=30,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # a failure is enough: no shrinking
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.register_profile(
        "dev",
        max_examples=400,
        stateful_step_count=60,
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow],
    )


@dataclass
class _PluginState:
    """What the plugin knows in one pytest run."""

    spec: str
    source: str
    backend: Backend | None = None
    xfail_file: Path | None = None
    xfail_ids: list[str] = field(default_factory=list)
    xfail_matched: set[str] = field(default_factory=set)

    def load(self) -> Backend:
        """The backend, imported and validated on first use."""
        if self.backend is None:
            try:
                self.backend = load_backend(self.spec)
            except BackendLoadError as exc:
                raise pytest.UsageError(f"pagedkv conformance ({self.source}): {exc}") from exc
        return self.backend


_STATE = pytest.StashKey[_PluginState]()


def _state(config: pytest.Config) -> _PluginState:
    return config.stash[_STATE]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pagedkv", "pagedkv conformance suite")
    group.addoption(
        "--backend",
        dest="pagedkv_backend",
        metavar="MODULE:FACTORY",
        default=None,
        help=(
            "backend the pagedkv conformance suite tests: a zero-argument factory returning a "
            f"pagedkv.interfaces.Backend (default: ${BACKEND_ENV}, else {DEFAULT_BACKEND})"
        ),
    )
    group.addoption(
        "--pagedkv-xfail",
        dest="pagedkv_xfail",
        metavar="FILE",
        default=None,
        help=(
            "file of test node ids, one a line ('#' comments), run as strict expected failures "
            f"(default: ${XFAIL_ENV}); write --pagedkv-xfail=FILE, with '='"
        ),
    )
    group.addoption(
        "--device",
        dest="pagedkv_device",
        metavar="DEVICE",
        default=None,
        help="torch device the model tests run on, e.g. cpu or cuda (default: $PAGEDKV_DEVICE, "
        "else cpu)",
    )


def _targets_suite(config: pytest.Config) -> bool:
    """Whether the command line names the conformance suite."""
    base_dir = config.invocation_params.dir
    for arg in config.args:
        base = arg.split("::", 1)[0]
        if base.split(".", 1)[0] == "pagedkv_conformance":
            return True
        path = (base_dir / base).resolve()
        if path == _SUITE_DIR or _SUITE_DIR in path.parents:
            return True
    return False


def _read_xfail_file(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise pytest.UsageError(f"--pagedkv-xfail: cannot read {path}: {exc}") from exc
    ids = []
    for line in text.splitlines():
        node_id = line.split("#", 1)[0].strip()
        if node_id:
            ids.append(node_id)
    return ids


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "spec(*ids): the requirement IDs (specs/*.md) a test verifies"
    )
    config.addinivalue_line(
        "markers",
        "requires(*capabilities): skip unless the backend declares every capability "
        f"(one of {', '.join(sorted(CAPABILITIES))})",
    )

    option: str | None = config.getoption("pagedkv_backend")
    if option is not None:
        state = _PluginState(option, "--backend")
    elif os.environ.get(BACKEND_ENV):
        state = _PluginState(os.environ[BACKEND_ENV], f"${BACKEND_ENV}")
    else:
        state = _PluginState(DEFAULT_BACKEND, "default")
    xfail: str | None = config.getoption("pagedkv_xfail") or os.environ.get(XFAIL_ENV) or None
    if xfail is not None:
        state.xfail_file = Path(xfail)
        state.xfail_ids = _read_xfail_file(state.xfail_file)
    config.stash[_STATE] = state

    _load_hypothesis_profile(config)
    if option is not None or _targets_suite(config):
        state.load()


def _load_hypothesis_profile(config: pytest.Config) -> None:
    """Register the profiles (first: this hook is ``tryfirst``, so ``--hypothesis-profile dev``
    finds them too) and load ``$PAGEDKV_HYPOTHESIS_PROFILE`` unless that option was given."""
    if importlib.util.find_spec("hypothesis") is None:
        return  # the state machines cannot run; the example tests still can
    register_hypothesis_profiles()
    if config.getoption("hypothesis_profile", None):
        return
    from hypothesis import settings

    profile = os.environ.get(PROFILE_ENV, DEFAULT_PROFILE)
    try:
        settings.load_profile(profile)
    except Exception as exc:
        raise pytest.UsageError(f"${PROFILE_ENV}={profile!r}: {exc}") from exc


def pytest_report_header(config: pytest.Config) -> list[str]:
    state = _state(config)
    if state.backend is None:
        return [f"pagedkv backend: {state.spec} ({state.source}; loaded when a test needs it)"]
    capabilities = ", ".join(sorted(state.backend.capabilities)) or "none"
    chosen = declared_variants(state.backend)
    declared = ", ".join(sorted(departures(chosen).values()))
    lines = [
        f"pagedkv backend: {state.backend.name} = {state.spec} ({state.source})",
        f"pagedkv capabilities: {capabilities}",
        f"pagedkv variants: {declared + ' (the others: defaults)' if declared else 'defaults'}",
    ]
    failing = expected_failures(chosen)
    if failing:
        lines.append(f"pagedkv expected failures of the declared variants: {len(failing)}")
    if state.xfail_file is not None:
        lines.append(f"pagedkv expected failures: {len(state.xfail_ids)} in {state.xfail_file}")
    return lines


def _xfail_match(item: pytest.Item, listed: str) -> bool:
    """A listed id matches a test whose node id equals it or ends with it after a ``/``, or
    whose file-relative id (file name, then the rest of the node id) equals it.

    The file-relative form is needed when the suite runs from outside its own directory (a
    third party's project with pagedkv installed): pytest then leaves the file out of the node
    id (``::TestKVManager::test_x``).
    """
    node_id = item.nodeid
    if node_id == listed or node_id.endswith("/" + listed):
        return True
    _, sep, rest = node_id.partition("::")
    return bool(sep) and f"{item.path.name}::{rest}" == listed


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    state = _state(config)
    for item in items:
        for marker in item.iter_markers("requires"):
            unknown = [c for c in marker.args if c not in CAPABILITIES]
            if unknown:
                raise pytest.UsageError(
                    f"{item.nodeid}: @pytest.mark.requires names unknown capabilities "
                    f"{unknown}; known: {sorted(CAPABILITIES)}"
                )
    if any(BACKEND_FIXTURES.intersection(getattr(item, "fixturenames", ())) for item in items):
        state.load()
    if state.backend is not None:
        _mark_variant_failures(items, expected_failures(declared_variants(state.backend)))
    if not state.xfail_ids:
        return
    for item in items:
        for listed in state.xfail_ids:
            if _xfail_match(item, listed):
                state.xfail_matched.add(listed)
                item.add_marker(
                    pytest.mark.xfail(strict=True, reason=f"listed in {state.xfail_file}")
                )
                break


def _mark_variant_failures(items: list[pytest.Item], failing: dict[str, tuple[str, ...]]) -> None:
    """Run the tests the backend's declared variants make fail as strict expected failures,
    the reason naming the declarations."""
    for item in items:
        for listed, declared in failing.items():
            if _xfail_match(item, listed):
                reason = f"declared variant {', '.join(declared)}"
                item.add_marker(pytest.mark.xfail(strict=True, reason=reason))
                break


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    state = _state(terminalreporter.config)
    unmatched = [i for i in state.xfail_ids if i not in state.xfail_matched]
    if unmatched:
        terminalreporter.write_sep("-", f"pagedkv: {len(unmatched)} expected failures not run")
        for node_id in unmatched:
            terminalreporter.write_line(f"{node_id} (listed in {state.xfail_file})")


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest) -> Backend:
    """The backend under test (``--backend`` / ``$PAGEDKV_BACKEND`` / the reference)."""
    return _state(request.config).load()


@pytest.fixture
def backend_capabilities(backend: Backend) -> frozenset[str]:
    """Capabilities the backend declares; ``requires`` markers are checked against them.

    Override it (with ``backend`` or ``make_kv_manager``) to run the suite's base classes on a
    backend of your own.
    """
    return frozenset(backend.capabilities)


@pytest.fixture
def backend_variants(backend: Backend) -> dict[str, str]:
    """The backend's choice for every named variant (``pagedkv_conformance.variants``): what
    it declares in ``variants``, else the defaults. The oracles follow it."""
    return declared_variants(backend)


@pytest.fixture
def make_kv_manager(backend: Backend) -> MakeKVManager:
    """``make_kv_manager(num_pages, page_size, enable_prefix_caching=True)``: a fresh
    KVManager of the backend under test."""
    return BackendKVManagerFactory(backend)


@pytest.fixture
def make_paged_store(backend: Backend) -> MakePagedStore:
    """``make_paged_store(**StoreConfig fields)``: a fresh PagedStore of the backend under
    test (``create_paged_store``), checked to satisfy the Protocol."""
    return BackendPagedStoreFactory(backend)


@pytest.fixture(scope="session")
def model_device(request: pytest.FixtureRequest) -> str:
    """The device model tests run on: ``--device``, else ``$PAGEDKV_DEVICE``, else ``cpu``.

    A CUDA device on a machine without CUDA skips the test, saying so.
    """
    import torch

    from pagedkv.testing.tiny_qwen3 import model_device as device_from_env

    device: str = request.config.getoption("pagedkv_device") or device_from_env()
    if device.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip(f"device {device!r} was asked for but CUDA is not available on this machine")
    return device


@pytest.fixture(scope="session")
def golden_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> GoldenCheckpoints:
    """Tiny Qwen3 checkpoints and transformers' outputs on them, built once per run."""
    from .golden_harness import GoldenCheckpoints

    return GoldenCheckpoints(tmp_path_factory.mktemp("golden"))


@pytest.fixture(autouse=True)
def _pagedkv_requires(request: pytest.FixtureRequest) -> None:
    """Skip a test whose ``requires`` capabilities the backend does not all declare."""
    needed: list[str] = []
    for marker in request.node.iter_markers("requires"):
        needed.extend(c for c in marker.args if c not in needed)
    if not needed:
        return
    declared: frozenset[str] = request.getfixturevalue("backend_capabilities")
    missing = [c for c in needed if c not in declared]
    if missing:
        pytest.skip(
            "backend does not declare capabilit"
            + ("y " if len(missing) == 1 else "ies ")
            + ", ".join(repr(c) for c in missing)
        )
