"""Seeded sampling reproducible, whatever else the server runs beside it (CRT-060)."""

from __future__ import annotations

from typing import Any

from pagedkv.certify.checks.greedy_requests import greedy_body
from pagedkv.certify.context import CertifyContext
from pagedkv.certify.prompts import PromptSource
from pagedkv.certify.verdicts import CheckResult, Verdict

#: The seed of the sampled request.
SEED = 1234
#: Sampling temperature: the highest OpenAI's range allows (vLLM refuses more), so that
#: unseeded samples differ (a checkpoint's logits may be peaked enough that temperature 1
#: nearly always picks the top token).
TEMPERATURE = 2.0


class SeededSamplingCheck:
    """A sampled request (:data:`TEMPERATURE`, ``seed``) sent alone, again alone, then once
    among as many other requests as the profile runs at once: the three texts must be equal.
    A server that accepts ``seed`` claims this; one that refuses it (4xx) is skipped."""

    name = "seeded_sampling_reproducible"
    spec_ids: tuple[str, ...] = ("CRT-060",)
    capability = "seed with temperature > 0"

    def run(self, context: CertifyContext) -> CheckResult:
        source = PromptSource(
            context.reference.vocab_size, list(context.reference.tokenizer.all_special_ids), 70
        )
        prompt = source.tokens(10)
        body = {
            **greedy_body(context.model, prompt, context.profile.new_tokens),
            "temperature": TEMPERATURE,
            "seed": SEED,
        }
        neighbours = [
            {**body, "prompt": list(source.tokens(10)), "seed": SEED + 1 + i}
            for i in range(context.profile.concurrency - 1)
        ]
        texts: list[str] = []
        for batch in ([body], [body], [body, *neighbours]):
            answers = context.in_parallel(
                lambda b: context.client.post("/completions", b), list(batch)
            )
            answer = answers[0]
            if 400 <= answer.status < 500:
                return self._result(Verdict.SKIP, f"refused with {answer.status}", None)
            if answer.status != 200:
                return self._result(Verdict.FAIL, f"answered {answer.status}", body)
            texts.append(str(answer.body["choices"][0]["text"]))
        if len(set(texts)) != 1:
            detail = f"alone {texts[0]!r}, again {texts[1]!r}, among others {texts[2]!r}"
            return self._result(Verdict.FAIL, detail, body)
        return self._result(Verdict.PASS, "the same text alone, again and among others", None)

    def _result(self, verdict: Verdict, detail: str, body: dict[str, Any] | None) -> CheckResult:
        return CheckResult(self.name, self.spec_ids, self.capability, verdict, detail, None, body)
