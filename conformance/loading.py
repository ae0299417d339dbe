"""Loading and validating the backend under test.

A backend is named ``module:factory``: ``module`` is an importable dotted module path and
``factory`` a (possibly dotted) attribute of it, a zero-argument callable returning an object
that satisfies :class:`pagedkv.interfaces.Backend`. This module knows nothing of pytest: it
raises :class:`BackendLoadError` and the plugin turns that into a usage error.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Set
from dataclasses import dataclass
from typing import Protocol

from pagedkv.interfaces import (
    CAPABILITIES,
    Backend,
    KVManager,
    KVManagerConfig,
    PagedStore,
    PagedStoreBackend,
    StoreConfig,
)

from .page_sizes import PageSizeError, declared_page_sizes, supports_page_size, unsupported_reason
from .variants import VariantError, declared_variants

#: The backend tested when neither ``--backend`` nor ``$PAGEDKV_BACKEND`` names one.
DEFAULT_BACKEND = "pagedkv.backend:reference_backend"
#: Environment variable naming the backend when ``--backend`` is not given.
BACKEND_ENV = "PAGEDKV_BACKEND"

_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
_SPEC = re.compile(rf"^(?P<module>{_DOTTED}):(?P<attr>{_DOTTED})$")


class BackendLoadError(Exception):
    """The backend string is malformed, or what it names is not a usable Backend."""


class MakeKVManager(Protocol):
    """What the ``make_kv_manager`` fixture returns: a fresh KVManager per call."""

    def __call__(
        self, num_pages: int, page_size: int, enable_prefix_caching: bool = True
    ) -> KVManager: ...


def parse_backend_spec(spec: str) -> tuple[str, str]:
    """Split ``module:factory`` into its two parts, or raise :class:`BackendLoadError`."""
    match = _SPEC.match(spec.strip())
    if match is None:
        raise BackendLoadError(
            f"malformed backend {spec!r}: expected 'module:factory', e.g. {DEFAULT_BACKEND!r} "
            "(a dotted importable module, a colon, and a zero-argument factory in it)"
        )
    return match.group("module"), match.group("attr")


def load_backend(spec: str) -> Backend:
    """Import ``module``, call ``factory()`` and validate the result as a Backend."""
    module_name, attr_path = parse_backend_spec(spec)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendLoadError(
            f"backend {spec!r}: cannot import module {module_name!r}: {exc}"
        ) from exc
    target: object = module
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise BackendLoadError(
                f"backend {spec!r}: module {module_name!r} has no attribute {attr_path!r}"
            ) from exc
    if not callable(target):
        raise BackendLoadError(
            f"backend {spec!r}: {attr_path!r} is a {type(target).__name__}, not a "
            "zero-argument factory"
        )
    try:
        result = target()
    except Exception as exc:
        raise BackendLoadError(
            f"backend {spec!r}: calling {attr_path}() raised {type(exc).__name__}: {exc}"
        ) from exc
    return validate_backend(result, spec)


def validate_backend(candidate: object, spec: str) -> Backend:
    """Return ``candidate`` if it is a well-formed Backend, else raise BackendLoadError."""
    if not isinstance(candidate, Backend):
        missing = [
            attr
            for attr in ("name", "capabilities", "create_kv_manager")
            if not hasattr(candidate, attr)
        ]
        raise BackendLoadError(
            f"backend {spec!r}: the factory returned a {type(candidate).__name__}, which is not "
            f"a pagedkv.interfaces.Backend (missing: {', '.join(missing)})"
        )
    if not isinstance(candidate.name, str) or not candidate.name:
        raise BackendLoadError(f"backend {spec!r}: 'name' must be a non-empty str")
    capabilities: object = candidate.capabilities
    if not isinstance(capabilities, Set) or not all(isinstance(c, str) for c in capabilities):
        raise BackendLoadError(f"backend {spec!r}: 'capabilities' must be a set of str")
    unknown = sorted(str(c) for c in capabilities if c not in CAPABILITIES)
    if unknown:
        raise BackendLoadError(
            f"backend {spec!r}: unknown capabilities {unknown}; known: {sorted(CAPABILITIES)}"
        )
    if not callable(candidate.create_kv_manager):
        raise BackendLoadError(f"backend {spec!r}: 'create_kv_manager' is not callable")
    try:
        declared_variants(candidate)
        declared_page_sizes(candidate)
    except (VariantError, PageSizeError) as exc:
        raise BackendLoadError(f"backend {spec!r}: {exc}") from exc
    return candidate


@dataclass(frozen=True)
class BackendKVManagerFactory:
    """A :class:`MakeKVManager` that builds KVManagers with a backend and checks their type."""

    backend: Backend

    def supports_page_size(self, page_size: int) -> bool:
        """Whether the backend declares ``page_size`` (KVM-065; every size if it declares
        none)."""
        return supports_page_size(self.backend, page_size)

    def __call__(
        self, num_pages: int, page_size: int, enable_prefix_caching: bool = True
    ) -> KVManager:
        """A fresh manager; the calling test is skipped, the reason naming the size, when the
        backend does not declare ``page_size`` (KVM-065)."""
        if not self.supports_page_size(page_size):
            import pytest  # only a test calls this: loading the plugin stays cheap

            pytest.skip(unsupported_reason(self.backend, page_size))
        config = KVManagerConfig(num_pages, page_size, enable_prefix_caching)
        manager = self.backend.create_kv_manager(config)
        if not isinstance(manager, KVManager):
            raise TypeError(
                f"backend {self.backend.name!r}: create_kv_manager returned a "
                f"{type(manager).__name__}, which is not a pagedkv.interfaces.KVManager"
            )
        return manager


class MakePagedStore(Protocol):
    """What the ``make_paged_store`` fixture returns: a fresh PagedStore per call, shaped by
    :class:`~pagedkv.interfaces.StoreConfig` fields (defaults: 2 layers, 2 KV heads of 8
    channels, 16 pages of 4 positions, float32 on the CPU)."""

    def __call__(self, **fields: object) -> PagedStore: ...


#: The store shape ``make_paged_store`` uses for fields it is not given.
STORE_DEFAULTS: dict[str, object] = {
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_dim": 8,
    "page_size": 4,
    "num_pages": 16,
}


@dataclass(frozen=True)
class BackendPagedStoreFactory:
    """A :class:`MakePagedStore` that builds stores with a backend and checks their type."""

    backend: Backend

    def __call__(self, **fields: object) -> PagedStore:
        if not isinstance(self.backend, PagedStoreBackend):
            raise TypeError(
                f"backend {self.backend.name!r} declares 'paged_store' but has no "
                "create_paged_store"
            )
        config = StoreConfig(**{**STORE_DEFAULTS, **fields})  # type: ignore[arg-type]
        store = self.backend.create_paged_store(config)
        if not isinstance(store, PagedStore):
            raise TypeError(
                f"backend {self.backend.name!r}: create_paged_store returned a "
                f"{type(store).__name__}, which is not a pagedkv.interfaces.PagedStore"
            )
        return store
