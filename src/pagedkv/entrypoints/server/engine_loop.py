"""The engine's side of the server: one thread owns an :class:`~pagedkv.interfaces.Engine`,
takes commands (submit, abort, call, stop) from a queue, steps while any request is
unfinished, and hands each request's outputs to its :class:`Sink`.

It alone adds, steps and aborts, so the engine needs no locks. What it receives is token ids
(text is tokenized apart from it, SRV-115) and what it sends is outputs; the asyncio front
(:mod:`pagedkv.entrypoints.server.async_engine`) runs it on a thread of the server's process.
Nothing here touches an event loop: a sink is whatever delivers an item to its handler.

It sleeps on the command queue when nothing is unfinished; once it has slept
:data:`IDLE_RELEASE_S` after serving, it gives the memory its steps freed back to the system
(SRV-137), and it keeps nothing of a request that ended (SRV-138). Admission of the queue depth
happens here (where the engine's count of waiting requests is exact), and deadlines between
steps.

Failures stay with the request they belong to (SRV-023, SRV-024): a request the engine finishes
with reason ``error``, or whose output the server fails to serve, fails alone, and the rest of
its submission is aborted; a step that raises is tried again, and only a run of them ends what
is in flight. An engine whose runner can run nothing more (``RunnerFailed``: a tensor-parallel
worker died, TP-022) ends what is in flight at once and stops the loop.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pagedkv.engine.outputs import EngineStats, RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.entrypoints.server.deadlines import Deadlines
from pagedkv.entrypoints.server.policy import Refused, ServerPolicy
from pagedkv.errors import InvalidRequest, PagedKVError, RunnerFailed
from pagedkv.interfaces import Engine

#: Seconds the engine thread waits for a command when a step scheduled nothing.
IDLE_POLL_S = 0.005
#: Seconds the engine stays idle (no request unfinished, no command) after serving before the
#: server gives the memory its steps freed back to the system (SRV-137): long enough that a
#: client sending one request after another, or the gaps of a bursty load, do not pay for a
#: release and for faulting the pages in again at every request; short enough that an idle
#: server's size is its live memory within seconds.
IDLE_RELEASE_S = 1.0
#: Steps in a row that may raise before every request in flight is ended (SRV-023).
MAX_STEP_ERRORS = 3

logger = logging.getLogger("pagedkv.server")


class EngineUnavailable(PagedKVError):
    """The engine thread is not running (not started, stopped, or stopping)."""


class EngineFailure(PagedKVError):
    """:data:`MAX_STEP_ERRORS` steps in a row raised, or the engine ended (its runner can run
    nothing more, TP-022); every request in flight at that moment was ended with this error."""


class RequestFailed(PagedKVError):
    """This request failed alone: the engine finished it with reason ``error`` (ENG-070..072),
    or serving its output failed. The rest of its submission was aborted."""


@dataclass(frozen=True, slots=True)
class StreamItem:
    """One step's output of one prompt of a submission.

    Attributes:
        index: position of the prompt in the submission.
        output: the engine's output for that step.
        token_texts: text of every token id in this step's new logprobs entries (chosen and
            top tokens), when the submission asked for them; else empty.
    """

    index: int
    output: RequestOutput
    token_texts: Mapping[int, str]


class Sink(Protocol):
    """Delivers one request's items (or the error that ends it) to its handler; called on the
    engine thread, so it must return at once and never raise."""

    def put(self, item: StreamItem | BaseException) -> None: ...


@dataclass(frozen=True, slots=True)
class Submit:
    request_ids: tuple[str, ...]
    prompts: tuple[tuple[int, ...], ...]  # token ids: tokenized by the text worker
    params: SamplingParams
    fill_context: bool
    token_texts: bool
    cache_salt: str | None
    deadline: float | None  # time.monotonic() seconds
    sink: Sink
    accepted: concurrent.futures.Future[None]
    priority: int = 0


@dataclass(frozen=True, slots=True)
class Abort:
    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Call:
    """Run ``function`` on the engine thread and keep its result."""

    function: Callable[[], Any]
    result: concurrent.futures.Future[Any]


class Stop:
    pass


Command = Submit | Abort | Call | Stop


@dataclass(slots=True)
class _Route:
    sink: Sink
    index: int


class EngineLoop:
    """Owns an engine and serves the commands put to it; see the module docstring.

    :meth:`run` is the whole life of the thread that owns the engine; every other method is
    safe from any thread.
    """

    def __init__(
        self,
        engine: Engine,
        policy: ServerPolicy,
        *,
        observer: Callable[[RequestOutput], None] | None = None,
        release_memory: Callable[[], object] | None = None,
        release_after_s: float = IDLE_RELEASE_S,
    ) -> None:
        """Args:
        engine: a freshly built engine with no requests.
        policy: what the server admits (the queue depth and deadlines, here).
        observer: called on the engine thread with every output (metrics); must not raise.
        release_memory: called on the engine thread once it has been idle for
            ``release_after_s`` seconds after serving, once per idle spell (SRV-137): the
            server passes :func:`~pagedkv.accel.cpu.host_memory.release_freed_memory`.
            ``None``: nothing is released. What it raises is logged, never raised.
        release_after_s: seconds of idleness before ``release_memory`` runs; at least 0.

        Raises:
            InvalidRequest: ``release_after_s`` below 0 or not finite.
        """
        if not 0.0 <= release_after_s < float("inf"):
            raise InvalidRequest(
                f"release_after_s must be a finite number of seconds >= 0, not {release_after_s}"
            )
        self.engine = engine
        self.policy = policy
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._routes: dict[str, _Route] = {}
        self._stats = engine.stats()
        self._observer = observer
        #: Cleared when the engine can run nothing more (``RunnerFailed``); the front also
        #: clears it to refuse new submissions while it shuts down.
        self.admitting = threading.Event()
        self.admitting.set()
        self._deadlines = Deadlines()
        self._step_errors = 0
        self._release_memory = release_memory
        self._release_after_s = release_after_s
        #: Whether the engine ran a step or a command since memory was last released.
        self._release_due = False
        self._commands_run = 0
        self._releases = 0

    def put(self, command: Command) -> None:
        """Queue ``command`` for the engine thread; returns at once."""
        self._commands.put(command)

    def stats(self) -> EngineStats:
        """The engine's counters as of the end of its latest step or command."""
        return self._stats

    @property
    def releases(self) -> int:
        """How many times the loop, idle, ran its release (SRV-137) and the release returned
        (whether or not it found memory to give back)."""
        return self._releases

    def holds_nothing(self) -> bool:
        """Whether the loop keeps nothing of any request (SRV-138): no route, no deadline."""
        return not self._routes and len(self._deadlines) == 0

    def run(self) -> None:
        """Serve commands and step until a stop command, or until the engine can run nothing
        more; meant to be a thread's whole life."""
        try:
            self._serve()
        except BaseException as exc:  # a bug: fail what is in flight rather than hang it
            with contextlib.suppress(Exception):
                self._end_all(EngineFailure(f"the engine thread failed: {exc!r}"))
            raise

    def _serve(self) -> None:
        idle_timeout: float | None = None
        while True:
            busy = self.engine.has_unfinished_requests()
            release = not busy and self._release_due and self._release_memory is not None
            commands = self._commands_run
            timeout = idle_timeout if busy else self._release_after_s if release else None
            if not self._drain(timeout):
                return
            if release and self._commands_run == commands:  # idle all along
                self._release()
                continue
            idle_timeout = 0.0
            self._expire_deadlines()
            self._stats = self.engine.stats()
            if self.engine.has_unfinished_requests():
                steps = self._stats.steps
                self._release_due = True
                if not self._step():
                    return
                if self._stats.steps == steps:  # nothing could be scheduled: do not spin
                    idle_timeout = IDLE_POLL_S

    def _drain(self, timeout: float | None) -> bool:
        """Run queued commands, waiting up to ``timeout`` seconds (forever for ``None``) for
        the first. Returns ``False`` once a stop command ran."""
        try:
            command = self._commands.get(timeout=timeout) if timeout != 0.0 else None
        except queue.Empty:
            command = None
        while True:
            if command is None:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    return True
            self._commands_run += 1
            self._release_due = True
            if isinstance(command, Stop):
                self._end_all(EngineUnavailable("the server is shutting down"))
                self.fail_pending()
                self._stats = self.engine.stats()
                return False
            if isinstance(command, Submit):
                self._add(command)
            elif isinstance(command, Call):
                self._call(command)
            else:
                self._abort(command.request_ids)
            command = None

    def _release(self) -> None:
        """Give the memory steps freed back (SRV-137); a failure is logged, never raised."""
        self._release_due = False
        if self._release_memory is None:
            return
        started = time.perf_counter()
        try:
            self._release_memory()
        except Exception as exc:  # the server serves on with the memory it holds
            logger.warning("releasing freed memory failed: %r", exc)
            return
        self._releases += 1
        logger.debug("released freed memory in %.1f ms", (time.perf_counter() - started) * 1e3)

    def _add(self, command: Submit) -> None:
        if not command.accepted.set_running_or_notify_cancel():
            return  # the handler went away before its request was queued
        added: list[str] = []
        try:
            admitted = self.policy.admit_queue(self.engine.stats().waiting, len(command.prompts))
            if isinstance(admitted, Refused):
                raise admitted.reason
            for index, (request_id, prompt) in enumerate(
                zip(command.request_ids, command.prompts, strict=True)
            ):
                token_ids = list(prompt)
                params = command.params
                if command.fill_context:
                    left = max(1, self.engine.max_model_len - len(token_ids))
                    params = dataclasses.replace(params, max_tokens=left)
                if command.priority:  # engines without priority scheduling take none
                    self.engine.add_request(
                        token_ids,
                        params,
                        request_id=request_id,
                        cache_salt=command.cache_salt,
                        priority=command.priority,
                    )
                else:
                    self.engine.add_request(
                        token_ids, params, request_id=request_id, cache_salt=command.cache_salt
                    )
                added.append(request_id)
                self._routes[request_id] = _Route(command.sink, index)
        except Exception as exc:  # typed engine errors, or a tokenizer's own
            self._abort(added)
            command.accepted.set_exception(exc)
            return
        if command.deadline is not None:
            self._deadlines.add(command.deadline, command.request_ids)
        command.accepted.set_result(None)

    def fail_pending(self) -> None:
        """Refuse the commands still queued once the thread has stopped serving."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            future: concurrent.futures.Future[Any] | None = None
            if isinstance(command, Submit):
                future = command.accepted
            elif isinstance(command, Call):
                future = command.result
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(EngineUnavailable("the server is shutting down"))

    def _call(self, command: Call) -> None:
        if not command.result.set_running_or_notify_cancel():
            return
        try:
            command.result.set_result(command.function())
        except Exception as exc:  # handed to the caller
            command.result.set_exception(exc)

    def _expire_deadlines(self) -> None:
        """End every routed request whose deadline has passed with ``DeadlineExceeded``."""
        for request_id in self._deadlines.due(time.monotonic()):
            route = self._routes.get(request_id)
            if route is not None:
                route.sink.put(self.policy.expired())
                self._abort([request_id])

    def _abort(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._unroute(request_id)
            output = self.engine.abort(request_id)
            if output is not None:
                self._observe(output)

    def _step(self) -> bool:
        """Run one step and route its outputs; ``False`` when the engine has ended."""
        try:
            outputs = self.engine.step()
        except RunnerFailed as exc:  # nothing can run any more: end everything, stop
            logger.error("the engine ended: %s", exc)
            self.admitting.clear()
            self._end_all(EngineFailure(f"the engine ended: {exc}"))
            self.fail_pending()
            with contextlib.suppress(Exception):
                self._stats = self.engine.stats()
            return False
        except Exception as exc:  # an engine that does not isolate its failures, or a bug
            self._step_raised(exc)
            return True
        self._step_errors = 0
        self._stats = self.engine.stats()  # published before any output reaches a handler
        for output in outputs:
            self._observe(output)
            self._route(output)
        return True

    def _route(self, output: RequestOutput) -> None:
        """Hand ``output`` to its handler; a failed request, or one whose output cannot be
        served, fails alone (SRV-024)."""
        route = self._routes.get(output.request_id)
        if route is None:
            return
        if output.error is not None:  # one completion failed, and with it the request
            self._fail(output.request_id, route, output.error)
            return
        route.sink.put(StreamItem(route.index, output, {}))  # texts: see GenerationStream
        if output.finished:
            self._unroute(output.request_id)

    def _unroute(self, request_id: str) -> None:
        """Forget everything the thread keeps for ``request_id``: it ended (SRV-138)."""
        self._routes.pop(request_id, None)
        self._deadlines.forget(request_id)

    def _fail(self, request_id: str, route: _Route, error: str) -> None:
        """End one request with :class:`RequestFailed`, aborting it if it still runs."""
        logger.warning("request %s failed: %s", request_id, error)
        route.sink.put(RequestFailed(f"the request failed: {error}"))
        self._abort([request_id])

    def _step_raised(self, exc: Exception) -> None:
        """A step raised: step again, unless :data:`MAX_STEP_ERRORS` did in a row; then end
        what is in flight, which the engine cannot tell apart (SRV-023)."""
        self._step_errors += 1
        logger.warning("engine step failed (%d in a row): %r", self._step_errors, exc)
        if self._step_errors >= MAX_STEP_ERRORS:
            self._step_errors = 0
            message = f"{MAX_STEP_ERRORS} engine steps in a row failed, the last: {exc!r}"
            self._end_all(EngineFailure(message))
        with contextlib.suppress(Exception):
            self._stats = self.engine.stats()

    def _observe(self, output: RequestOutput) -> None:
        if self._observer is not None:
            self._observer(output)

    def _end_all(self, error: PagedKVError) -> None:
        routes = list(self._routes.items())
        for request_id, route in routes:
            route.sink.put(error)
            try:
                self._abort([request_id])
            except Exception:  # the engine may be inconsistent after a failed step
                self._unroute(request_id)
