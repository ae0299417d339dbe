"""The HTTP server around the app: uvicorn, with read deadlines and a graceful shutdown.

- **Read deadlines.** uvicorn closes an idle keep-alive connection, but not one that is slowly
  sending its request (slowloris): a client could hold a connection and its buffers for ever by
  sending a header line, or a body byte, every few seconds. Here each request must arrive within
  bounds: its headers within ``header_timeout_s`` of the connection opening (or of the previous
  response), its body within ``body_timeout_s`` of its headers; otherwise the connection is
  closed, and a request that was being read sees a disconnect.
- **Graceful shutdown.** On SIGINT or SIGTERM the app stops admitting at once (new requests are
  answered 503 with ``Retry-After`` and ``/health`` turns 503), uvicorn stops accepting
  connections and lets the requests in flight finish for up to ``shutdown_timeout_s`` seconds,
  then cancels the rest; the app's shutdown aborts whatever is left and frees every KV page.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from types import FrameType
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedkv.entrypoints.server.state import ServerState
from pagedkv.errors import InvalidRequest

#: Default seconds a client has to send a request's headers.
DEFAULT_HEADER_TIMEOUT_S = 10.0
#: Default seconds a client has to send a request's body once its headers are in.
DEFAULT_BODY_TIMEOUT_S = 30.0
#: Default seconds the requests in flight may take to finish once shutdown begins.
DEFAULT_SHUTDOWN_TIMEOUT_S = 30

logger = logging.getLogger("pagedkv.server")


@dataclass(frozen=True, slots=True)
class HTTPOptions:
    """Where and how the server listens (``pagedkv serve`` flags).

    Attributes:
        host, port: the address to listen on (port 0: any free port).
        header_timeout_s: seconds to receive a request's headers; > 0.
        body_timeout_s: seconds to receive a request's body after its headers; > 0.
        shutdown_timeout_s: seconds the requests in flight get to finish on shutdown; >= 0.
        log_level: uvicorn's log level.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    shutdown_timeout_s: int = DEFAULT_SHUTDOWN_TIMEOUT_S
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidRequest(f"port must be in [0, 65535], got {self.port}")
        for name in ("header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise InvalidRequest(f"{name} must be > 0, got {value}")
        if self.shutdown_timeout_s < 0:
            raise InvalidRequest(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")


class ReadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on reading each request's headers and body.

    Subclasses set :attr:`header_timeout_s` and :attr:`body_timeout_s` (see
    :func:`read_deadline_protocol`). The phase is read from h11's view of the client: ``IDLE``
    until a request's headers are complete, ``SEND_BODY`` until its body is, then ``DONE``
    (no deadline while the response is produced, however long it streams).
    """

    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s = DEFAULT_BODY_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._read_phase: type[h11.IDLE] | type[h11.SEND_BODY] | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_read()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_read()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_read()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_read_phase(None)
        super().connection_lost(exc)

    def _watch_read(self) -> None:
        state = self.conn.their_state
        if state is h11.IDLE:
            self._set_read_phase(h11.IDLE)
        elif state is h11.SEND_BODY:
            self._set_read_phase(h11.SEND_BODY)
        else:
            self._set_read_phase(None)

    def _set_read_phase(self, phase: type[h11.IDLE] | type[h11.SEND_BODY] | None) -> None:
        if phase is self._read_phase:
            return  # the deadline runs from the start of the phase
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        self._read_phase = phase
        if phase is not None:
            timeout = self.header_timeout_s if phase is h11.IDLE else self.body_timeout_s
            self._read_timer = self.loop.call_later(timeout, self._read_timed_out, timeout)

    def _read_timed_out(self, timeout: float) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        what = "headers" if self._read_phase is h11.IDLE else "body"
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        logger.info(
            "closing the connection of %s: request %s not received in %gs", client, what, timeout
        )
        self.transport.close()


def read_deadline_protocol(options: HTTPOptions) -> type[ReadDeadlineProtocol]:
    """A :class:`ReadDeadlineProtocol` class with ``options``' deadlines."""
    return type(
        "ConfiguredReadDeadlineProtocol",
        (ReadDeadlineProtocol,),
        {"header_timeout_s": options.header_timeout_s, "body_timeout_s": options.body_timeout_s},
    )


class Server(uvicorn.Server):
    """uvicorn's server whose exit signal first makes the app stop admitting requests."""

    def __init__(self, app: FastAPI, options: HTTPOptions) -> None:
        config = uvicorn.Config(
            app,
            host=options.host,
            port=options.port,
            log_level=options.log_level,
            http=read_deadline_protocol(options),
            timeout_graceful_shutdown=options.shutdown_timeout_s,
        )
        super().__init__(config)
        self._app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state = getattr(self._app.state, "server", None)
        if isinstance(state, ServerState):
            state.engine.stop_admitting()
        super().handle_exit(sig, frame)
