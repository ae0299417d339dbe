"""Fields a completion request may give, each held to what the reference implies: stop
strings, stop token ids, ``min_tokens``, ``n`` and ``echo`` (CRT-023..CRT-027).

Each check sends one greedy request with the field and compares the answer with the
reference's greedy run of the same prompt, so what the field must change is known exactly.
"""

from __future__ import annotations

from typing import Any

from pagedkv.certify.checks.greedy_requests import greedy_body
from pagedkv.certify.client import Answer
from pagedkv.certify.context import CertifyContext
from pagedkv.certify.prompts import PromptSource
from pagedkv.certify.reference import ReferenceRun
from pagedkv.certify.verdicts import CheckResult, Verdict


class FieldCheck:
    """A check of one request field: subclasses give the request and judge the answer."""

    name = "field"
    spec_ids: tuple[str, ...] = ()
    capability = "a request field"
    #: Seed of the check's prompt.
    seed = 40

    def run(self, context: CertifyContext) -> CheckResult:
        source = PromptSource(
            context.reference.vocab_size,
            list(context.reference.tokenizer.all_special_ids),
            self.seed,
        )
        prompt = source.tokens(10)
        run = context.reference.greedy(prompt, context.profile.new_tokens)
        body = self.request(context, run)
        answer = context.client.post("/completions", body)
        if 400 <= answer.status < 500:
            detail = f"refused with {answer.status}: {answer.text[:200]}"
            return self._result(Verdict.SKIP, detail, None)
        if answer.status != 200 or not isinstance(answer.body, dict):
            return self._result(Verdict.FAIL, f"answered {answer.status}", body)
        problem = self.problem(context, run, answer)
        if problem is not None:
            return self._result(Verdict.FAIL, problem, body)
        return self._result(Verdict.PASS, "as the reference implies", None)

    def request(self, context: CertifyContext, run: ReferenceRun) -> dict[str, Any]:
        """The request body, built from the reference's greedy run of the prompt."""
        return greedy_body(context.model, run.prompt, len(run.token_ids))

    def problem(self, context: CertifyContext, run: ReferenceRun, answer: Answer) -> str | None:
        """What is wrong with a 200 answer, or ``None``."""
        raise NotImplementedError

    def _result(self, verdict: Verdict, detail: str, body: dict[str, Any] | None) -> CheckResult:
        return CheckResult(self.name, self.spec_ids, self.capability, verdict, detail, None, body)


def _choice(answer: Answer, index: int = 0) -> dict[str, Any]:
    choices = answer.body.get("choices") or []
    return dict(choices[index]) if len(choices) > index else {}


class StopStringCheck(FieldCheck):
    """``stop``: two characters of the reference's text, from its second token on; the text
    must end right before their first occurrence, finish reason ``stop``."""

    name = "stop_string"
    spec_ids: tuple[str, ...] = ("CRT-023",)
    capability = "stop strings"
    seed = 41

    def _stop(self, context: CertifyContext, run: ReferenceRun) -> tuple[str, str]:
        text = context.reference.decode(run.token_ids)
        start = min(len(context.reference.decode(run.token_ids[:2])), max(len(text) - 2, 0))
        stop = text[start : start + 2]
        return stop, text[: text.find(stop)]

    def request(self, context: CertifyContext, run: ReferenceRun) -> dict[str, Any]:
        return {**super().request(context, run), "stop": [self._stop(context, run)[0]]}

    def problem(self, context: CertifyContext, run: ReferenceRun, answer: Answer) -> str | None:
        stop, expected = self._stop(context, run)
        choice = _choice(answer)
        if choice.get("text") != expected or choice.get("finish_reason") != "stop":
            return (
                f"stop {stop!r}: expected {expected!r} (finish stop), got "
                f"{choice.get('text')!r} (finish {choice.get('finish_reason')})"
            )
        return None


