"""Greedy token-exact checks on prompts built to stress paging (CRT-010, CRT-012)."""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.certify.checks.greedy_requests import GreedyCase, run_greedy, summarize
from pagedkv.certify.context import CertifyContext
from pagedkv.certify.prompts import PromptSource
from pagedkv.certify.verdicts import CheckResult

#: What a greedy check needs of a server.
GREEDY = "greedy completions of token-id prompts (temperature 0, ignore_eos)"


def _source(context: CertifyContext, seed: int) -> PromptSource:
    tokenizer = context.reference.tokenizer
    return PromptSource(context.reference.vocab_size, list(tokenizer.all_special_ids), seed)


def _greedy_all(context: CertifyContext, prompts: Sequence[tuple[int, ...]]) -> list[GreedyCase]:
    """Reference first (one at a time, cached), then every prompt sent concurrently."""
    for prompt in prompts:
        context.reference.greedy(prompt, context.profile.new_tokens)
    return context.in_parallel(lambda prompt: run_greedy(context, prompt), prompts)


class PageBoundaryCheck:
    """Pairs of prompts sharing a prefix that ends one before, at and one after a page boundary,
    for each page size of the profile: every first prompt is sent (concurrently), then every
    second one, which a prefix cache may serve from the first's pages."""

    name = "greedy_page_boundaries"
    spec_ids: tuple[str, ...] = ("CRT-010", "CRT-011")
    capability = GREEDY

    def run(self, context: CertifyContext) -> CheckResult:
        pairs = _source(context, seed=20).boundary_pairs(context.profile.page_sizes)
        cases = _greedy_all(context, [p.first for p in pairs])
        cases += _greedy_all(context, [p.second for p in pairs])
        return summarize(self.name, self.spec_ids, self.capability, cases)


class SamePromptCheck:
    """One prompt sent by many clients at once: each must get the reference's text."""

    name = "greedy_same_prompt_many_clients"
    spec_ids: tuple[str, ...] = ("CRT-012", "CRT-011", "SRV-007")
    capability = GREEDY

    def run(self, context: CertifyContext) -> CheckResult:
        prompt = _source(context, seed=21).tokens(2 * max(context.profile.page_sizes) + 5)
        cases = _greedy_all(context, [prompt] * context.profile.same_prompt_clients)
        return summarize(self.name, self.spec_ids, self.capability, cases)


class LongConcurrentCheck:
    """Many long prompts at once: enough KV to make a small server preempt, each prompt long
    enough to be prefilled in chunks."""

    name = "greedy_long_concurrent"
    spec_ids: tuple[str, ...] = ("CRT-012", "CRT-011", "SRV-007")
    capability = GREEDY

    def run(self, context: CertifyContext) -> CheckResult:
        source = _source(context, seed=22)
        prompts = [
            source.tokens(context.profile.long_prompt_tokens)
            for _ in range(context.profile.long_requests)
        ]
        cases = _greedy_all(context, prompts)
        return summarize(self.name, self.spec_ids, self.capability, cases)
