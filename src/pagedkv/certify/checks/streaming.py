"""Streamed text adds up to the non-streamed text (CRT-021)."""

from __future__ import annotations

from typing import Any

from pagedkv.certify.checks.greedy_requests import greedy_body
from pagedkv.certify.context import CertifyContext
from pagedkv.certify.prompts import PromptSource
from pagedkv.certify.verdicts import CheckResult, Verdict


class StreamAddsUpCheck:
    """The same greedy request sent streamed and not: the streamed ``choices[0].text`` deltas
    must concatenate to the non-streamed text."""

    name = "stream_adds_up"
    spec_ids: tuple[str, ...] = ("CRT-021",)
    capability = "stream: true on /completions"

    def run(self, context: CertifyContext) -> CheckResult:
        source = PromptSource(
            context.reference.vocab_size, list(context.reference.tokenizer.all_special_ids), 24
        )
        body = greedy_body(context.model, source.tokens(9), context.profile.new_tokens)
        whole = context.client.post("/completions", body)
        streamed_body = {**body, "stream": True}
        status, events = context.client.stream("/completions", streamed_body)
        if 400 <= status < 500:
            return self._result(Verdict.SKIP, f"stream refused with {status}", streamed_body)
        if whole.status != 200 or status != 200:
            detail = f"answered {whole.status} (whole), {status} (streamed)"
            return self._result(Verdict.FAIL, detail, streamed_body)
        text = str(whole.body["choices"][0]["text"])
        streamed = "".join(_delta(event) for event in events)
        if streamed != text:
            detail = f"streamed {streamed!r} but whole {text!r}"
            return self._result(Verdict.FAIL, detail, streamed_body)
        return self._result(Verdict.PASS, f"{len(events)} events add up to the text", None)

    def _result(self, verdict: Verdict, detail: str, body: dict[str, Any] | None) -> CheckResult:
        return CheckResult(self.name, self.spec_ids, self.capability, verdict, detail, None, body)


def _delta(event: Any) -> str:
    """The text of the first choice of one completions chunk ('' for a usage-only chunk)."""
    choices = event.get("choices") if isinstance(event, dict) else None
    if not choices:
        return ""
    return str(choices[0].get("text") or "")
