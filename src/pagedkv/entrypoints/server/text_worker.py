"""Text to token ids and back, apart from the engine thread (SRV-115, SRV-116).

Tokenizing a big body, rendering a long conversation through the chat template, or decoding the
token texts of a long prompt's logprobs takes time in proportion to the text. Done on the engine
thread it would stall every stream for that time; so the server does it here, on one worker
thread, and the engine thread receives token ids only. The Hugging Face fast tokenizer encodes
in Rust with the GIL released, so the engine thread keeps stepping meanwhile. One worker keeps
the tokenizer's own calls in sequence (its Python side is not documented as thread-safe).

A text that cannot fit is refused before any of that work (SRV-116): one token stands for at
most :meth:`~pagedkv.engine.tokenizer.Tokenizer.bytes_per_token` bytes of text, so a prompt
text of more than ``max_model_len`` times that many UTF-8 bytes encodes to more tokens than the
model's context holds, whatever it says.

What stays on the engine thread: the incremental detokenization of each completion as its
tokens arrive (ENG-043, with the stop strings that end a sequence in the step that completes
them, ENG-091). It costs O(1) per generated token, bounded by the step's own batch, never by the
size of someone's request body.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.tokenizer import Message, Tokenizer
from pagedkv.errors import InvalidRequest, RequestTooLong

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A conversation, rendered through the tokenizer's chat template by the text worker,
    with further template variables (``chat_template_kwargs``), the assistant's turn opened
    (``add_generation_prompt``) or its last message continued (``continue_final_message``,
    SRV-118)."""

    messages: tuple[Message, ...]
    template_kwargs: Mapping[str, object] = dataclasses.field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    #: OpenAI tool declarations the template renders; empty for none.
    tools: tuple[Mapping[str, Any], ...] = ()


#: What a request generates from: text, token ids, or a conversation.
PromptInput = str | tuple[int, ...] | ChatPrompt


class TextTooLong(RequestTooLong):
    """A prompt text so long that no tokenization of it fits the model's context (SRV-116).

    Attributes:
        param: the request field holding the text (``prompt``, ``messages``).
    """

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class TextWorker:
    """Tokenizes, renders chat templates and decodes on one thread of its own.

    Call :meth:`close` at the end; calls after it raise ``RuntimeError``.
    """

    def __init__(self, tokenizer: Tokenizer | None, max_model_len: int) -> None:
        """Args:
        tokenizer: the model's tokenizer, ``None`` when it has none (prompts are ids).
        max_model_len: most positions one sequence may hold.
        """
        self._tokenizer = tokenizer
        per_token = None if tokenizer is None else tokenizer.bytes_per_token()
        self._max_model_len = max_model_len
        #: Most UTF-8 bytes of a prompt text that might fit; ``None``: no bound is known.
        self.max_text_bytes = None if per_token is None else max_model_len * per_token
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedkv-text")

    def close(self) -> None:
        """Stop the worker thread; work not yet started is dropped."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, function: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, function)

    def _needed(self) -> Tokenizer:
        if self._tokenizer is None:
            raise InvalidRequest("this model has no tokenizer: send token ids")
        return self._tokenizer

    def check_size(self, text: str, param: str) -> None:
        """Refuse ``text`` when its size alone proves it too long (SRV-116).

        Raises:
            TextTooLong: naming ``param``.
        """
        bound = self.max_text_bytes
        if bound is None or len(text) * 4 <= bound:  # at most 4 bytes per character
            return
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > bound:
            raise TextTooLong(
                f"{param} has {size} bytes of text: more than the {bound} bytes of any prompt "
                f"that fits the model's {self._max_model_len} positions",
                param,
            )

    async def tokenize(self, prompt: PromptInput, add_special_tokens: bool = False) -> list[int]:
        """The token ids of ``prompt``: ids as given, a text encoded, a conversation rendered
        and encoded, on the worker thread; with ``add_special_tokens`` the tokenizer's special
        tokens (its BOS, where it has one) are added to texts (SRV-118).

        Raises:
            TextTooLong: the text, or the rendered conversation, cannot fit (SRV-116).
            InvalidRequest: the model has no tokenizer (or chat template) for this prompt.
        """
        if isinstance(prompt, tuple):
            return list(prompt)
        tokenizer = self._needed()
        if isinstance(prompt, str):
            self.check_size(prompt, "prompt")
            return await self._run(lambda: tokenizer.encode(prompt, add_special_tokens))
        chat = prompt

        def render_and_encode() -> list[int]:
            text = tokenizer.render_chat_template(
                chat.messages,
                chat.template_kwargs,
                add_generation_prompt=chat.add_generation_prompt,
                continue_final_message=chat.continue_final_message,
                tools=chat.tools or None,
            )
            self.check_size(text, "messages")
            return tokenizer.encode(text, add_special_tokens)

        return await self._run(render_and_encode)

    async def detokenize(self, token_ids: Sequence[int], *, each: bool = False) -> list[str]:
        """The text of ``token_ids`` (special tokens skipped): one string, or with ``each``
        one per token.

        Raises:
            InvalidRequest: the model has no tokenizer.
        """
        if self._tokenizer is None:
            raise InvalidRequest("this model has no tokenizer")
        tokenizer, ids = self._tokenizer, list(token_ids)
        if each:
            return await self._run(lambda: [tokenizer.decode([i]) for i in ids])
        return await self._run(lambda: [tokenizer.decode(ids)])

    async def token_texts(self, token_ids: Iterable[int]) -> dict[int, str]:
        """The text of each token id (``token_id:N`` for a model without a tokenizer)."""
        ids = sorted(set(token_ids))
        tokenizer = self._tokenizer
        if tokenizer is None:
            return {i: f"token_id:{i}" for i in ids}
        if not ids:
            return {}
        return await self._run(lambda: {i: tokenizer.decode([i]) for i in ids})


def logprob_token_ids(output: RequestOutput, *, prompt: bool) -> set[int]:
    """Every token id in the new logprobs entries of each completion of ``output`` (chosen and
    top tokens), and with ``prompt`` the prompt's tokens and their alternatives (for ``echo``
    and ``prompt_logprobs``): the ids whose texts a response with logprobs shows."""
    ids: set[int] = set()
    for completion in output.outputs:
        if completion.logprobs is None or not completion.new_token_ids:
            continue
        for entry in completion.logprobs[-len(completion.new_token_ids) :]:
            ids.add(entry.token_id)
            ids.update(token for token, _ in entry.top)
    if prompt:
        ids.update(output.prompt_token_ids)
        for prompt_entry in output.prompt_logprobs or ():
            if prompt_entry is not None:
                ids.update(token for token, _ in prompt_entry.top)
    return ids
