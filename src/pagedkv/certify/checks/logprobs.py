"""Log-probabilities within the dtype's tolerance of the reference (CRT-050, CRT-051)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedkv.certify.checks.greedy_requests import greedy_body
from pagedkv.certify.context import CertifyContext
from pagedkv.certify.prompts import PromptSource
from pagedkv.certify.verdicts import CheckResult, Verdict


def largest_gap(got: Sequence[Any], expected: Sequence[float]) -> tuple[int, float] | None:
    """``(index, |difference|)`` of the largest difference between ``got`` and ``expected``;
    ``None`` when ``got`` is not a list of numbers as long as ``expected``."""
    if len(got) != len(expected) or not all(isinstance(x, int | float) for x in got):
        return None
    gaps = [abs(float(g) - e) for g, e in zip(got, expected, strict=True)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    return worst, gaps[worst]


class LogprobsCheck:
    """A greedy request with ``logprobs: 1`` (and, with :attr:`echo`, ``echo: true``, which
    returns the prompt's log-probabilities first): every ``token_logprobs`` entry within the
    dtype's tolerance of the reference's log-probability of that token."""

    name = "output_logprobs"
    spec_ids: tuple[str, ...] = ("CRT-050", "SRV-005")
    capability = "logprobs on /completions"
    echo = False

    def run(self, context: CertifyContext) -> CheckResult:
        source = PromptSource(
            context.reference.vocab_size, list(context.reference.tokenizer.all_special_ids), 60
        )
        prompt = source.tokens(10)
        run = context.reference.greedy(prompt, context.profile.new_tokens)
        every = context.reference.sequence_logprobs(prompt + run.token_ids)
        expected = every if self.echo else every[len(prompt) - 1 :]
        body = {**greedy_body(context.model, prompt, len(run.token_ids)), "logprobs": 1}
        if self.echo:
            body["echo"] = True
        answer = context.client.post("/completions", body)
        if 400 <= answer.status < 500:
            return self._result(Verdict.SKIP, f"refused with {answer.status}", None)
        try:
            got = list(answer.body["choices"][0]["logprobs"]["token_logprobs"])
        except (TypeError, KeyError, IndexError):
            return self._result(Verdict.FAIL, f"no token_logprobs: {answer.text[:200]}", body)
        if self.echo and got and got[0] is None:
            got = got[1:]  # the first prompt token has no log-probability
        gap = largest_gap(got, expected)
        if gap is None:
            detail = f"{len(got)} token_logprobs, expected {len(expected)} numbers"
            return self._result(Verdict.FAIL, detail, body)
        index, size = gap
        tolerance = context.reference.logprob_tolerance
        where = f"largest difference {size:.3g} at token {index} (tolerance {tolerance:g})"
        if size > tolerance:
            return self._result(Verdict.FAIL, where, body)
        return self._result(Verdict.PASS, where, None)

    def _result(self, verdict: Verdict, detail: str, body: dict[str, Any] | None) -> CheckResult:
        return CheckResult(self.name, self.spec_ids, self.capability, verdict, detail, None, body)


class PromptLogprobsCheck(LogprobsCheck):
    """:class:`LogprobsCheck` with ``echo: true``: the prompt's log-probabilities too."""

    name = "prompt_logprobs"
    spec_ids: tuple[str, ...] = ("CRT-051", "SRV-101")
    capability = "echo with logprobs on /completions"
    echo = True
