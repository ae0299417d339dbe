"""The reference a server is held to: the checkpoint run by transformers, greedy, one request
at a time, in float32 (CRT-010, CRT-011).

transformers (not pagedkv's engine) is the reference, so a certify run of pagedkv's own server
does not grade the engine by itself. Runs are cached per prompt: a prompt sent by many clients
is decoded once.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: Top-2 logit margins (logit units) within which a divergence is a tie, by the dtype the
#: checkpoint is served in: float32 kernels agree to ``1e-4`` per logit (specs/golden.md), so
#: two logits may swap within ten times that; 16-bit ones within two bfloat16 steps (GLD-022).
TIE_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.5, "float16": 0.5}
#: Largest difference (nats) a server's log-probability may have from the reference's, by
#: dtype: a log-softmax moves by at most twice its logits' error (``1e-4`` in float32, a few
#: hundredths in 16 bits, specs/golden.md), with room for a server's own kernels.
LOGPROB_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}

#: What a tokenizer decodes an incomplete UTF-8 sequence to.
INCOMPLETE = "\ufffd"


@dataclass(frozen=True, slots=True)
class ReferenceRun:
    """The reference's greedy continuation of one prompt.

    Attributes:
        prompt: the prompt's token ids.
        token_ids: the generated token ids (exactly the requested count; EOS ignored).
        margins: per generated token, the top-1 minus top-2 logit it was chosen with.
    """

    prompt: tuple[int, ...]
    token_ids: tuple[int, ...]
    margins: tuple[float, ...]


class Reference:
    """A checkpoint directory loaded by transformers: its tokenizer and its float32 model.

    Args:
        model_dir: a Hugging Face Qwen3 checkpoint with its tokenizer files.
    """

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_dir = Path(model_dir)
        self.dtype = _checkpoint_dtype(self.model_dir)
        auto_tokenizer: Any = AutoTokenizer
        auto_model: Any = AutoModelForCausalLM
        self.tokenizer: Any = auto_tokenizer.from_pretrained(
            str(self.model_dir), local_files_only=True
        )
        self.model: Any = auto_model.from_pretrained(
            str(self.model_dir),
            dtype=torch.float32,
            attn_implementation="eager",
            local_files_only=True,
        ).eval()
        self.vocab_size = int(self.model.config.vocab_size)
        # transformers 5.2x renamed the forward's ``past_key_values`` to ``cache``; an unknown
        # name would land in ``**kwargs`` unread and every step would see one token alone.
        parameters = inspect.signature(self.model.forward).parameters
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"
        self._runs: dict[tuple[tuple[int, ...], int], ReferenceRun] = {}

    @property
    def tie_tolerance(self) -> float:
        """The top-2 margin within which a divergence is a tie (logit units)."""
        return TIE_TOLERANCE.get(self.dtype, TIE_TOLERANCE["bfloat16"])

    @property
    def logprob_tolerance(self) -> float:
        """The largest allowed log-probability difference (nats)."""
        return LOGPROB_TOLERANCE.get(self.dtype, LOGPROB_TOLERANCE["bfloat16"])

    def sequence_logprobs(self, token_ids: tuple[int, ...]) -> tuple[float, ...]:
        """The log-probability of each token of ``token_ids`` after the ones before it (the
        first token has none: the result is one shorter), from one forward pass."""
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([list(token_ids)]), use_cache=False).logits
        logprobs = torch.log_softmax(logits[0, :-1].float(), dim=-1)
        chosen = logprobs.gather(1, torch.tensor(token_ids[1:]).unsqueeze(1)).squeeze(1)
        return tuple(float(x) for x in chosen)

    def greedy(self, prompt: tuple[int, ...], max_tokens: int) -> ReferenceRun:
        """The greedy continuation of ``prompt``, ``max_tokens`` tokens long (cached).

        Preconditions: ``prompt`` is non-empty, every id below the vocabulary size;
        ``max_tokens`` >= 1.
        """
        key = (prompt, max_tokens)
        if key not in self._runs:
            self._runs[key] = self._decode(prompt, max_tokens)
        return self._runs[key]

    def decode(self, token_ids: tuple[int, ...] | list[int]) -> str:
        """The text of ``token_ids`` as a server returns it: special tokens skipped, and the
        replacement characters of a UTF-8 sequence the last tokens leave incomplete dropped
        (servers differ there: some hold such bytes back until the character completes, and
        at the end of a completion there is none to complete it)."""
        text = str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))
        return text.rstrip(INCOMPLETE)

    def encode(self, text: str) -> tuple[int, ...]:
        """The token ids of a text prompt, as the completions endpoint tokenizes it (with the
        tokenizer's special tokens, which a Qwen3 tokenizer does not add)."""
        return tuple(int(t) for t in self.tokenizer.encode(text))

    def chat_prompt(self, messages: list[dict[str, str]]) -> tuple[int, ...]:
        """The token ids of ``messages`` rendered by the checkpoint's chat template with the
        generation prompt, as the chat endpoint tokenizes them (the rendered text carries its
        own special tokens: none are added)."""
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return tuple(int(t) for t in self.tokenizer.encode(str(text), add_special_tokens=False))

    def _decode(self, prompt: tuple[int, ...], max_tokens: int) -> ReferenceRun:
        generated: list[int] = []
        margins: list[float] = []
        from transformers import DynamicCache

        ids = torch.tensor([list(prompt)])
        cache: Any = DynamicCache(config=self.model.config)  # filled in place, step by step
        with torch.no_grad():
            for _ in range(max_tokens):
                out = self.model(input_ids=ids, use_cache=True, **{self._cache_argument: cache})
                logits = out.logits[0, -1]
                top = torch.topk(logits, 2)
                token = int(top.indices[0])
                generated.append(token)
                margins.append(float(top.values[0] - top.values[1]))
                ids = torch.tensor([[token]])
        return ReferenceRun(prompt, tuple(generated), tuple(margins))


def _checkpoint_dtype(model_dir: Path) -> str:
    """The dtype ``config.json`` declares (``dtype`` or ``torch_dtype``), float32 if none."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")
