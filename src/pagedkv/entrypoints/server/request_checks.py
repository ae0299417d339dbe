"""Checks of a parsed request body that its schema cannot express.

- Text must be valid Unicode: JSON may carry a lone surrogate (``"a\\ud800b"``), which Python
  keeps in a ``str`` but no tokenizer can encode. Such a field is refused with 400 naming it.
- A declared field pagedkv does not implement (``tools``, ``response_format``, ...) is refused
  with 400 naming it, unless it holds a neutral value that changes nothing (SRV-100).
- Fields the server does not declare are accepted (OpenAI clients send some by default) but
  logged as a warning, as vLLM does, so that nothing is ignored silently.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from pydantic import BaseModel

from pagedkv.entrypoints.server.errors import APIError
from pagedkv.entrypoints.server.protocol import (
    NEUTRAL,
    NOTED,
    REFUSED,
    ChatMessage,
    SamplingFields,
)

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


def refused_fields(model: type[BaseModel]) -> dict[str, tuple[str, list[object]]]:
    """The fields ``model`` declares only to refuse them: name -> (reason, neutral values)."""
    found: dict[str, tuple[str, list[object]]] = {}
    for name, field in model.model_fields.items():
        extra = field.json_schema_extra
        if isinstance(extra, dict) and REFUSED in extra:
            neutral = extra.get(NEUTRAL)
            found[name] = (str(extra[REFUSED]), list(neutral) if isinstance(neutral, list) else [])
    return found


def check_refused(body: BaseModel) -> None:
    """Raise a 400 :class:`APIError` naming the first refused field that ``body`` sets to
    something other than a neutral value.

    Raises:
        APIError: 400, code ``unsupported_field``, ``param`` the field.
    """
    for name, (reason, neutral) in refused_fields(type(body)).items():
        value = getattr(body, name)
        if value is not None and value not in neutral:
            raise APIError(
                400,
                f"{name} is not supported by this server: {reason}",
                param=name,
                code="unsupported_field",
            )


def noted_fields(model: type[BaseModel]) -> dict[str, str]:
    """The fields ``model`` declares as noted (SRV-118): name -> what they name."""
    found: dict[str, str] = {}
    for name, field in model.model_fields.items():
        extra = field.json_schema_extra
        if isinstance(extra, dict) and NOTED in extra:
            found[name] = str(extra[NOTED])
    return found


def log_noted(body: BaseModel, response_id: str) -> None:
    """Log the noted fields ``body`` sets (``user``, ``metadata``, ...) with the response's
    id: what OpenAI defines them for, the caller's records."""
    given = {n: getattr(body, n) for n in noted_fields(type(body)) if getattr(body, n) is not None}
    if given:
        shown = ", ".join(f"{name}={ascii(value)[:200]}" for name, value in sorted(given.items()))
        logger.info("request %s: %s", response_id, shown)


def check_fields(body: SamplingFields) -> None:
    """What the schema cannot say about fields together (SRV-118).

    Raises:
        APIError: 400 naming the field: ``stream_options`` without ``stream: true``; a
            message part that is not text.
    """
    if body.stream_options is not None and not body.stream:
        raise APIError(
            400,
            "stream_options is only allowed with stream: true",
            param="stream_options",
            code="invalid_request",
        )
    messages: list[ChatMessage] = getattr(body, "messages", None) or []
    for index, message in enumerate(messages):
        part = message.media_part()
        if part is not None:
            raise APIError(
                400,
                "this model takes text only: image, audio, video and file content parts are "
                "not supported",
                param=f"messages.{index}.content.{part}",
                code="unsupported_content",
            )


def check_request(body: BaseModel) -> None:
    """Refuse invalid text and unsupported fields (400), and log the fields that will be
    ignored."""
    check_text(body)
    check_refused(body)
    ignored = sorted(ignored_fields(body))
    if ignored:
        shown = ", ".join(ascii(name) for name in ignored[:MAX_LOGGED_FIELDS])
        more = len(ignored) - MAX_LOGGED_FIELDS
        logger.warning(
            "The following fields were present in the request but ignored: %s%s",
            shown,
            f" and {more} more" if more > 0 else "",
        )
