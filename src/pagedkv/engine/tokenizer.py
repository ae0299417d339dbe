"""The tokenizer of a model directory, and incremental detokenization for streaming."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagedkv.errors import CheckpointError, InvalidRequest

#: A chat message as OpenAI clients send it: ``{"role": ..., "content": ...}``.
Message = dict[str, str]


class Tokenizer:
    """A Hugging Face tokenizer loaded offline from a model directory."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        path = Path(model_dir)
        if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
            raise CheckpointError(f"{path} has no tokenizer.json or tokenizer_config.json")
        self._tok: Any = AutoTokenizer.from_pretrained(str(path), local_files_only=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    @property
    def eos_token_id(self) -> int | None:
        value = self._tok.eos_token_id
        return None if value is None else int(value)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without special tokens added."""
        return [int(t) for t in self._tok.encode(text, add_special_tokens=False)]

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``, special tokens skipped."""
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))

    def apply_chat_template(self, messages: Sequence[Message]) -> list[int]:
        """Token ids of a chat prompt ending with the assistant's turn opened."""
        if not self.has_chat_template:
            raise InvalidRequest("this model's tokenizer has no chat template")
        text = self._tok.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True
        )
        return self.encode(str(text))


def eos_token_ids(model_dir: str | Path) -> frozenset[int]:
    """EOS ids from ``config.json`` and ``generation_config.json`` (either may hold a list)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if not path.exists():
            continue
        value = json.loads(path.read_text()).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return frozenset(ids)


class IncrementalText:
    """Text of a growing token list, with stop strings cut (ENG-043).

    Decoding the whole output each time keeps multi-byte characters right; text is released
    only up to a complete character, so a stream never shows half of one. Until the request
    ends, the last ``len(longest stop string) - 1`` characters are held back, as they could
    still begin a stop string: what has been released is never taken back, so a stream of
    ``new_text`` always adds up to the final text.

    Attributes:
        text: the text released so far (the concatenation of every ``new_text``).
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str]) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._longest_stop = max((len(s) for s in stop), default=0)
        self._decoded = ""  # everything decoded so far, cut at a stop string
        self.text = ""

    def update(self, output_ids: Sequence[int], final: bool) -> tuple[str, bool]:
        """Returns ``(new_text, stopped)`` after the latest token."""
        full = self._tokenizer.decode(output_ids)
        if full.endswith("\ufffd") and not final:
            return "", False  # an incomplete character: wait for the next token
        stopped = False
        if self._stop:
            search_from = max(0, len(self._decoded) - self._longest_stop + 1)
            hits = [i for i in (full.find(s, search_from) for s in self._stop) if i >= 0]
            if hits:
                full = full[: min(hits)]
                stopped = True
        self._decoded = full
        held = 0 if final or stopped else max(0, self._longest_stop - 1)
        released = full[: max(len(self.text), len(full) - held)]
        new = released[len(self.text) :] if released.startswith(self.text) else released
        self.text = released
        return new, stopped
