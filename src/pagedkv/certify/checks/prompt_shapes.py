"""Every shape of completions prompt answered in order with the reference's text (SRV-001)."""

from __future__ import annotations

from typing import Any

from pagedkv.certify.checks.greedy_requests import greedy_body, judge
from pagedkv.certify.context import CertifyContext
from pagedkv.certify.prompts import PromptSource
from pagedkv.certify.verdicts import CheckResult, Verdict, result_of

#: Text prompts: ordinary prose and code, so their tokens are ordinary ones.
TEXTS = ("The quick brown fox jumps over", "def fibonacci(n):")


class PromptShapesCheck:
    """``prompt`` as a text, a list of texts, a list of token ids and a list of such lists,
    greedy: one choice per prompt, ``index`` in prompt order, each the reference's text of
    that prompt (a text tokenized as the reference's tokenizer does)."""

    name = "prompt_shapes"
    spec_ids: tuple[str, ...] = ("SRV-001",)
    capability = "/completions"

    def run(self, context: CertifyContext) -> CheckResult:
        reference = context.reference
        source = PromptSource(reference.vocab_size, list(reference.tokenizer.all_special_ids), 80)
        ids = [source.tokens(7), source.tokens(5)]
        shapes: list[tuple[Any, list[tuple[int, ...]]]] = [
            (TEXTS[0], [reference.encode(TEXTS[0])]),
            (list(TEXTS), [reference.encode(t) for t in TEXTS]),
            (list(ids[0]), [ids[0]]),
            ([list(p) for p in ids], ids),
        ]
        new = context.profile.new_tokens
        for prompt, tokens in shapes:
            body = {**greedy_body(context.model, (), new), "prompt": prompt}
            answer = context.client.post("/completions", body)
            if answer.status != 200 or not isinstance(answer.body, dict):
                return result_of(self, Verdict.FAIL, f"answered {answer.status}", body)
            choices = sorted(answer.body.get("choices") or [], key=lambda c: c.get("index", -1))
            if [c.get("index") for c in choices] != list(range(len(tokens))):
                detail = f"indices {[c.get('index') for c in choices]} for {len(tokens)} prompts"
                return result_of(self, Verdict.FAIL, detail, body)
            for choice, prompt_ids in zip(choices, tokens, strict=True):
                run = reference.greedy(prompt_ids, new)
                verdict, detail, divergence = judge(reference, run, str(choice.get("text")))
                if verdict is not Verdict.PASS:
                    where = f"choice {choice.get('index')}: {detail}"
                    return result_of(self, verdict, where, body, divergence)
        return result_of(self, Verdict.PASS, f"{len(shapes)} prompt shapes in order, token-exact")
