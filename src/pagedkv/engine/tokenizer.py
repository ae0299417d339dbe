"""The tokenizer of a model directory."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pagedkv.engine.chat_template import check_template_kwargs, template_variables
from pagedkv.engine.detokenizer import DecodeStep, DecodeStreamDecoder, WindowDecoder
from pagedkv.engine.text_bound import bytes_per_token_of
from pagedkv.errors import CheckpointError, InvalidRequest

#: A chat message as OpenAI clients send it: ``{"role": ..., "content": ...}``, and for tool
#: calls ``tool_calls`` (assistant) or ``tool_call_id`` (tool).
Message = dict[str, Any]
#: A tool as OpenAI clients declare it: ``{"type": "function", "function": {...}}``.
Tool = Mapping[str, Any]


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

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``, without special tokens added unless ``add_special_tokens``
        (the tokenizer's BOS, where it has one).

        A fast tokenizer encodes through its Rust backend's batch call, which releases the
        interpreter's lock while it works, into the ids transformers' ``encode`` gives: the
        server encodes big texts beside the engine thread, which must not wait on the lock for
        transformers' conversions (SRV-141)."""
        backend = self._plain_backend()
        if backend is None:
            return [int(t) for t in self._tok.encode(text, add_special_tokens=add_special_tokens)]
        ids: list[int] = backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return ids

    def _plain_backend(self) -> Any:
        """The fast tokenizer's backend when a call to it encodes as transformers' ``encode``
        does: no truncation or padding set on it, and special tokens in a text split only where
        the tokenizer says so (``split_special_tokens``); otherwise ``None``."""
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None or backend.truncation is not None or backend.padding is not None:
            return None
        split = bool(getattr(self._tok, "split_special_tokens", False))
        return backend if bool(backend.encode_special_tokens) == split else None

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``, special tokens skipped unless ``skip_special_tokens`` is
        false."""
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    @property
    def hf(self) -> Any:
        """The underlying Hugging Face tokenizer (what vLLM's ``get_tokenizer`` returns)."""
        return self._tok

    def tokenizer_json(self) -> str:
        """The tokenizer as Hugging Face ``tokenizer.json`` text, added tokens included (what a
        grammar engine reads its vocabulary from).

        Raises:
            InvalidRequest: a slow tokenizer, which has no such form.
        """
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None:
            raise InvalidRequest("structured outputs need a fast (tokenizer.json) tokenizer")
        return str(backend.to_str())

    def incremental_decoder(
        self, *, window: bool = False, skip_special_tokens: bool = True
    ) -> DecodeStep:
        """A fresh decoder of one token stream: O(1) work per token, special tokens skipped
        unless ``skip_special_tokens`` is false (``DecodeStream`` for a fast tokenizer; a
        sliding window otherwise, or when asked)."""
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is not None and not window:
            return DecodeStreamDecoder(backend, skip_special_tokens)
        return WindowDecoder(lambda ids: self.decode(ids, skip_special_tokens))

    def use_chat_template(self, template: str) -> None:
        """Render every chat through ``template`` (a Jinja template, or a file holding one)
        instead of the model's own: vLLM's ``chat_template`` engine argument (ENG-180)."""
        path = Path(template)
        if "{" not in template and path.is_file():
            template = path.read_text(encoding="utf-8")
        self._tok.chat_template = template

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        template_kwargs: Mapping[str, object] | None = None,
        tools: Sequence[Tool] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Token ids of a chat prompt ending with the assistant's turn opened (unless
        ``add_generation_prompt`` is false, or ``continue_final_message`` leaves the last
        assistant message open to be continued; vLLM's arguments, ENG-188).

        ``template_kwargs`` are further template variables (Qwen3's ``enable_thinking``); a key
        the template does not read, or one the renderer sets itself, raises
        :class:`InvalidRequest` naming it. ``tools`` are rendered by the template (Qwen3's
        ``<tools>`` block, ENG-196); a template that never reads ``tools`` raises
        :class:`InvalidRequest`, since the model would never see them. ``chat_template``
        replaces the model's template for this call. ``add_special_tokens`` tokenizes the
        rendered text with the tokenizer's special tokens (the server's field of that name).

        Raises:
            InvalidRequest: no template; both ``add_generation_prompt`` and
                ``continue_final_message``; a bad template variable.
        """
        return self.encode(
            self.render_chat_template(
                messages,
                template_kwargs,
                tools,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
            ),
            add_special_tokens,
        )

    def render_chat_template(
        self,
        messages: Sequence[Message],
        template_kwargs: Mapping[str, object] | None = None,
        tools: Sequence[Tool] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """The text of a chat prompt: what :meth:`apply_chat_template` encodes (see there)."""
        if chat_template is None and not self.has_chat_template:
            raise InvalidRequest("this model's tokenizer has no chat template")
        if add_generation_prompt and continue_final_message:
            raise InvalidRequest(
                "continue_final_message continues the last message: it takes "
                "add_generation_prompt=False"
            )
        kwargs = dict(template_kwargs or {})
        if tools:
            template = self._tok.chat_template
            sources = template.values() if isinstance(template, dict) else [template]
            if not any("tools" in template_variables(str(t)) for t in sources):
                raise InvalidRequest("this model's chat template does not render tools")
        if kwargs:
            template = chat_template if chat_template is not None else self._tok.chat_template
            sources = template.values() if isinstance(template, dict) else [template]
            check_template_kwargs([str(t) for t in sources], kwargs)
        extra: dict[str, Any] = {}
        if chat_template is not None:
            extra["chat_template"] = chat_template
        if continue_final_message:
            extra["continue_final_message"] = True
        text = self._tok.apply_chat_template(
            list(messages),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **extra,
            tools=[dict(t) for t in tools] if tools else None,
            **kwargs,
        )
        return str(text)

    def bytes_per_token(self) -> int | None:
        """The most UTF-8 bytes of text one token can stand for (normalization counted), or
        ``None`` when the tokenizer's definition proves no bound (see
        :mod:`pagedkv.engine.text_bound`). Reads the whole vocabulary: call it once."""
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None:  # a slow tokenizer: no tokenizer.json to read
            return None
        return bytes_per_token_of(backend.to_str())

    def token_id(self, text: str) -> int | None:
        """The id of the single vocabulary token spelled ``text``, or ``None``."""
        ids = self.encode(text)
        return ids[0] if len(ids) == 1 else None


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
