"""OpenAI-style error bodies and the exception handlers that produce them."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedkv.engine.chat_template import InvalidTemplateKwargs
from pagedkv.engine.params import InvalidSamplingParams, SamplingParams
from pagedkv.engine.structured import InvalidStructuredOutputs
from pagedkv.entrypoints.server.async_engine import EngineFailure, EngineUnavailable, RequestFailed
from pagedkv.entrypoints.server.policy import (
    BodyTooLarge,
    DeadlineExceeded,
    Forbidden,
    QueueFull,
    TooManyPrompts,
    Unauthenticated,
)
from pagedkv.entrypoints.server.protocol import ErrorInfo, ErrorResponse
from pagedkv.entrypoints.server.text_worker import TextTooLong
from pagedkv.errors import InvalidRequest, RequestTooLong, UnsupportedPriority

E = TypeVar("E", bound=Exception)

#: Sampling fields an ``InvalidSamplingParams`` message may start with, for ``param``.
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
#: Seconds a client is told to wait after a 503 while the server shuts down or restarts.
UNAVAILABLE_RETRY_AFTER_S = 5


def printable(text: str) -> str:
    """``text`` with lone surrogates escaped (``\\ud800``), so it can be encoded as UTF-8:
    an error message may quote what a client sent."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields, raised by route handlers."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.headers = headers
        self.info = ErrorInfo(
            message=printable(message),
            type=error_type,
            param=None if param is None else printable(param),
            code=code,
        )

    def response(self) -> JSONResponse:
        """The JSON response carrying this error."""
        body = ErrorResponse(error=self.info).model_dump()
        return JSONResponse(body, self.status_code, headers=self.headers)


def invalid_request_error(exc: InvalidRequest) -> APIError:
    """The 400 error of a typed engine rejection; ``param`` names the field when known."""
    message = str(exc)
    if isinstance(exc, TextTooLong):  # refused by its size, before it was tokenized (SRV-116)
        return APIError(400, message, param=exc.param, code="context_length_exceeded")
    if isinstance(exc, RequestTooLong):
        return APIError(400, message, param="max_tokens", code="context_length_exceeded")
    if isinstance(exc, UnsupportedPriority):
        return APIError(400, message, param="priority", code="unsupported_field")
    if isinstance(exc, TooManyPrompts):
        return APIError(400, message, param="prompt", code="too_many_prompts")
    if isinstance(exc, InvalidSamplingParams):
        first = re.split(r"[\s,:]", message, maxsplit=1)[0]
        param = first if first in _SAMPLING_FIELDS else None
        return APIError(400, message, param=param, code="invalid_sampling_params")
    if isinstance(exc, InvalidStructuredOutputs):
        return APIError(400, message, param="structured_outputs", code="invalid_structured_outputs")
    if isinstance(exc, InvalidTemplateKwargs):
        return APIError(400, message, param="chat_template_kwargs", code="invalid_request")
    return APIError(400, message, code="invalid_request")


def _validation_error(exc: RequestValidationError) -> APIError:
    errors: list[Any] = list(exc.errors())
    if not errors:
        return APIError(400, "invalid request body", code="invalid_request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return APIError(400, f"malformed JSON body: {detail}".rstrip(": "), code="invalid_json")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    where = f"{param}: " if param else ""
    code = "invalid_unicode" if first.get("type") == "string_unicode" else None
    return APIError(400, f"{where}{first.get('msg', 'invalid value')}", param=param, code=code)


def _unavailable(exc: EngineUnavailable) -> APIError:
    retry = {"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)}
    return APIError(503, str(exc), error_type="server_error", code="unavailable", headers=retry)


def _queue_full(exc: QueueFull) -> APIError:
    retry = {"Retry-After": str(exc.retry_after_s)}
    return APIError(429, str(exc), error_type="rate_limit_error", code="queue_full", headers=retry)


def _unauthenticated(exc: Unauthenticated) -> APIError:
    bearer = {"WWW-Authenticate": "Bearer"}
    return APIError(401, str(exc), code="invalid_api_key", headers=bearer)


def _forbidden(exc: Forbidden) -> APIError:
    return APIError(403, str(exc), error_type="permission_error", code="forbidden")


def _body_too_large(exc: BodyTooLarge) -> APIError:
    return APIError(413, str(exc), code="request_too_large")


def _deadline(exc: DeadlineExceeded) -> APIError:
    return APIError(504, str(exc), error_type="timeout_error", code="deadline_exceeded")


def _failure(exc: EngineFailure) -> APIError:
    return APIError(500, str(exc), error_type="server_error", code="engine_failure")


def _request_failed(exc: RequestFailed) -> APIError:
    return APIError(500, str(exc), error_type="server_error", code="request_failed")


def _http(exc: StarletteHTTPException) -> APIError:
    error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return APIError(exc.status_code, str(exc.detail), error_type=error_type)


def _unexpected(exc: Exception) -> APIError:
    message = f"internal error: {type(exc).__name__}"
    return APIError(500, message, error_type="server_error", code="internal_error")


def _same(exc: APIError) -> APIError:
    return exc


def _handler(
    kind: type[E], convert: Callable[[E], APIError]
) -> Callable[[Request, Exception], Awaitable[JSONResponse]]:
    """An exception handler answering ``kind`` errors with ``convert``'s OpenAI error."""

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        error = convert(exc) if isinstance(exc, kind) else _unexpected(exc)
        return error.response()

    return handle


#: Each handled exception type and its conversion, most specific first.
_CONVERSIONS: tuple[tuple[type[Any], Callable[[Any], APIError]], ...] = (
    (APIError, _same),
    (RequestValidationError, _validation_error),
    (InvalidRequest, invalid_request_error),
    (Unauthenticated, _unauthenticated),
    (Forbidden, _forbidden),
    (BodyTooLarge, _body_too_large),
    (QueueFull, _queue_full),
    (DeadlineExceeded, _deadline),
    (EngineUnavailable, _unavailable),
    (EngineFailure, _failure),
    (RequestFailed, _request_failed),
    (StarletteHTTPException, _http),
)


def api_error(exc: Exception) -> APIError:
    """The OpenAI error answering ``exc``: what the handlers send, and what a stream sends as
    its error event once its status line has gone out."""
    for kind, convert in _CONVERSIONS:
        if isinstance(exc, kind):
            return convert(exc)
    return _unexpected(exc)


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app returns an OpenAI-style body."""
    for kind, convert in _CONVERSIONS:
        app.add_exception_handler(kind, _handler(kind, convert))
    app.add_exception_handler(Exception, _handler(Exception, _unexpected))
