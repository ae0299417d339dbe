"""OpenAI-style error bodies and the exception handlers that produce them."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedkv.engine.chat_template import InvalidTemplateKwargs
from pagedkv.engine.params import InvalidSamplingParams
from pagedkv.errors import InvalidRequest, RequestTooLong
from pagedkv.server.async_engine import EngineFailure, EngineUnavailable
from pagedkv.server.protocol import ErrorInfo, ErrorResponse

E = TypeVar("E", bound=Exception)

#: Sampling fields an ``InvalidSamplingParams`` message may start with, for ``param``.
_SAMPLING_FIELDS = frozenset(
    {"max_tokens", "temperature", "top_k", "top_p", "min_p", "logprobs", "stop", "stop_token_ids"}
)


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
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=error_type, param=param, code=code)


def error_response(
    status_code: int,
    message: str,
    *,
    error_type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    """A JSON response with body ``{"error": {"message", "type", "param", "code"}}``."""
    body = ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status_code)


def invalid_request_error(exc: InvalidRequest) -> APIError:
    """The 400 error of a typed engine rejection; ``param`` names the field when known."""
    message = str(exc)
    if isinstance(exc, RequestTooLong):
        return APIError(400, message, param="max_tokens", code="context_length_exceeded")
    if isinstance(exc, InvalidSamplingParams):
        first = re.split(r"[\s,:]", message, maxsplit=1)[0]
        param = first if first in _SAMPLING_FIELDS else None
        return APIError(400, message, param=param, code="invalid_sampling_params")
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
    return APIError(400, f"{where}{first.get('msg', 'invalid value')}", param=param)


def _unavailable(exc: EngineUnavailable) -> APIError:
    return APIError(503, str(exc), error_type="server_error", code="unavailable")


def _failure(exc: EngineFailure) -> APIError:
    return APIError(500, str(exc), error_type="server_error", code="engine_failure")


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
        return JSONResponse(ErrorResponse(error=error.info).model_dump(), error.status_code)

    return handle


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app returns an OpenAI-style body."""
    app.add_exception_handler(APIError, _handler(APIError, _same))
    app.add_exception_handler(
        RequestValidationError, _handler(RequestValidationError, _validation_error)
    )
    app.add_exception_handler(InvalidRequest, _handler(InvalidRequest, invalid_request_error))
    app.add_exception_handler(EngineUnavailable, _handler(EngineUnavailable, _unavailable))
    app.add_exception_handler(EngineFailure, _handler(EngineFailure, _failure))
    app.add_exception_handler(StarletteHTTPException, _handler(StarletteHTTPException, _http))
    app.add_exception_handler(Exception, _handler(Exception, _unexpected))
