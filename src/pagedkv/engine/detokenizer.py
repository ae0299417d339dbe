"""Incremental detokenization: the text of one completion, token by token, with stop strings.

Each new token costs O(1) work (amortised), not a decode of the whole output: a fast
tokenizer steps the ``tokenizers`` library's ``DecodeStream``; any other tokenizer decodes a
short window of tokens around the new one (:class:`WindowDecoder`), the method vLLM and
transformers' streamers use. Either way a partial UTF-8 character is held until it completes.

Text that could still become a stop string is held back (ENG-091): when the text ends with the
beginning of a stop string, that tail is not released until the next tokens show whether the
stop string completes (then it is cut) or not (then it is released). So the deltas a stream
shows always add up to the final text (ENG-090).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pagedkv.engine.params import SamplingParams

#: Steps one token id into text: the characters it completes (possibly none).
DecodeStep = Callable[[int], str]

#: The message ``DecodeStream`` raises when a tokenizer's output stops being valid UTF-8 at
#: the stream's prefix; the stream is restarted from the offending token.
_INVALID_PREFIX = "Invalid prefix encountered"


class DecodeStreamDecoder:
    """Steps a ``tokenizers.Tokenizer`` with its ``DecodeStream`` (special tokens skipped
    unless ``skip_special_tokens`` is false)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._new_stream: Callable[[], Any] = lambda: DecodeStream(
            skip_special_tokens=skip_special_tokens
        )
        self._stream = self._new_stream()

    def __call__(self, token_id: int) -> str:
        try:
            text = self._stream.step(self._tokenizer, token_id)
        except Exception as exc:
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            self._stream = self._new_stream()
            text = self._stream.step(self._tokenizer, token_id)
        return text or ""


class WindowDecoder:
    """Steps any ``decode(ids) -> str`` by decoding only the tokens since the last released
    text (plus the one before, for context), as transformers' ``TextStreamer`` does.

    Args:
        decode: the tokenizer's decode (special tokens skipped).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # first token of the window, released already
        self._read = 0  # tokens before this one have been released

    def __call__(self, token_id: int) -> str:
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        now = self._decode(self._ids[self._prefix :])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""  # nothing yet, or half a character
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(before) :]


class IncrementalDetokenizer:
    """The text of one completion as its tokens arrive, stop strings cut (ENG-043, ENG-091).

    Args:
        step: the tokenizer's incremental decoder for this completion.
        params: its sampling parameters (stop strings, ``min_tokens``,
            ``include_stop_str_in_output``).
    """

    def __init__(self, step: DecodeStep, params: SamplingParams) -> None:
        self._step = step
        self._stop = params.stop
        self._min_tokens = params.min_tokens
        self._include_stop = params.include_stop_str_in_output
        self._num_tokens = 0
        self._released = 0
        self.text = ""

    def update(self, new_token_ids: Sequence[int], stop_token: bool = False) -> str | None:
        """Add the newest tokens; returns the stop string they completed, if any (the text is
        then cut before it, or after it with ``include_stop_str_in_output``).

        ``stop_token``: the last token ended the completion (EOS or a stop token); its text is
        left out unless ``include_stop_str_in_output``, as vLLM does. A stop string counts
        only once more than ``min_tokens`` tokens have been generated, and only if it ends in
        text added after the first ``min_tokens``.
        """
        ids = list(new_token_ids)
        skipped = 1 if stop_token and ids and not self._include_stop else 0
        search_from = len(self.text)
        for token_id in ids[: len(ids) - skipped]:
            self.text += self._step(token_id)
            self._num_tokens += 1
            if self._num_tokens <= self._min_tokens:
                search_from = len(self.text)
        self._num_tokens += skipped
        if not self._stop or self._num_tokens <= self._min_tokens:
            return None
        return self._cut_at_stop(search_from)

    def _cut_at_stop(self, search_from: int) -> str | None:
        """Cut the text at the earliest stop string ending after ``search_from``."""
        found: tuple[int, str] | None = None
        for stop in self._stop:
            at = self.text.find(stop, max(0, search_from - len(stop) + 1))
            if at >= 0 and (found is None or at < found[0]):
                found = (at, stop)
        if found is None:
            return None
        at, stop = found
        self.text = self.text[: at + len(stop) if self._include_stop else at]
        return stop

    def _held_back(self) -> int:
        """Characters at the end of the text that begin some stop string."""
        if self._include_stop:
            return 0
        held = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(self.text)), held, -1):
                if self.text.endswith(stop[:length]):
                    held = length
                    break
        return held

    @property
    def released(self) -> str:
        """The text released so far: what the deltas of :meth:`release` add up to."""
        return self.text[: self._released]

    def release(self, finished: bool) -> str:
        """The text not yet released that can no longer become part of a stop string (all of
        it once the completion has finished)."""
        end = len(self.text) if finished else len(self.text) - self._held_back()
        if end <= self._released:
            return ""
        delta = self.text[self._released : end]
        self._released = end
        return delta
