"""An asyncio front for a synchronous :class:`~pagedkv.interfaces.Engine`.

One background thread owns the engine: it alone adds, steps and aborts, so the engine needs
no locks. Text is tokenized, rendered and decoded apart from it, on the text worker
(:mod:`pagedkv.entrypoints.server.text_worker`, SRV-115): the engine thread receives token ids
and sends ids back, so no request body, however big, holds up the steps of the others.

Request handlers submit work through a thread-safe command queue and receive each request's
outputs on their own ``asyncio.Queue``, filled from the engine thread with
``loop.call_soon_threadsafe``. The thread steps while any request is unfinished and sleeps on
the command queue otherwise; once it has slept :data:`IDLE_RELEASE_S` after serving, it gives
the memory its steps freed back to the system (SRV-137), and it keeps nothing of a request
that ended (SRV-138).

Admission (see :mod:`pagedkv.entrypoints.server.policy`) happens at both ends: the prompt
count is checked when a request is submitted, the queue depth on the engine thread when it is
added (where the engine's count of waiting requests is exact), and deadlines between steps.

Failures stay with the request they belong to (SRV-023, SRV-024): a request the engine finishes
with reason ``error``, or whose output the server fails to serve, fails alone, and the rest of
its submission is aborted; a step that raises is tried again, and only a run of them ends what
is in flight. An engine whose runner can run nothing more (``RunnerFailed``: a tensor-parallel
worker died, TP-022) ends what is in flight at once and stops the thread: later submissions and
``/health`` are answered 503.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pagedkv.engine.outputs import EngineStats, RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.entrypoints.server.deadlines import Deadlines
from pagedkv.entrypoints.server.policy import Refused, ServerPolicy
from pagedkv.entrypoints.server.text_worker import (
    ChatPrompt,
    PromptInput,
    TextWorker,
    logprob_token_ids,
)
from pagedkv.errors import InvalidRequest, PagedKVError, RunnerFailed
from pagedkv.interfaces import Engine

T = TypeVar("T")

#: Seconds the engine thread waits for a command when a step scheduled nothing.
IDLE_POLL_S = 0.005
#: Seconds ``shutdown`` waits for the engine thread to end.
SHUTDOWN_TIMEOUT_S = 10.0
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


__all__ = ["AsyncEngine", "ChatPrompt", "GenerationStream", "PromptInput", "StreamItem"]


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


class _Sink:
    """Hands items from the engine thread to one asyncio queue."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, items: asyncio.Queue[StreamItem | BaseException]
    ) -> None:
        self._loop = loop
        self._items = items

    def put(self, item: StreamItem | BaseException) -> None:
        # a closed loop raises RuntimeError: nobody is listening any more
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)


@dataclass(frozen=True, slots=True)
class _Submit:
    request_ids: tuple[str, ...]
    prompts: tuple[tuple[int, ...], ...]  # token ids: tokenized by the text worker
    params: SamplingParams
    fill_context: bool
    token_texts: bool
    cache_salt: str | None
    deadline: float | None  # time.monotonic() seconds
    sink: _Sink
    accepted: concurrent.futures.Future[None]
    priority: int = 0


@dataclass(frozen=True, slots=True)
class _Abort:
    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _Call:
    """Run ``function`` on the engine thread and keep its result."""

    function: Callable[[], Any]
    result: concurrent.futures.Future[Any]


class _Stop:
    pass


_Command = _Submit | _Abort | _Call | _Stop


@dataclass(slots=True)
class _Route:
    sink: _Sink
    index: int


class GenerationStream:
    """The outputs of one accepted submission, consumed on the event loop."""

    def __init__(
        self,
        bridge: AsyncEngine,
        request_ids: tuple[str, ...],
        items: asyncio.Queue[StreamItem | BaseException],
        *,
        token_texts: bool = False,
    ) -> None:
        """Args:
        token_texts: decode the token ids of each item's logprobs entries (and, with its
            prompt's first item, of the prompt) on the text worker (see :class:`StreamItem`).
        """
        self.request_ids = request_ids
        self._bridge = bridge
        self._items = items
        self._unfinished = set(request_ids)
        self._token_texts = token_texts
        self._seen: set[int] = set()  # prompt indices whose prompt token texts were given

    @property
    def finished(self) -> bool:
        return not self._unfinished

    async def __aiter__(self) -> AsyncIterator[StreamItem]:
        """Yield items in step order until every prompt has finished.

        Raises:
            RequestFailed: one of its requests failed; the others are aborted.
            EngineFailure: steps kept failing; the requests are already ended.
            EngineUnavailable: the engine stopped; the requests are already ended.
            DeadlineExceeded: the submission ran past its deadline; the requests are aborted.
        """
        while self._unfinished:
            item = await self._items.get()
            if isinstance(item, BaseException):
                self.abort()  # the submission fails as a whole: free what is left of it
                raise item
            if item.output.finished:
                self._unfinished.discard(item.output.request_id)
            if self._token_texts:
                item = await self._with_texts(item)
            yield item

    async def _with_texts(self, item: StreamItem) -> StreamItem:
        """``item`` with the texts of its logprobs' token ids, decoded on the text worker; a
        failure fails this submission alone (SRV-024)."""
        ids = logprob_token_ids(item.output, prompt=item.index not in self._seen)
        try:
            texts = await self._bridge.text.token_texts(ids)
        except Exception as exc:  # this request's own output: it fails alone
            logger.warning(
                "request %s failed: serving its output failed: %r", item.output.request_id, exc
            )
            self.abort()
            raise RequestFailed(f"the request failed: serving its output failed: {exc!r}") from exc
        self._seen.add(item.index)
        return dataclasses.replace(item, token_texts=texts)

    def abort(self) -> None:
        """End every unfinished prompt of the submission and free its pages. Idempotent."""
        if self._unfinished:
            self._bridge.abort(tuple(self._unfinished))
            self._unfinished.clear()


