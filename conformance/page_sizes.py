"""The page sizes a backend declares its KVManager supports (KVM-065).

Most managers take any page size; some take only a few (multiples of 256, a power of two). A
backend says so in an optional ``page_sizes`` attribute: any container of ints
(``frozenset({16, 32})``, ``range(256, 1 << 16, 256)``). The suite then makes managers only of
those sizes: a test needing another is skipped, the reason naming the size, rather than
failing a backend for a size it never promised. A backend without the attribute supports
every size of at least 1.
"""

from __future__ import annotations

from collections.abc import Container


class PageSizeError(ValueError):
    """A backend declares ``page_sizes`` in another form than a container of ints."""


def declared_page_sizes(backend: object) -> Container[int] | None:
    """The backend's ``page_sizes``, or ``None`` when it declares none (every size).

    Raises:
        PageSizeError: ``page_sizes`` is not a container (a bare int, say).
    """
    sizes: object = getattr(backend, "page_sizes", None)
    if sizes is None:
        return None
    if not isinstance(sizes, Container) or isinstance(sizes, str | bytes):
        raise PageSizeError(
            "'page_sizes' must be a container of ints, e.g. frozenset({16, 32}) or "
            f"range(256, 65536, 256); got {sizes!r}"
        )
    return sizes


def supports_page_size(backend: object, page_size: int) -> bool:
    """Whether the backend declares ``page_size`` (every size when it declares none)."""
    sizes = declared_page_sizes(backend)
    return sizes is None or page_size in sizes


def unsupported_reason(backend: object, page_size: int) -> str:
    """Why a test at ``page_size`` is skipped on ``backend``."""
    sizes = declared_page_sizes(backend)
    return f"backend does not declare page size {page_size} (page_sizes: {sizes!r})"
