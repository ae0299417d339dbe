"""An asyncio front for a synchronous :class:`~pagedkv.interfaces.Engine`.

One background thread owns the engine (:class:`~pagedkv.entrypoints.server.engine_loop.EngineLoop`):
it alone adds, steps and aborts. Text is tokenized, rendered and decoded apart from it, on the
text worker (:mod:`pagedkv.entrypoints.server.text_worker`, SRV-115): the engine thread receives
token ids and sends ids back, so no request body, however big, holds up the steps of the others.

Request handlers submit work through the loop's thread-safe command queue and receive each
request's outputs on their own ``asyncio.Queue``, filled from the engine thread with
``loop.call_soon_threadsafe``.

Admission (see :mod:`pagedkv.entrypoints.server.policy`) happens at both ends: the prompt
count is checked when a request is submitted, the queue depth on the engine thread when it is
added, and deadlines between steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeVar

from pagedkv.engine.outputs import EngineStats, RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.entrypoints.server.engine_loop import (
    IDLE_RELEASE_S,
    Abort,
    Call,
    EngineFailure,
    EngineLoop,
    EngineUnavailable,
    RequestFailed,
    Stop,
    StreamItem,
    Submit,
)
from pagedkv.entrypoints.server.policy import Refused, ServerPolicy
from pagedkv.entrypoints.server.text_worker import (
    ChatPrompt,
    PromptInput,
    TextWorker,
    logprob_token_ids,
)
from pagedkv.errors import InvalidRequest
from pagedkv.interfaces import Engine

T = TypeVar("T")

#: Seconds ``shutdown`` waits for the engine thread to end.
SHUTDOWN_TIMEOUT_S = 10.0

logger = logging.getLogger("pagedkv.server")

__all__ = [
    "IDLE_RELEASE_S",
    "AsyncEngine",
    "ChatPrompt",
    "EngineFailure",
    "EngineUnavailable",
    "GenerationStream",
    "PromptInput",
    "RequestFailed",
    "StreamItem",
]


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
        """Args: as :class:`~pagedkv.entrypoints.server.engine_loop.EngineLoop`'s, which runs
        ``engine`` on this object's thread; ``policy`` also bounds the prompts of one
        submission, checked here.

        Raises:
            InvalidRequest: ``release_after_s`` below 0 or not finite.
        """
        self._engine_loop = EngineLoop(
            engine,
            policy,
            observer=observer,
            release_memory=release_memory,
            release_after_s=release_after_s,
        )
        self._thread: threading.Thread | None = None
        #: Tokenizes, renders and decodes apart from the engine thread (SRV-115).
        self.text = TextWorker(engine.tokenizer, engine.max_model_len)
        self.policy = policy
        self.max_model_len = engine.max_model_len
        self.generation_defaults = engine.generation_defaults

    # -- lifecycle (event-loop side) --------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise EngineUnavailable("the engine thread was already started")
        self._thread = threading.Thread(
            target=self._engine_loop.run, name="pagedkv-engine", daemon=True
        )
        self._thread.start()

    def stop_admitting(self) -> None:
        """Refuse every later submission (``EngineUnavailable``, answered 503) while the
        requests already accepted go on: the first step of a graceful shutdown."""
        self._engine_loop.admitting.clear()

    @property
    def is_admitting(self) -> bool:
        """Whether the engine runs and new submissions are accepted."""
        return self.is_running and self._engine_loop.admitting.is_set()

    def shutdown(self) -> None:
        """Abort every request in flight and stop the engine thread."""
        self._engine_loop.admitting.clear()
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._engine_loop.put(Stop())
            thread.join(SHUTDOWN_TIMEOUT_S)
        if thread is not None and not thread.is_alive():
            self._engine_loop.fail_pending()  # submitted while the thread was stopping
        self.text.close()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        """The engine's counters as of the end of its latest step or command."""
        return self._engine_loop.stats()

    @property
    def memory_releases(self) -> int:
        """How many times the engine thread, idle, ran its release (SRV-137) and the release
        returned (whether or not it found memory to give back)."""
        return self._engine_loop.releases

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
        if not self._engine_loop.admitting.is_set():
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
        command = Submit(
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
        self._engine_loop.put(command)
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
        self._engine_loop.put(Abort(tuple(request_ids)))

    async def run_on_engine(self, function: Callable[[], T]) -> T:
        """``function()`` run on the engine thread, between two steps.

        Raises:
            EngineUnavailable: the engine thread is not running.
            Exception: whatever ``function`` raised.
        """
        if not self.is_running:
            raise EngineUnavailable("the engine is not running")
        result: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._engine_loop.put(Call(function, result))
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
