"""Errors a client can act on: OpenAI's error body, 400 for a malformed or out-of-range
request naming the field, ``context_length_exceeded`` for a request that can never fit, and
text that is not Unicode refused (SRV-010, SRV-011, SRV-014, SRV-015, SRV-054, SRV-055).

Each check sends requests a correct server must refuse with 400, and holds the answer to
what a client reading it needs: the status, the JSON error body, and the field it names.
"""

from __future__ import annotations

import json
from typing import Any

from pagedkv.certify.checks.greedy_requests import greedy_body
from pagedkv.certify.client import Answer
from pagedkv.certify.context import CertifyContext
from pagedkv.certify.verdicts import CheckResult, Verdict, result_of

#: The keys of OpenAI's error object (``{"error": {...}}``).
ERROR_KEYS = ("message", "type", "param", "code")
#: OpenAI's code for a prompt plus ``max_tokens`` past the model's context.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
#: ``max_tokens`` no served context reaches.
NEVER_FITS = 10**9


def error_of(answer: Answer) -> dict[str, Any] | None:
    """The error object of a JSON error body, or ``None`` when the body is not one."""
    body = answer.body
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return dict(body["error"])
    return None


def body_problem(answer: Answer, status: int = 400) -> str | None:
    """What is wrong with ``answer`` as an error of ``status`` in OpenAI's shape, or ``None``."""
    if answer.status != status:
        return f"answered {answer.status}, not {status}: {answer.text[:160]}"
    error = error_of(answer)
    if error is None:
        return f"no {{'error': {{...}}}} body: {answer.text[:160]}"
    missing = [key for key in ERROR_KEYS if key not in error]
    if missing:
        return f"error body lacks {missing}: {answer.text[:160]}"
    return None


class ErrorBodyCheck:
    """A body that is not JSON, and one whose ``max_tokens`` is a string: each answered 400
    with ``{"error": {"message", "type", "param", "code"}}``."""

    name = "error_body"
    spec_ids: tuple[str, ...] = ("SRV-010", "SRV-011")
    capability = "/completions"

    def run(self, context: CertifyContext) -> CheckResult:
        malformed = b'{"prompt": [1, 2'
        problem = body_problem(context.client.post_raw("/completions", malformed))
        if problem is not None:
            return result_of(self, Verdict.FAIL, f"malformed JSON: {problem}", {"raw": "{"})
        body = {**greedy_body(context.model, (1, 2, 3), 2), "max_tokens": "many"}
        problem = body_problem(context.client.post("/completions", body))
        if problem is not None:
            return result_of(self, Verdict.FAIL, f"schema broken: {problem}", body)
        return result_of(self, Verdict.PASS, "both answered 400 with OpenAI's error body")


class ParamErrorsCheck:
    """Out-of-range values (``temperature: -1``, ``top_p: 1.5``, ``n: 0``, a ``seed`` of
    2^64): each answered 400 with the field as the error's ``param``."""

    name = "param_errors"
    spec_ids: tuple[str, ...] = ("SRV-006", "SRV-010", "SRV-014", "SRV-054")
    capability = "/completions"

    def run(self, context: CertifyContext) -> CheckResult:
        valid = greedy_body(context.model, (1, 2, 3), 2)
        cases = {"temperature": -1, "top_p": 1.5, "n": 0, "seed": 2**64}
        for field, value in cases.items():
            body = {**valid, field: value}
            answer = context.client.post("/completions", body)
            problem = body_problem(answer)
            if problem is None and (error_of(answer) or {}).get("param") != field:
                problem = f"param {(error_of(answer) or {}).get('param')!r}, not {field!r}"
            if problem is not None:
                return result_of(self, Verdict.FAIL, f"{field}={value}: {problem}", body)
        return result_of(self, Verdict.PASS, f"{len(cases)} values refused, each naming its field")


class ContextLengthCheck:
    """A prompt with a ``max_tokens`` no context reaches: answered 400 with OpenAI's code
    ``context_length_exceeded``."""

    name = "context_length_exceeded"
    spec_ids: tuple[str, ...] = ("SRV-015",)
    capability = "/completions"

    def run(self, context: CertifyContext) -> CheckResult:
        body = greedy_body(context.model, (1, 2, 3), NEVER_FITS)
        answer = context.client.post("/completions", body)
        problem = body_problem(answer)
        code = (error_of(answer) or {}).get("code")
        if problem is None and code != CONTEXT_LENGTH_EXCEEDED:
            problem = f"code {code!r}, not {CONTEXT_LENGTH_EXCEEDED!r}"
        if problem is not None:
            return result_of(self, Verdict.FAIL, problem, body)
        return result_of(self, Verdict.PASS, f"400 with code {CONTEXT_LENGTH_EXCEEDED}")


class InvalidUnicodeCheck:
    """A lone surrogate (valid JSON, not valid Unicode) in the prompt and in a stop string:
    each answered 400 naming that field (the dotted path starts with it), never 5xx."""

    name = "invalid_unicode"
    spec_ids: tuple[str, ...] = ("SRV-010", "SRV-055")
    capability = "/completions"

    def run(self, context: CertifyContext) -> CheckResult:
        valid = greedy_body(context.model, (1, 2, 3), 2)
        cases = {"prompt": "a\ud800b", "stop": ["x\udc00"]}
        for field, value in cases.items():
            body = {**valid, field: value}
            raw = json.dumps(body).encode()  # escapes the surrogate: valid JSON
            answer = context.client.post_raw("/completions", raw)
            problem = body_problem(answer)
            param = str((error_of(answer) or {}).get("param"))
            if problem is None and not param.startswith(field):
                problem = f"param {param!r} does not name {field!r}"
            if problem is not None:
                return result_of(self, Verdict.FAIL, f"{field}: {problem}", {"raw": raw.decode()})
        return result_of(self, Verdict.PASS, "lone surrogates refused, each naming its field")
