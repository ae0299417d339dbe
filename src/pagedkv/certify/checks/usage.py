"""``usage`` counts exact (CRT-020)."""

from __future__ import annotations

from pagedkv.certify.checks.greedy_requests import greedy_body
from pagedkv.certify.context import CertifyContext
from pagedkv.certify.prompts import PromptSource
from pagedkv.certify.verdicts import CheckResult, Verdict


class UsageCheck:
    """A greedy request of a known prompt length run to ``max_tokens``: ``prompt_tokens``,
    ``completion_tokens`` and ``total_tokens`` must be exactly those counts."""

    name = "usage_counts"
    spec_ids: tuple[str, ...] = ("CRT-020", "SRV-004")
    capability = "usage in completions responses"

    def run(self, context: CertifyContext) -> CheckResult:
        source = PromptSource(
            context.reference.vocab_size, list(context.reference.tokenizer.all_special_ids), 23
        )
        prompt = source.tokens(11)
        body = greedy_body(context.model, prompt, context.profile.new_tokens)
        answer = context.client.post("/completions", body)
        if 400 <= answer.status < 500:
            return self._result(Verdict.SKIP, f"refused with {answer.status}", body)
        usage = answer.body.get("usage") if isinstance(answer.body, dict) else None
        if answer.status != 200 or not isinstance(usage, dict):
            return self._result(Verdict.FAIL, f"{answer.status}: {answer.text[:200]}", body)
        expected = {
            "prompt_tokens": len(prompt),
            "completion_tokens": context.profile.new_tokens,
            "total_tokens": len(prompt) + context.profile.new_tokens,
        }
        wrong = {k: usage.get(k) for k, v in expected.items() if usage.get(k) != v}
        if wrong:
            return self._result(Verdict.FAIL, f"expected {expected}, got {wrong}", body)
        return self._result(Verdict.PASS, f"exact: {expected}", None)

    def _result(self, verdict: Verdict, detail: str, body: dict[str, object] | None) -> CheckResult:
        return CheckResult(self.name, self.spec_ids, self.capability, verdict, detail, None, body)