class AsyncEngine:
    """Owns an engine on a background thread; see the module docstring.

    Call :meth:`start` before submitting and :meth:`shutdown` at the end; both are called from
    the thread that owns the event loop.
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
        policy: what the server admits (prompts per request, queue depth, deadlines).
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
        self._engine = engine
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._routes: dict[str, _Route] = {}
        self._thread: threading.Thread | None = None
        self._stats = engine.stats()
        self._observer = observer
        self._admitting = threading.Event()
        self._admitting.set()
        self._deadlines = Deadlines()
        self._step_errors = 0
        self._release_memory = release_memory
        self._release_after_s = release_after_s
        #: Whether the engine ran a step or a command since memory was last released.
        self._release_due = False
        self._commands_run = 0
        self._releases = 0
        #: Tokenizes, renders and decodes apart from the engine thread (SRV-115).
        self.text = TextWorker(engine.tokenizer, engine.max_model_len)
        self.policy = policy
        self.max_model_len = engine.max_model_len
        self.generation_defaults = engine.generation_defaults

    # -- lifecycle (event-loop side) --------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise EngineUnavailable("the engine thread was already started")
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
        self._thread.start()

    def stop_admitting(self) -> None:
        """Refuse every later submission (``EngineUnavailable``, answered 503) while the
        requests already accepted go on: the first step of a graceful shutdown."""
        self._admitting.clear()

    @property
    def is_admitting(self) -> bool:
        """Whether the engine runs and new submissions are accepted."""
        return self.is_running and self._admitting.is_set()

    def shutdown(self) -> None:
        """Abort every request in flight and stop the engine thread."""
        self._admitting.clear()
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._commands.put(_Stop())
            thread.join(SHUTDOWN_TIMEOUT_S)
        if thread is not None and not thread.is_alive():
            self._fail_pending()  # submitted while the thread was stopping
        self.text.close()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        """The engine's counters as of the end of its latest step or command."""
        return self._stats

    @property
    def memory_releases(self) -> int:
        """How many times the engine thread, idle, ran its release (SRV-137) and the release
        returned (whether or not it found memory to give back)."""
        return self._releases

    # -- requests (event-loop side) ---------------------------------------------------------

    async def submit(
        self,
        prompts: Sequence[PromptInput],
        params: SamplingParams,
        *,
        fill_context: bool = False,
        token_texts: bool = False,
        cache_salt: str | None = None,
        priority: int = 0,
        add_special_tokens: bool = False,
        request_id: str | None = None,
    ) -> GenerationStream:
        """Tokenize the prompts on the text worker, then queue one request per prompt, all or
        none.

        Args:
            prompts: at least one prompt, as many as the policy admits in one request.
            params: sampling parameters shared by every prompt.
            fill_context: replace ``params.max_tokens`` by the positions left in the model's
                context after each prompt.
            token_texts: decode the token ids of logprobs entries (see :class:`StreamItem`).
            cache_salt: the prefix-cache namespace of every prompt: pages are shared only
                between requests with the same salt.
            priority: every prompt's priority (the engine refuses one other than 0 unless it
                schedules by priority, ENG-189).
            add_special_tokens: text prompts are tokenized with the tokenizer's special
                tokens.
            request_id: the base of the engine's request ids (``ID-0``, ``ID-1``, ...; a
                fresh one when ``None``); one still in use is refused by the engine.

        Raises:
            InvalidRequest: a prompt is invalid or can never fit (``RequestTooLong``; a text
                too long by its size alone, ``TextTooLong``), or there are too many
                (``TooManyPrompts``); nothing was queued.
            QueueFull: the engine's waiting queue has no room for them now.
            EngineUnavailable: the engine thread is not running, or the server is shutting
                down.
        """
        if not self.is_running:
            raise EngineUnavailable("the engine is not running")
        if not self._admitting.is_set():
            raise EngineUnavailable("the server is shutting down")
        if not prompts:
            raise InvalidRequest("the prompt is empty")
        admitted = self.policy.admit_prompts(len(prompts))
        if isinstance(admitted, Refused):
            raise admitted.reason
        deadline = self.policy.deadline(time.monotonic())
        token_ids = tuple([tuple(await self.text.tokenize(p, add_special_tokens)) for p in prompts])
        if not self.is_admitting:  # it stopped while the text worker ran
            raise EngineUnavailable("the server is shutting down")
        items: asyncio.Queue[StreamItem | BaseException] = asyncio.Queue()
        base = request_id or uuid.uuid4().hex
        request_ids = tuple(f"{base}-{i}" for i in range(len(prompts)))
        accepted: concurrent.futures.Future[None] = concurrent.futures.Future()
        sink = _Sink(asyncio.get_running_loop(), items)
        command = _Submit(
            request_ids,
            token_ids,
            params,
            fill_context,
            token_texts,
            cache_salt,
            deadline,
            sink,
            accepted,
            priority,
        )
        self._commands.put(command)
        stream = GenerationStream(self, request_ids, items, token_texts=token_texts)
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            stream.abort()
            raise
        return stream

    def abort(self, request_ids: Sequence[str]) -> None:
        """Ask the engine thread to abort these requests; unknown or finished ids are
        ignored. Returns at once."""
        self._commands.put(_Abort(tuple(request_ids)))

    async def run_on_engine(self, function: Callable[[], T]) -> T:
        """``function()`` run on the engine thread, between two steps.

        Raises:
            EngineUnavailable: the engine thread is not running.
            Exception: whatever ``function`` raised.
        """
        if not self.is_running:
            raise EngineUnavailable("the engine is not running")
        result: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put(_Call(function, result))
        return await asyncio.wrap_future(result)

    async def tokenize(self, prompt: PromptInput) -> list[int]:
        """The token ids :meth:`submit` would give the engine for ``prompt``, from the text
        worker.

        Raises:
            TextTooLong: the text cannot fit, whatever it encodes to (SRV-116).
            InvalidRequest: the model has no tokenizer (or chat template) for this prompt.
            EngineUnavailable: the engine thread is not running.
        """
        if not self.is_running:
            raise EngineUnavailable("the engine is not running")
        return await self.text.tokenize(prompt)

    async def detokenize(self, token_ids: Sequence[int], *, each: bool = False) -> list[str]:
        """The text of ``token_ids`` (special tokens skipped): one string, or with ``each``
        one per token, from the text worker.

        Raises:
            InvalidRequest: the model has no tokenizer.
            EngineUnavailable: the engine thread is not running.
        """
        if not self.is_running:
            raise EngineUnavailable("the engine is not running")
        return await self.text.detokenize(token_ids, each=each)

    # -- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # a bug: fail what is in flight rather than hang it
            with contextlib.suppress(Exception):
                self._end_all(EngineFailure(f"the engine thread failed: {exc!r}"))
            raise

    def _serve(self) -> None:
        idle_timeout: float | None = None
        while True:
            busy = self._engine.has_unfinished_requests()
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
            self._stats = self._engine.stats()
            if self._engine.has_unfinished_requests():
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
            if isinstance(command, _Stop):
                self._end_all(EngineUnavailable("the server is shutting down"))
                self._fail_pending()
                self._stats = self._engine.stats()
                return False
            if isinstance(command, _Submit):
                self._add(command)
            elif isinstance(command, _Call):
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

    def _add(self, command: _Submit) -> None:
        if not command.accepted.set_running_or_notify_cancel():
            return  # the handler went away before its request was queued
        added: list[str] = []
        try:
            admitted = self.policy.admit_queue(self._engine.stats().waiting, len(command.prompts))
            if isinstance(admitted, Refused):
                raise admitted.reason
            for index, (request_id, prompt) in enumerate(
                zip(command.request_ids, command.prompts, strict=True)
            ):
                token_ids = list(prompt)
                params = command.params
                if command.fill_context:
                    left = max(1, self._engine.max_model_len - len(token_ids))
                    params = dataclasses.replace(params, max_tokens=left)
                if command.priority:  # engines without priority scheduling take none
                    self._engine.add_request(
                        token_ids,
                        params,
                        request_id=request_id,
                        cache_salt=command.cache_salt,
                        priority=command.priority,
                    )
                else:
                    self._engine.add_request(
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

    def _fail_pending(self) -> None:
        """Refuse the commands still queued once the thread has stopped serving."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            future: concurrent.futures.Future[Any] | None = None
            if isinstance(command, _Submit):
                future = command.accepted
            elif isinstance(command, _Call):
                future = command.result
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(EngineUnavailable("the server is shutting down"))

    def _call(self, command: _Call) -> None:
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
            output = self._engine.abort(request_id)
            if output is not None:
                self._observe(output)

    def _step(self) -> bool:
        """Run one step and route its outputs; ``False`` when the engine has ended."""
        try:
            outputs = self._engine.step()
        except RunnerFailed as exc:  # nothing can run any more: end everything, stop
            logger.error("the engine ended: %s", exc)
            self._admitting.clear()
            self._end_all(EngineFailure(f"the engine ended: {exc}"))
            self._fail_pending()
            with contextlib.suppress(Exception):
                self._stats = self._engine.stats()
            return False
        except Exception as exc:  # an engine that does not isolate its failures, or a bug
            self._step_raised(exc)
            return True
        self._step_errors = 0
        self._stats = self._engine.stats()  # published before any output reaches a handler
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
            self._stats = self._engine.stats()

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