class StopTokenCheck(FieldCheck):
    """``stop_token_ids``: the reference's fourth token; generation must end there (finish
    reason ``stop``) with the text before it (the stop token's own text may follow)."""

    name = "stop_token_ids"
    spec_ids: tuple[str, ...] = ("CRT-024",)
    capability = "stop_token_ids"
    seed = 42

    def request(self, context: CertifyContext, run: ReferenceRun) -> dict[str, Any]:
        return {**super().request(context, run), "stop_token_ids": [run.token_ids[3]]}

    def problem(self, context: CertifyContext, run: ReferenceRun, answer: Answer) -> str | None:
        at = run.token_ids.index(run.token_ids[3])
        decode = context.reference.decode
        allowed = {decode(run.token_ids[:at]), decode(run.token_ids[: at + 1])}
        choice = _choice(answer)
        if choice.get("text") not in allowed or choice.get("finish_reason") != "stop":
            return (
                f"stop token {run.token_ids[3]} (token {at}): expected one of "
                f"{sorted(allowed)!r} (finish stop), got {choice.get('text')!r} "
                f"(finish {choice.get('finish_reason')})"
            )
        return None


class MinTokensCheck(FieldCheck):
    """``min_tokens``: the reference's first token as a stop token, with ``min_tokens`` half
    of ``max_tokens``: the stop token cannot end generation before that many tokens."""

    name = "min_tokens"
    spec_ids: tuple[str, ...] = ("CRT-025",)
    capability = "min_tokens with stop_token_ids"
    seed = 43

    def request(self, context: CertifyContext, run: ReferenceRun) -> dict[str, Any]:
        return {
            **super().request(context, run),
            "stop_token_ids": [run.token_ids[0]],
            "min_tokens": len(run.token_ids) // 2,
        }

    def problem(self, context: CertifyContext, run: ReferenceRun, answer: Answer) -> str | None:
        usage = answer.body.get("usage") or {}
        generated = usage.get("completion_tokens")
        if not isinstance(generated, int) or generated < len(run.token_ids) // 2:
            return f"min_tokens {len(run.token_ids) // 2} but {generated} tokens generated"
        return None


class ParallelChoicesCheck(FieldCheck):
    """``n: 2`` of a greedy request: two choices, indices 0 and 1, each the reference's text."""

    name = "n_choices"
    spec_ids: tuple[str, ...] = ("CRT-026",)
    capability = "n > 1 with temperature 0"
    seed = 44

    def request(self, context: CertifyContext, run: ReferenceRun) -> dict[str, Any]:
        return {**super().request(context, run), "n": 2}

    def problem(self, context: CertifyContext, run: ReferenceRun, answer: Answer) -> str | None:
        expected = context.reference.decode(run.token_ids)
        choices = answer.body.get("choices") or []
        got = sorted((c.get("index"), c.get("text")) for c in choices)
        if got != [(0, expected), (1, expected)]:
            return f"expected two choices of {expected!r}, got {got!r}"
        return None


class EchoCheck(FieldCheck):
    """``echo: true``: the text is the prompt's text, then the reference's continuation (the
    prompt decoded alone, or with the continuation: the two differ only where the prompt ends
    inside a UTF-8 character)."""

    name = "echo"
    spec_ids: tuple[str, ...] = ("CRT-027",)
    capability = "echo"
    seed = 45

    def request(self, context: CertifyContext, run: ReferenceRun) -> dict[str, Any]:
        return {**super().request(context, run), "echo": True}

    def problem(self, context: CertifyContext, run: ReferenceRun, answer: Answer) -> str | None:
        tokenizer = context.reference.tokenizer
        alone = str(tokenizer.decode(list(run.prompt), skip_special_tokens=True))
        expected = {
            alone + context.reference.decode(run.token_ids),
            context.reference.decode(run.prompt + run.token_ids),
        }
        text = _choice(answer).get("text")
        if text not in expected:
            return f"expected one of {sorted(expected)!r}, got {text!r}"
        return None
