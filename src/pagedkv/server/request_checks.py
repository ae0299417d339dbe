"""Checks of a parsed request body that its schema cannot express.

- Text must be valid Unicode: JSON may carry a lone surrogate (``"a\\ud800b"``), which Python
  keeps in a ``str`` but no tokenizer can encode. Such a field is refused with 400 naming it.
- Fields the server does not declare are accepted (OpenAI clients send some by default) but
  logged as a warning, as vLLM does, so that nothing is ignored silently.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from pydantic import BaseModel

from pagedkv.server.errors import APIError

logger = logging.getLogger("pagedkv.server")

#: Most ignored field names one warning lists (a body may carry thousands).
MAX_LOGGED_FIELDS = 20


def _texts(value: object, path: str) -> Iterator[tuple[str, str]]:
    """Every ``(path, text)`` in a declared field value, depth first."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            yield from _texts(getattr(value, name), f"{path}.{name}" if path else name)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _texts(item, f"{path}.{index}")


def check_text(body: BaseModel) -> None:
    """Raise a 400 :class:`APIError` naming the first declared text field of ``body`` that
    holds a lone surrogate.

    Raises:
        APIError: 400, code ``invalid_unicode``, ``param`` the field's dotted path.
    """
    for path, text in _texts(body, ""):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # only a surrogate cannot be encoded
            raise APIError(
                400,
                f"{path}: text is not valid Unicode (a lone surrogate "
                f"U+{ord(text[exc.start]):04X} at index {exc.start})",
                param=path,
                code="invalid_unicode",
            ) from None


def ignored_fields(body: BaseModel, path: str = "") -> list[str]:
    """Dotted paths of the fields ``body`` received but does not declare, nested ones too."""
    found = [f"{path}{name}" for name in body.model_extra or {}]
    for name in type(body).model_fields:
        value = getattr(body, name)
        items = value if isinstance(value, list) else [value]
        for index, item in enumerate(items):
            if isinstance(item, BaseModel):
                where = f"{path}{name}." + (f"{index}." if isinstance(value, list) else "")
                found.extend(ignored_fields(item, where))
    return found


def check_request(body: BaseModel) -> None:
    """Refuse invalid text (400) and log the fields that will be ignored."""
    check_text(body)
    ignored = sorted(ignored_fields(body))
    if ignored:
        shown = ", ".join(ascii(name) for name in ignored[:MAX_LOGGED_FIELDS])
        more = len(ignored) - MAX_LOGGED_FIELDS
        logger.warning(
            "The following fields were present in the request but ignored: %s%s",
            shown,
            f" and {more} more" if more > 0 else "",
        )
