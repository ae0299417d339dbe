"""Bad input is 4xx, never 5xx, and the server answers afterwards (CRT-022)."""

from __future__ import annotations

from typing import Any

from pagedkv.certify.checks.greedy_requests import greedy_body
from pagedkv.certify.context import CertifyContext
from pagedkv.certify.verdicts import CheckResult, Verdict


class BadInputCheck:
    """A negative ``max_tokens``, a token id past the vocabulary and a malformed body: each
    must be answered 4xx; then a valid request must be answered 200."""

    name = "bad_input_is_4xx"
    spec_ids: tuple[str, ...] = ("CRT-022",)
    capability = "/completions"

    def run(self, context: CertifyContext) -> CheckResult:
        valid = greedy_body(context.model, (1, 2, 3), 2)
        bad: list[tuple[str, dict[str, Any]]] = [
            ("negative max_tokens", {**valid, "max_tokens": -1}),
            ("token id past the vocabulary", {**valid, "prompt": [context.reference.vocab_size]}),
        ]
        for what, body in bad:
            answer = context.client.post("/completions", body)
            if not 400 <= answer.status < 500:
                return self._result(Verdict.FAIL, f"{what}: answered {answer.status}", body)
        malformed = b'{"prompt": [1, 2'
        answer = context.client.post_raw("/completions", malformed)
        if not 400 <= answer.status < 500:
            detail = f"malformed body: answered {answer.status}"
            return self._result(Verdict.FAIL, detail, {"raw": malformed.decode()})
        after = context.client.post("/completions", valid)
        if after.status != 200:
            return self._result(Verdict.FAIL, f"valid request after: {after.status}", valid)
        return self._result(Verdict.PASS, f"{len(bad) + 1} bad requests answered 4xx", None)

    def _result(self, verdict: Verdict, detail: str, body: dict[str, Any] | None) -> CheckResult:
        return CheckResult(self.name, self.spec_ids, self.capability, verdict, detail, None, body)
