"""One request with a sampling value that breaks careless samplers fails none of its
neighbours (SRV-057)."""

from __future__ import annotations

from typing import Any

from pagedkv.certify.checks.greedy_requests import GreedyCase, greedy_body, run_greedy
from pagedkv.certify.context import CertifyContext
from pagedkv.certify.prompts import PromptSource
from pagedkv.certify.verdicts import CheckResult, Verdict, result_of

#: A temperature that underflows ``logits / temperature`` to infinities in float32.
TINY_TEMPERATURE = 1e-40


class PoisonedNeighbourCheck:
    """A request at ``temperature: 1e-40`` sent with as many greedy requests as the profile's
    concurrency allows, all at once: it is answered 200 or 4xx, never 5xx, and every greedy
    request equals the reference."""

    name = "poisoned_neighbour"
    spec_ids: tuple[str, ...] = ("SRV-057",)
    capability = "/completions"

    def run(self, context: CertifyContext) -> CheckResult:
        source = PromptSource(
            context.reference.vocab_size, list(context.reference.tokenizer.all_special_ids), 90
        )
        prompts = [source.tokens(8) for _ in range(max(context.profile.concurrency - 1, 1))]
        for prompt in prompts:
            context.reference.greedy(prompt, context.profile.new_tokens)
        poison: dict[str, Any] = {
            **greedy_body(context.model, source.tokens(8), context.profile.new_tokens),
            "temperature": TINY_TEMPERATURE,
            "seed": 0,
        }

        def send(index: int) -> GreedyCase | int:
            if index == 0:
                return context.client.post("/completions", poison).status
            return run_greedy(context, prompts[index - 1])

        outcomes = context.in_parallel(send, list(range(len(prompts) + 1)))
        status = outcomes[0]
        if isinstance(status, int) and status >= 500:
            return result_of(self, Verdict.FAIL, f"the poisoned request answered {status}", poison)
        for outcome in outcomes[1:]:
            if isinstance(outcome, GreedyCase) and outcome.verdict not in (
                Verdict.PASS,
                Verdict.TIE,
            ):
                detail = f"a neighbour of the poisoned request: {outcome.detail}"
                return result_of(self, Verdict.FAIL, detail, outcome.body, outcome.divergence)
        return result_of(self, Verdict.PASS, f"{len(prompts)} neighbours token-exact")
