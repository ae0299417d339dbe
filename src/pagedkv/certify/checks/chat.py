"""The chat endpoint: the checkpoint's chat template, greedy content token-exact, streamed and
not, ``max_completion_tokens`` over ``max_tokens``, and log-probabilities (SRV-002, SRV-003,
SRV-005, SRV-101).

The reference renders the messages with the checkpoint's own chat template (transformers'
``apply_chat_template``, generation prompt added) and decodes greedily from those tokens.
"""

from __future__ import annotations

from typing import Any

from pagedkv.certify.checks.greedy_requests import judge
from pagedkv.certify.checks.logprobs import largest_gap
from pagedkv.certify.client import Answer
from pagedkv.certify.context import CertifyContext
from pagedkv.certify.reference import ReferenceRun
from pagedkv.certify.verdicts import CheckResult, Verdict, result_of

#: The conversation both chat checks send.
MESSAGES = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What does a page table map?"},
]


def chat_body(context: CertifyContext, max_tokens: int) -> dict[str, Any]:
    """A greedy chat request of exactly ``max_tokens`` tokens (EOS ignored)."""
    return {
        "model": context.model,
        "messages": MESSAGES,
        "max_completion_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def chat_reference(context: CertifyContext, max_tokens: int) -> ReferenceRun:
    """The reference's greedy continuation of :data:`MESSAGES` rendered by the template."""
    return context.reference.greedy(context.reference.chat_prompt(MESSAGES), max_tokens)


def _content(answer: Answer) -> str | None:
    try:
        return str(answer.body["choices"][0]["message"]["content"])
    except (TypeError, KeyError, IndexError):
        return None


class ChatCheck:
    """A greedy chat request: the content equals the reference's text from the rendered
    template, ``usage.prompt_tokens`` counts the rendered tokens; with ``max_tokens`` larger
    than ``max_completion_tokens`` the latter holds; streamed, the ``delta.content`` pieces add
    up to the content and the stream ends with ``[DONE]``."""

    name = "chat_greedy"
    spec_ids: tuple[str, ...] = ("SRV-002", "SRV-003")
    capability = "/chat/completions with the checkpoint's chat template"

    def run(self, context: CertifyContext) -> CheckResult:
        new = context.profile.new_tokens
        body = {**chat_body(context, new), "max_tokens": 2 * new}
        run = chat_reference(context, new)
        answer = context.client.post("/chat/completions", body)
        if 400 <= answer.status < 500:
            return result_of(self, Verdict.SKIP, f"refused with {answer.status}")
        content = _content(answer)
        if answer.status != 200 or content is None:
            return result_of(self, Verdict.FAIL, f"{answer.status}: {answer.text[:200]}", body)
        verdict, detail, divergence = judge(context.reference, run, content)
        if verdict is not Verdict.PASS:
            return result_of(self, verdict, detail, body, divergence)
        usage = answer.body.get("usage") or {}
        counts = (usage.get("prompt_tokens"), usage.get("completion_tokens"))
        if counts != (len(run.prompt), new):
            detail = f"usage {counts}, expected {(len(run.prompt), new)}"
            return result_of(self, Verdict.FAIL, detail, body)
        stream = context.client.stream("/chat/completions", {**body, "stream": True})
        pieces = [
            str(((e.get("choices") or [{}])[0].get("delta") or {}).get("content") or "")
            for e in stream.events
            if isinstance(e, dict)
        ]
        if stream.status != 200 or "".join(pieces) != content or not stream.done:
            detail = f"streamed {''.join(pieces)!r} ({stream.status}, [DONE] {stream.done})"
            return result_of(self, Verdict.FAIL, detail, {**body, "stream": True})
        return result_of(self, Verdict.PASS, "token-exact, streamed and not")


class ChatLogprobsCheck:
    """``logprobs: true`` with ``top_logprobs: 2`` on a greedy chat request: each content
    token's ``logprob`` within the dtype's tolerance of the reference, two alternatives each;
    ``top_logprobs`` without ``logprobs`` is answered 400."""

    name = "chat_logprobs"
    spec_ids: tuple[str, ...] = ("SRV-005", "SRV-101")
    capability = "logprobs on /chat/completions"

    def run(self, context: CertifyContext) -> CheckResult:
        new = context.profile.new_tokens
        run = chat_reference(context, new)
        every = context.reference.sequence_logprobs(run.prompt + run.token_ids)
        expected = every[len(run.prompt) - 1 :]
        body = {**chat_body(context, new), "logprobs": True, "top_logprobs": 2}
        answer = context.client.post("/chat/completions", body)
        if 400 <= answer.status < 500:
            return result_of(self, Verdict.SKIP, f"refused with {answer.status}")
        try:
            entries = list(answer.body["choices"][0]["logprobs"]["content"])
        except (TypeError, KeyError, IndexError):
            return result_of(self, Verdict.FAIL, f"no logprobs.content: {answer.text[:200]}", body)
        gap = largest_gap([e.get("logprob") for e in entries], expected)
        if gap is None:
            detail = f"{len(entries)} entries, expected {len(expected)}"
            return result_of(self, Verdict.FAIL, detail, body)
        index, size = gap
        tolerance = context.reference.logprob_tolerance
        where = f"largest difference {size:.3g} at token {index} (tolerance {tolerance:g})"
        if size > tolerance:
            return result_of(self, Verdict.FAIL, where, body)
        if any(len(e.get("top_logprobs") or []) != 2 for e in entries):
            return result_of(self, Verdict.FAIL, "not two top_logprobs per token", body)
        alone = {**chat_body(context, new), "top_logprobs": 2}
        refused = context.client.post("/chat/completions", alone)
        if refused.status != 400:
            detail = f"top_logprobs without logprobs answered {refused.status}"
            return result_of(self, Verdict.FAIL, detail, alone)
        return result_of(self, Verdict.PASS, where)
