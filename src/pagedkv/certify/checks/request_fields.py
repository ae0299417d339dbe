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
    #: Whether a 4xx answer means the server lacks the field (skip) rather than a failure.
    refusal_is_skip = True

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
            if self.refusal_is_skip:
                return self._result(Verdict.SKIP, detail, None)
            return self._result(Verdict.FAIL, detail, body)
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
    spec_ids: tuple[str, ...] = ("CRT-023", "SRV-001")
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
    spec_ids: tuple[str, ...] = ("CRT-024", "SRV-101")
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
    spec_ids: tuple[str, ...] = ("CRT-025", "SRV-101")
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
    """``n: 2`` of a greedy request of two prompts: four choices, ``index`` = prompt index
    times ``n`` plus completion index, each the reference's text of its prompt."""

    name = "n_choices"
    spec_ids: tuple[str, ...] = ("CRT-026", "SRV-006")
    capability = "n > 1 with temperature 0"
    seed = 44

    def _second(self, context: CertifyContext, run: ReferenceRun) -> ReferenceRun:
        source = PromptSource(
            context.reference.vocab_size, list(context.reference.tokenizer.all_special_ids), 46
        )
        return context.reference.greedy(source.tokens(6), len(run.token_ids))

    def request(self, context: CertifyContext, run: ReferenceRun) -> dict[str, Any]:
        prompts = [list(run.prompt), list(self._second(context, run).prompt)]
        return {**super().request(context, run), "prompt": prompts, "n": 2}

    def problem(self, context: CertifyContext, run: ReferenceRun, answer: Answer) -> str | None:
        texts = [context.reference.decode(r.token_ids) for r in (run, self._second(context, run))]
        expected = [(i, texts[i // 2]) for i in range(4)]
        choices = answer.body.get("choices") or []
        got = sorted((c.get("index"), c.get("text")) for c in choices)
        if got != expected:
            return f"expected {expected!r}, got {got!r}"
        return None


class EchoCheck(FieldCheck):
    """``echo: true``: the text is the prompt's text, then the reference's continuation (the
    prompt decoded alone, or with the continuation: the two differ only where the prompt ends
    inside a UTF-8 character)."""

    name = "echo"
    spec_ids: tuple[str, ...] = ("CRT-027", "SRV-101")
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


class LogitBiasCheck(FieldCheck):
    """``logit_bias`` of +100 on one ordinary token the reference does not pick first: every
    generated token must be that one (the bias is added to its logit, past every other)."""

    name = "logit_bias"
    spec_ids: tuple[str, ...] = ("SRV-101",)
    capability = "logit_bias"
    seed = 47

    def _favoured(self, context: CertifyContext, run: ReferenceRun) -> int:
        source = PromptSource(
            context.reference.vocab_size, list(context.reference.tokenizer.all_special_ids), 48
        )
        return next(t for t in source.tokens(8) if t != run.token_ids[0])

    def request(self, context: CertifyContext, run: ReferenceRun) -> dict[str, Any]:
        bias = {str(self._favoured(context, run)): 100}
        return {**super().request(context, run), "logit_bias": bias}

    def problem(self, context: CertifyContext, run: ReferenceRun, answer: Answer) -> str | None:
        favoured = self._favoured(context, run)
        expected = context.reference.decode([favoured] * len(run.token_ids))
        text = _choice(answer).get("text")
        if text != expected:
            return f"token {favoured} biased by +100: expected {expected!r}, got {text!r}"
        return None


class UnknownFieldCheck(FieldCheck):
    """Fields no API declares, one at the top of the body and one holding an object: the
    request is answered as without them (the reference's text), not refused."""

    name = "unknown_field_ignored"
    spec_ids: tuple[str, ...] = ("SRV-053",)
    capability = "/completions"
    seed = 49
    refusal_is_skip = False  # refusing the fields is the failure here

    def request(self, context: CertifyContext, run: ReferenceRun) -> dict[str, Any]:
        extra = {"x_certify_unknown": 1, "x_certify_nested": {"x_deeper": [1, 2]}}
        return {**super().request(context, run), **extra}

    def problem(self, context: CertifyContext, run: ReferenceRun, answer: Answer) -> str | None:
        expected = context.reference.decode(run.token_ids)
        text = _choice(answer).get("text")
        return None if text == expected else f"expected {expected!r}, got {text!r}"
