"""vLLM's ``/tokenize`` and ``/detokenize`` agree with the checkpoint's tokenizer (SRV-051)."""

from __future__ import annotations

from pagedkv.certify.context import CertifyContext
from pagedkv.certify.verdicts import CheckResult, Verdict, result_of

#: A text with words, code and a character of several bytes.
TEXT = "Paged attention, décodé: x = f(y)"


class TokenizeCheck:
    """``POST /tokenize {"prompt"}`` answers the reference tokenizer's ids and their
    ``count``; ``POST /detokenize`` of them answers the text; an id of 2^31 is 400. Skipped
    where ``/tokenize`` is not served (404)."""

    name = "tokenize"
    spec_ids: tuple[str, ...] = ("SRV-051",)
    capability = "/tokenize and /detokenize (vLLM)"

    def run(self, context: CertifyContext) -> CheckResult:
        body = {"model": context.model, "prompt": TEXT}
        answer = context.client.post_root("/tokenize", body)
        if answer.status in (404, 405):
            return result_of(self, Verdict.SKIP, f"/tokenize answered {answer.status}")
        expected = list(context.reference.encode(TEXT))
        got = answer.body if isinstance(answer.body, dict) else {}
        if answer.status != 200 or got.get("tokens") != expected:
            detail = f"tokens {got.get('tokens')!r}, reference {expected!r} ({answer.status})"
            return result_of(self, Verdict.FAIL, detail, body)
        if got.get("count") != len(expected):
            return result_of(self, Verdict.FAIL, f"count {got.get('count')!r}", body)
        back = {"model": context.model, "tokens": expected}
        answer = context.client.post_root("/detokenize", back)
        text = answer.body.get("prompt") if isinstance(answer.body, dict) else None
        if answer.status != 200 or text != context.reference.decode(expected):
            return result_of(self, Verdict.FAIL, f"detokenized {text!r} ({answer.status})", back)
        bad = {"model": context.model, "tokens": [2**31]}
        answer = context.client.post_root("/detokenize", bad)
        if answer.status != 400:
            return result_of(self, Verdict.FAIL, f"id 2^31 answered {answer.status}", bad)
        return result_of(self, Verdict.PASS, f"{len(expected)} ids both ways, 2^31 refused")
